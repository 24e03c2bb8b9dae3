"""Pool backends behind one `Backend` protocol; `open_backend` picks one from the connector config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

from connectors.store.backends.base import Backend, BackendError, Status

__all__ = ["Backend", "BackendError", "Status", "open_backend", "BackendName", "BACKENDS"]

BackendName = Literal["mooncake", "memcache"]
BACKENDS: tuple[str, ...] = get_args(BackendName)


def open_backend(
    name: str, settings: Mapping[str, Any], *, call_timeout_s: float, device_memory: bool = False
) -> Backend:
    """Connect to the named backend; imports its client library only when chosen."""
    if name == "mooncake":
        from connectors.store.backends.mooncake import MooncakeBackend

        return MooncakeBackend(settings, call_timeout_s=call_timeout_s)
    if name == "memcache":
        from connectors.store.backends.memcache import MemcacheBackend

        return MemcacheBackend(settings, call_timeout_s=call_timeout_s, device_memory=device_memory)
    raise BackendError(
        f"kv_connector_extra_config.backend must be one of {', '.join(BACKENDS)}, got {name!r}"
    )
