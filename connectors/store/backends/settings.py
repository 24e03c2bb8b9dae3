"""The pool backends' settings groups (`kv_connector_extra_config.mooncake` / `.memcache`), read by
`parse_struct` wherever they are given: the pool connector's settings, a backend's config file, a
deployment spec's `pool.settings`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, get_args

import msgspec

from connectors.common.hosts import address_problem

BackendName = Literal["mooncake", "memcache"]
BACKENDS: tuple[str, ...] = get_args(BackendName)
"""The pool backends, one client module each beside this one."""

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


GROUPS: dict[str, type[_Settings]] = {"mooncake": MooncakeSettings, "memcache": MemcacheSettings}
"""Each backend's settings group, under the backend's name."""
