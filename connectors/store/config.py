"""The pool connector's settings, read once from `kv_connector_extra_config` with actionable errors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from connectors.store.backends import BACKENDS

PREFIX = "kv_connector_extra_config"


class StoreConfigError(ValueError):
    """A pool setting the user must change; the message names the option and the fix."""


@dataclass(frozen=True)
class StoreConfig:
    backend: str
    lookup_rpc_port: int
    backend_settings: Mapping[str, Any] = field(default_factory=dict)
    use_layerwise: bool = False
    load_async: bool = False
    discard_partial_chunks: bool = True
    consumer_is_to_put: bool = False
    lookup_timeout_s: float = 2.0
    """Longest the scheduler waits for a lookup answer before treating the request as a miss."""
    backend_timeout_s: float = 10.0
    """Bound on every backend call (exists/put/get)."""
    stats_file: str | None = None
    """If set, each worker keeps its cumulative counters in `<stats_file>.pp<P>.tp<T>.json`."""


def _flag(extra: Mapping[str, Any], name: str, default: bool) -> bool:
    value = extra.get(name, default)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise StoreConfigError(f"{PREFIX}.{name} must be true or false, got {value!r}")
    return value


def _positive(extra: Mapping[str, Any], name: str, default: float) -> float:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise StoreConfigError(f"{PREFIX}.{name} must be a positive number of milliseconds, got {value!r}")
    return float(value)


def parse_store_config(extra: Mapping[str, Any] | None) -> StoreConfig:
    extra = dict(extra or {})
    backend = extra.get("backend")
    if backend not in BACKENDS:
        raise StoreConfigError(
            f'{PREFIX}.backend must be one of {", ".join(BACKENDS)}, got {backend!r}; e.g. '
            '{"backend": "mooncake", "mooncake": {"master_server_address": "127.0.0.1:50051"}}'
        )
    port = extra.get("lookup_rpc_port")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise StoreConfigError(
            f"{PREFIX}.lookup_rpc_port must be an integer port 1-65535 (it names the scheduler->worker "
            f"lookup channel, one per DP rank), got {port!r}"
        )
    settings = extra.get(backend, {})
    if not isinstance(settings, Mapping):
        raise StoreConfigError(f"{PREFIX}.{backend} must be an object of backend settings, got {settings!r}")
    cfg = StoreConfig(
        backend=backend,
        lookup_rpc_port=port,
        backend_settings=dict(settings),
        use_layerwise=_flag(extra, "use_layerwise", False),
        load_async=_flag(extra, "load_async", False),
        discard_partial_chunks=_flag(extra, "discard_partial_chunks", True),
        consumer_is_to_put=_flag(extra, "consumer_is_to_put", False),
        lookup_timeout_s=_positive(extra, "lookup_timeout_ms", 2000) / 1000,
        backend_timeout_s=_positive(extra, "backend_timeout_ms", 10000) / 1000,
        stats_file=extra.get("stats_file") or None,
    )
    # Capabilities of this connector, independent of KVPP (KVPP's own rules live in kvpp_core.validation).
    if cfg.use_layerwise:
        raise StoreConfigError(f"{PREFIX}.use_layerwise=true is not implemented by this connector; set it to false "
                               "(whole blocks are saved after prefill and loaded before the request runs)")
    if not cfg.discard_partial_chunks:
        raise StoreConfigError(f"{PREFIX}.discard_partial_chunks=false is not implemented: only whole blocks are "
                               "pooled (their keys are content hashes of full blocks); set it to true")
    return cfg
