"""The pool connector's settings: `kv_connector_extra_config` read once into a typed struct.

Unknown keys are refused (a typo such as `load_asnyc` would otherwise silently keep the default),
and every problem comes back at once. `connectors.store.rules` applies the same reading to the engine's
config and to `kvpp check`'s rendered configs, so all three refuse the same settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from kvpp_core.config import Parsed, parse_struct

from connectors.common.names import EXTRA_CONFIG
from connectors.store.backends.bounds import CallPolicy
from connectors.store.backends.settings import GROUPS, BackendName, MemcacheSettings, MooncakeSettings

Millis = Annotated[float, msgspec.Meta(gt=0)]


class StoreSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What AscendStoreConnector reads from its kv_connector_extra_config."""

    backend: BackendName
    lookup_rpc_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    """Names the scheduler -> worker lookup socket (one per DP rank on a host); not a TCP port."""
    mooncake: MooncakeSettings | None = None
    memcache: MemcacheSettings | None = None
    use_layerwise: bool = False
    load_async: bool = False
    discard_partial_chunks: bool = True
    consumer_is_to_put: bool = False
    lookup_timeout_ms: Millis = 1000
    """Longest the scheduler waits for worker rank 0's lookup answer before treating the request as a miss; more
    than backend_timeout_floor_ms, the bound of the store call that answer waits for."""
    backend_timeout_ms: Millis = 3000
    """Ceiling on every store call's bound (exists, put, get, remove); the store client's own master-RPC and
    transfer-progress bounds follow it (connectors.store.backends.mooncake.native_bounds)."""
    backend_timeout_floor_ms: Millis = 500
    """Bound of a store call that moves no data (an existence check: every lookup), the least any call gets."""
    backend_timeout_slack: Annotated[float, msgspec.Meta(ge=1)] = 4.0
    """A put's or get's bound: the floor plus this many times what its bytes take at the rate recent successful
    puts and gets achieved (the ceiling until one has)."""
    pool_backoff_ms: Millis = 1000
    """After a store call the pool did not answer, every call fails at once this long (lookups, loads and saves
    alike, counted as failures), then one existence check asks again; doubled for each failure in a row."""
    pool_backoff_max_ms: Millis = 30000
    """The longest backoff; a pool that answered this long since its last failure starts again from
    pool_backoff_ms."""
    request_budget_ms: Millis | None = None
    """The most one request spends on the pool, whatever the concurrency: its lookups, then its load, waiting for
    its turn included. A request past it is served as a miss and recomputes (no call is started whose bound would
    end past it). At least backend_timeout_ms, so a load's first call fits; unset: lookup_timeout_ms +
    backend_timeout_ms (4000 by default)."""
    stats_file: str | None = None
    """If set, each worker keeps its cumulative counters in `<stats_file>.pp<P>.tp<T>.json`."""

    @property
    def backend_settings(self) -> MooncakeSettings | MemcacheSettings:
        """The chosen backend's settings group (all unset when not given)."""
        return getattr(self, self.backend) or GROUPS[self.backend]()

    @property
    def lookup_timeout_s(self) -> float:
        return self.lookup_timeout_ms / 1000

    @property
    def backend_timeout_s(self) -> float:
        return self.backend_timeout_ms / 1000

    @property
    def request_budget_s(self) -> float:
        given = self.request_budget_ms
        return (self.lookup_timeout_ms + self.backend_timeout_ms if given is None else given) / 1000

    @property
    def call_policy(self) -> CallPolicy:
        return CallPolicy(self.backend_timeout_floor_ms / 1000, self.backend_timeout_s, self.backend_timeout_slack,
                          self.pool_backoff_ms / 1000, self.pool_backoff_max_ms / 1000)


_HINTS = {
    "backend": 'e.g. {"backend": "mooncake", "mooncake": {"master_server_address": "127.0.0.1:50051"}}',
    "lookup_rpc_port": "an integer 1-65535 naming the scheduler->worker lookup channel, one per engine on a host",
    "mooncake": 'an object of Mooncake store client settings, e.g. {"master_server_address": "127.0.0.1:50051"}',
    "memcache": 'an object of memcache client settings, e.g. {"meta_service_url": "tcp://127.0.0.1:5000"}',
    "mooncake.master_server_address": 'mooncake_master\'s host:port, e.g. "10.0.0.9:50051" (an IPv6 address in '
                                      'brackets: "[fd00::9]:50051")',
    "mooncake.global_segment_size": "bytes this client contributes to the pool; 0 (the default) for engines",
    "mooncake.local_buffer_size": "bytes of the client's transfer buffer, e.g. 16777216",
}


def role_actions(kv_role: str | None, cfg: StoreSettings) -> tuple[bool, bool]:
    """(loads, saves) for a kv_role; a consumer saves only with consumer_is_to_put."""
    loads = kv_role in ("kv_both", "kv_consumer")
    saves = kv_role in ("kv_both", "kv_producer") or (kv_role == "kv_consumer" and cfg.consumer_is_to_put)
    return loads, saves


def read_store_settings(extra: Mapping[str, Any] | None) -> Parsed[StoreSettings]:
    """The struct and every problem of `extra`, including settings this connector does not implement."""
    parsed = parse_struct(extra, StoreSettings, EXTRA_CONFIG, _HINTS)
    # Capabilities of this connector, independent of KVPP (what KVPP needs lives in connectors.store.rules).
    if parsed.given.get("use_layerwise"):
        parsed.problems.append((f"{EXTRA_CONFIG}.use_layerwise", "true is not implemented by this connector; set it to "
                                "false (whole blocks are saved after prefill and loaded before the request runs)"))
    if parsed.given.get("discard_partial_chunks") is False:
        parsed.problems.append((f"{EXTRA_CONFIG}.discard_partial_chunks", "false is not implemented: only whole blocks "
                                "are pooled (their keys are content hashes of full blocks); set it to true"))
    parsed.problems += _order_problems(parsed.given)
    for other in GROUPS:
        if other != parsed.given.get("backend", other) and parsed.given.get(other) is not None:
            parsed.problems.append((f"{EXTRA_CONFIG}.{other}", f"is set but backend is {parsed.given['backend']}, so "
                                    f"it would be ignored; remove it or set \"backend\": \"{other}\""))
    if parsed.problems:
        parsed.value = None
    return parsed


_ORDERED = (
    ("backend_timeout_floor_ms", "backend_timeout_ms", False,
     "the floor of every store call's bound cannot exceed its ceiling"),
    ("backend_timeout_floor_ms", "lookup_timeout_ms", True,
     "a lookup's store call is bounded by the floor, so the scheduler would stop waiting before the worker does "
     "and every lookup of a dead pool would cost the scheduler lookup_timeout_ms"),
    ("pool_backoff_ms", "pool_backoff_max_ms", False, "the first backoff cannot exceed the longest"),
    ("backend_timeout_ms", "request_budget_ms", False,
     "a request's load could not start its first call, whose bound is the ceiling until a rate is measured"),
)
"""(lower, higher, strictly, why): settings that must keep this order (a higher one unset and without a default is
not checked)."""


def _order_problems(given: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Settings out of order, each named by the key the user set (the higher one when both are set)."""
    defaults = {f.name: f.default for f in msgspec.structs.fields(StoreSettings)}
    problems = []
    for low, high, strict, why in _ORDERED:
        lo, hi = given.get(low, defaults[low]), given.get(high, defaults[high])
        if hi is None:
            continue
        if lo > hi or (strict and lo == hi):
            named = high if high in given else low
            problems.append((f"{EXTRA_CONFIG}.{named}", f"{low} {lo:g} must be {'below' if strict else 'at most'} "
                             f"{high} {hi:g}: {why}; raise {high} or lower {low}"))
    return problems


def parse_store_settings(extra: Mapping[str, Any] | None) -> StoreSettings:
    return read_store_settings(extra).value_or_raise()
