"""The pool connector's settings: `kv_connector_extra_config` read once into a typed struct.

Unknown keys are refused (a typo such as `load_asnyc` would otherwise silently keep the default),
and every problem comes back at once. `kvpp_core.validation` applies the same reading to the engine's
config and to `kvpp check`'s rendered configs, so all three refuse the same settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from kvpp_core.config import Parsed, parse_struct

from connectors.store.backends import BackendName

PREFIX = "kv_connector_extra_config"


class StoreConfigError(ValueError):
    """A pool setting the user must change; the message names the option and the fix."""


Millis = Annotated[float, msgspec.Meta(gt=0)]


class StoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    backend: BackendName
    lookup_rpc_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    """Names the scheduler -> worker lookup socket (one per DP rank on a host); not a TCP port."""
    mooncake: dict[str, Any] | None = None
    """Mooncake store client settings (master_server_address, protocol, ...)."""
    memcache: dict[str, Any] | None = None
    """memcache client settings (or config_path to an mmc-local.conf)."""
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
    def backend_settings(self) -> dict[str, Any]:
        return dict(getattr(self, self.backend) or {})

    @property
    def lookup_timeout_s(self) -> float:
        return self.lookup_timeout_ms / 1000

    @property
    def backend_timeout_s(self) -> float:
        return self.backend_timeout_ms / 1000


_HINTS = {
    "backend": 'e.g. {"backend": "mooncake", "mooncake": {"master_server_address": "127.0.0.1:50051"}}',
    "lookup_rpc_port": "an integer 1-65535 naming the scheduler->worker lookup channel, one per engine on a host",
}


def read_store_config(extra: Mapping[str, Any] | None) -> Parsed[StoreConfig]:
    """The struct and every problem of `extra`, including settings this connector does not implement."""
    parsed = parse_struct(extra, StoreConfig, PREFIX, _HINTS)
    # Capabilities of this connector, independent of KVPP (KVPP's own rules live in kvpp_core.validation).
    if parsed.given.get("use_layerwise"):
        parsed.problems.append((f"{PREFIX}.use_layerwise", "true is not implemented by this connector; set it to "
                                "false (whole blocks are saved after prefill and loaded before the request runs)"))
    if parsed.given.get("discard_partial_chunks") is False:
        parsed.problems.append((f"{PREFIX}.discard_partial_chunks", "false is not implemented: only whole blocks "
                                "are pooled (their keys are content hashes of full blocks); set it to true"))
    if parsed.problems:
        parsed.value = None
    return parsed


def parse_store_config(extra: Mapping[str, Any] | None) -> StoreConfig:
    parsed = read_store_config(extra)
    if parsed.value is None:
        raise StoreConfigError("\n".join(f"{option}: {message}" for option, message in parsed.problems))
    return parsed.value
