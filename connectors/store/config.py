"""The pool connector's settings: `kv_connector_extra_config` read once into a typed struct.

Unknown keys are refused (a typo such as `load_asnyc` would otherwise silently keep the default),
and every problem comes back at once. `connectors.store.rules` applies the same reading to the engine's
config and to `kvpp check`'s rendered configs, so all three refuse the same settings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal, get_args

import msgspec

from kvpp_core.config import Parsed, parse_struct

from connectors.hosts import address_problem

BackendName = Literal["mooncake", "memcache"]
BACKENDS: tuple[str, ...] = get_args(BackendName)
"""The pool backends (`connectors.store.backends` holds their clients)."""
PREFIX = "kv_connector_extra_config"


class StoreConfigError(ValueError):
    """A pool setting the user must change; the message names the option and the fix."""


Millis = Annotated[float, msgspec.Meta(gt=0)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Text = Annotated[str, msgspec.Meta(min_length=1)]


class _Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """A backend's settings group; unset (None) fields are left to the backend's config file or defaults."""

    def explicit(self) -> dict[str, Any]:
        """The fields set here (None means unset), as plain values."""
        return msgspec.to_builtins(self)


class MooncakeSettings(_Settings):
    """`kv_connector_extra_config.mooncake`, and the JSON file it (or $MOONCAKE_CONFIG_PATH) names."""

    master_server_address: Text | None = None
    """Where mooncake_master listens, e.g. "10.0.0.9:50051" or "[fd00::9]:50051" (see `field_checks`)."""
    config_path: Text | None = None
    """A JSON file of these same settings; the ones given here win over it."""
    local_hostname: Text | None = None
    """Where peers reach this client's buffers (default: $VLLM_HOST_IP, else loopback)."""
    metadata_server: Text | None = None
    protocol: Text | None = None
    """Mooncake transport: "tcp" runs anywhere, "rdma" needs rdma_devices."""
    rdma_devices: str | None = None
    global_segment_size: NonNeg | None = None
    """Bytes this client contributes to the pool (engines: 0, the pool's holder owns the memory)."""
    local_buffer_size: NonNeg | None = None

    field_checks: ClassVar[dict[str, Callable[[str], str | None]]] = {"master_server_address": address_problem}
    """Applied by `parse_struct` wherever these settings are read (extra config, config file, deployment spec)."""


class MemcacheSettings(_Settings):
    """`kv_connector_extra_config.memcache`: memcache LocalConfig attributes, or a config file via
    config_path / $MMC_LOCAL_CONFIG_PATH."""

    meta_service_url: Text | None = None
    """e.g. "tcp://10.0.0.9:5000" or "tcp://[fd00::9]:5000"."""
    config_store_url: Text | None = None
    protocol: Text | None = None
    dram_size: Text | None = None
    """e.g. "1GB"."""
    hbm_size: Text | None = None
    max_dram_size: Text | None = None
    max_hbm_size: Text | None = None
    world_size: Positive | None = None
    log_level: Text | None = None
    client_timeout_seconds: NonNeg | None = None
    client_retry_milliseconds: NonNeg | None = None
    read_thread_pool_size: Positive | None = None
    write_thread_pool_size: Positive | None = None
    hcom_url: Text | None = None
    config_path: Text | None = None
    """An mmc-local.conf, used when no LocalConfig attribute is given here."""
    device_id: NonNeg = 0
    metadata_only: bool = False
    """True without an Ascend driver: lookups run, data calls report FAILED."""

    def local_config(self) -> dict[str, Any]:
        """The LocalConfig attributes set here (empty: the config file is used)."""
        return {k: v for k, v in self.explicit().items() if k not in _MEMCACHE_CLIENT_FIELDS}


_MEMCACHE_CLIENT_FIELDS = ("config_path", "device_id", "metadata_only")


class StoreConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
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
        return getattr(self, self.backend) or _SETTINGS[self.backend]()

    @property
    def lookup_timeout_s(self) -> float:
        return self.lookup_timeout_ms / 1000

    @property
    def backend_timeout_s(self) -> float:
        return self.backend_timeout_ms / 1000


_SETTINGS: dict[str, type[_Settings]] = {"mooncake": MooncakeSettings, "memcache": MemcacheSettings}

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


def role_actions(kv_role: str | None, cfg: StoreConfig) -> tuple[bool, bool]:
    """(loads, saves) for a kv_role; a consumer saves only with consumer_is_to_put."""
    loads = kv_role in ("kv_both", "kv_consumer")
    saves = kv_role in ("kv_both", "kv_producer") or (kv_role == "kv_consumer" and cfg.consumer_is_to_put)
    return loads, saves


def read_store_config(extra: Mapping[str, Any] | None) -> Parsed[StoreConfig]:
    """The struct and every problem of `extra`, including settings this connector does not implement."""
    parsed = parse_struct(extra, StoreConfig, PREFIX, _HINTS)
    # Capabilities of this connector, independent of KVPP (what KVPP needs lives in connectors.store.rules).
    if parsed.given.get("use_layerwise"):
        parsed.problems.append((f"{PREFIX}.use_layerwise", "true is not implemented by this connector; set it to "
                                "false (whole blocks are saved after prefill and loaded before the request runs)"))
    if parsed.given.get("discard_partial_chunks") is False:
        parsed.problems.append((f"{PREFIX}.discard_partial_chunks", "false is not implemented: only whole blocks "
                                "are pooled (their keys are content hashes of full blocks); set it to true"))
    for other in _SETTINGS:
        if other != parsed.given.get("backend", other) and parsed.given.get(other) is not None:
            parsed.problems.append((f"{PREFIX}.{other}", f"is set but backend is {parsed.given['backend']}, so "
                                    f"it would be ignored; remove it or set \"backend\": \"{other}\""))
    if parsed.problems:
        parsed.value = None
    return parsed


def parse_store_config(extra: Mapping[str, Any] | None) -> StoreConfig:
    parsed = read_store_config(extra)
    if parsed.value is None:
        raise StoreConfigError("\n".join(f"{option}: {message}" for option, message in parsed.problems))
    return parsed.value
