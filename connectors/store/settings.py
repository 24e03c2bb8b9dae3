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
    lookup_timeout_ms: Millis = 2000
    """Longest the scheduler waits for a lookup answer before treating the request as a miss."""
    backend_timeout_ms: Millis = 10000
    """Bound on every backend call (exists/put/get)."""
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
    for other in GROUPS:
        if other != parsed.given.get("backend", other) and parsed.given.get(other) is not None:
            parsed.problems.append((f"{EXTRA_CONFIG}.{other}", f"is set but backend is {parsed.given['backend']}, so "
                                    f"it would be ignored; remove it or set \"backend\": \"{other}\""))
    if parsed.problems:
        parsed.value = None
    return parsed


def parse_store_settings(extra: Mapping[str, Any] | None) -> StoreSettings:
    return read_store_settings(extra).value_or_raise()
