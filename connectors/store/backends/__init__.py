"""Pool backends behind one `Backend` protocol; `open_backend` picks one from the pool connector's settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from connectors.store.backends.base import Backend, BackendError, Status
from connectors.store.backends.bounds import CallPolicy

__all__ = ["Backend", "BackendError", "Status", "open_backend"]

if TYPE_CHECKING:
    from connectors.store.settings import StoreSettings


def open_backend(cfg: StoreSettings, *, call_timeout_s: float | None = None, device_memory: bool = False) -> Backend:
    """Connect to the configured backend with its typed settings, each call bounded as the settings say (or by
    `call_timeout_s` alone, for tools and tests that choose their own bound); imports its client library only
    when chosen."""
    policy = cfg.call_policy if call_timeout_s is None else CallPolicy.fixed(call_timeout_s)
    if cfg.backend == "mooncake":
        from connectors.store.backends.mooncake import MooncakeBackend

        return MooncakeBackend(cfg.backend_settings, policy=policy)
    from connectors.store.backends.memcache import MemcacheBackend

    return MemcacheBackend(cfg.backend_settings, policy=policy, device_memory=device_memory)
