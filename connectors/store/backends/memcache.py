"""memcache-hybrid backend (Ascend): layer-wise batch put/get through a DistributedObjectStore.

Configured from explicit settings (`kv_connector_extra_config.memcache`) or, as memcache users do,
from the file named by $MMC_LOCAL_CONFIG_PATH. Without an Ascend driver only the metadata client
works (`metadata_only: true`): lookups run, data calls report FAILED.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from connectors.store.backends.base import BackendError, BoundedClient, Status, all_status
from connectors.store.backends.bounds import CallPolicy
from connectors.store.backends.settings import MemcacheSettings

CONFIG_ENV = "MMC_LOCAL_CONFIG_PATH"
# memfabric copy directions (memfabric_hybrid.bm.BmCopyType): host DRAM or device HBM <-> pool.
_H2G, _G2H, _L2G, _G2L = 3, 2, 0, 1


def local_config(settings: MemcacheSettings):
    """A LocalConfig from the explicit settings (None when only the config file is used)."""
    import memcache_hybrid

    explicit = settings.local_config()
    if not explicit:
        return None
    cfg = memcache_hybrid.LocalConfig()
    for key, value in explicit.items():
        setattr(cfg, key, value)
    return cfg


class MemcacheBackend(BoundedClient):
    name = "memcache"

    def __init__(self, settings: MemcacheSettings, *, policy: CallPolicy, device_memory: bool = False) -> None:
        try:
            import memcache_hybrid
        except ImportError as exc:
            raise BackendError("backend 'memcache' needs memcache-hybrid and memfabric-hybrid "
                               "(pip install memcache-hybrid memfabric-hybrid)") from exc
        if settings.config_path:
            os.environ[CONFIG_ENV] = settings.config_path
        cfg = local_config(settings)
        if cfg is None and not os.environ.get(CONFIG_ENV):
            raise BackendError(
                f"the memcache backend needs ${CONFIG_ENV} (a mmc-local.conf) or explicit settings in "
                'kv_connector_extra_config.memcache (e.g. {"meta_service_url": "tcp://127.0.0.1:5000", '
                '"config_store_url": "tcp://127.0.0.1:6000"}); `kvpp pool up --backend memcache --json` prints one'
            )
        self._store = memcache_hybrid.DistributedObjectStore()
        if cfg is not None:
            rc = self._store.setup(cfg)
            if rc != 0:
                raise BackendError(f"memcache LocalConfig setup failed with {rc}; check kv_connector_extra_config.memcache")
        self.metadata_only = settings.metadata_only
        rc = self._store.init(settings.device_id, not self.metadata_only)
        if rc != 0:
            raise BackendError(
                f"memcache client init failed with {rc}: is the MetaService running at the configured "
                "meta_service_url? The data path (metadata_only false) needs an Ascend driver"
            )
        self._put_dir, self._get_dir = (_L2G, _G2L) if device_memory else (_H2G, _G2H)
        self._guard(policy)

    def register(self, ptr: int, size: int) -> None:
        if self.metadata_only:
            return
        rc = self._store.register_buffer(ptr, size)
        if rc != 0:
            raise BackendError(f"memcache register_buffer({size} bytes) failed with {rc}")

    def put(self, keys, ptrs, sizes, settled=None) -> list[Status]:
        if self.metadata_only:
            return self._no_data_path(keys, settled)

        def call() -> list[Status]:
            codes = self._store.batch_put_from_layers(list(keys), [list(p) for p in ptrs],
                                                      [list(s) for s in sizes], self._put_dir)
            return [Status.OK if c == 0 else Status.FAILED for c in codes]

        return self._bounded(call, keys, sum(map(sum, sizes)), settled)

    def get(self, keys, ptrs, sizes, settled=None) -> list[Status]:
        if self.metadata_only:
            return self._no_data_path(keys, settled)

        def call() -> list[Status]:
            # Refuse objects whose size differs before any byte lands in the cache.
            infos = self._store.batch_get_key_info(list(keys))
            status = [Status.OK if info.size() == sum(s) else
                      Status.MISSING if info.size() <= 0 else Status.WRONG_SIZE
                      for info, s in zip(infos, sizes)]
            todo = [i for i, st in enumerate(status) if st is Status.OK]
            if todo:
                codes = self._store.batch_get_into_layers([keys[i] for i in todo], [list(ptrs[i]) for i in todo],
                                                          [list(sizes[i]) for i in todo], self._get_dir)
                for i, code in zip(todo, codes):
                    status[i] = Status.OK if code == 0 else Status.FAILED
            return status

        return self._bounded(call, keys, sum(map(sum, sizes)), settled)

    @staticmethod
    def _no_data_path(keys, settled) -> list[Status]:
        """Without an Ascend driver (metadata_only) no data call is made: each object FAILED."""
        if settled is not None:
            settled()
        return all_status(len(keys), Status.FAILED)

    def remove(self, keys: Sequence[str]) -> list[Status]:
        def call() -> list[Status]:
            return [Status.OK if c == 0 else Status.FAILED for c in self._store.remove_batch(list(keys))]

        return self._bounded(call, keys)
