"""AscendStoreConnector: vLLM KV connector for a shared prefix pool (Mooncake store or memcache).

A thin facade: vLLM creates one instance per process and role; the scheduler side (lookups, load and
save planning) and the worker side (this rank's shard I/O) live in their own modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.logger import init_logger

from connectors.common.kv_caches import cache_groups_problem
from connectors.common.names import STORE
from connectors.common.startup import connector_settings
from connectors.store.metadata import StoreMetadata
from connectors.store.settings import parse_store_settings
from connectors.store.stats import StorePromMetrics, StoreStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's handlers print it


class AscendStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        # every problem of the launch at once, this connector's settings included, checked once per process
        settings = connector_settings(vllm_config, STORE, parse_store_settings)
        problem = cache_groups_problem(vllm_config, kv_cache_config, STORE)
        if problem is not None:
            raise ValueError(problem)
        if transfer.kv_load_failure_policy != "recompute":
            logger.warning(
                "AscendStoreConnector: kv_load_failure_policy is %r; a pooled block that cannot be loaded "
                "(evicted shard, store down, wrong size) then fails the request. Set "
                '"kv_load_failure_policy": "recompute" to recompute it instead', transfer.kv_load_failure_policy)
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from connectors.store.scheduler import StoreScheduler

            self._scheduler = StoreScheduler(vllm_config, settings)
        else:
            from connectors.store.worker import StoreWorker

            self._worker = StoreWorker(vllm_config, settings)

    @property
    def requires_kv_delivery(self) -> bool:
        # A dropped save is only a future miss: never recompute a request to protect one.
        return False

    # ---- worker side ---------------------------------------------------------------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """No (vLLM 0.33 asks; it then refuses `enable_sleep_mode` with this connector, naming it). The
        worker registers its KV caches with the store client (zero-copy puts and gets read and write
        them in place); sleep releases and remaps that memory, so a save or load in flight across
        sleep and wake would touch stale pages."""
        return False

    def register_kv_caches(self, kv_caches):
        self._worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        assert isinstance(kv_connector_metadata, StoreMetadata)
        self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete before the request is scheduled (async) or before the forward (sync)."""

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """Whole blocks are saved after the step in wait_for_save, not layer by layer."""

    def wait_for_save(self):
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]):
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self._worker.take_shard_report()

    def get_kv_connector_stats(self):
        side = self._worker if self._worker is not None else self._scheduler
        return side.get_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return StoreStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return StorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self):
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> StoreMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids: list[int]):
        return self._scheduler.request_finished(request, block_ids)

    def take_events(self):
        return self._scheduler.take_events()
