"""MooncakeConnectorV2: P/D disaggregation over the Mooncake transfer engine, KVPP-aware.

vLLM builds one instance per process with a role; this class only routes each call to the
scheduler-side or worker-side object, like vLLM's own connectors. Nothing here touches
`torch.accelerator`, so it runs on CPU hosts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from connectors.common.kv_caches import cache_groups_problem
from connectors.common.names import MOONCAKE
from connectors.common.startup import connector_settings
from connectors.mooncake.messages import is_ident
from connectors.mooncake.metadata import MooncakeV2Metadata
from connectors.mooncake.settings import parse_mooncake_v2_settings
from connectors.mooncake.stats import MooncakeV2PromMetrics, MooncakeV2Stats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class MooncakeConnectorV2(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        # startup refusals (KVPP on a consumer, KVPP + PCP, wrong role...), checked once per process
        settings = connector_settings(vllm_config, MOONCAKE, parse_mooncake_v2_settings)
        problem = cache_groups_problem(vllm_config, kv_cache_config, MOONCAKE)
        if problem is not None:
            raise ValueError(problem)
        engine_id = vllm_config.kv_transfer_config.engine_id
        if not is_ident(engine_id):
            raise ValueError(f"kv_transfer_config.engine_id {engine_id!r} cannot travel in kv_transfer_params: "
                             "use 1-256 visible ASCII characters (no spaces), or leave it unset")
        self._scheduler = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from connectors.mooncake.scheduler import MooncakeV2Scheduler

            self._scheduler = MooncakeV2Scheduler(vllm_config, engine_id, settings)
        else:
            from connectors.mooncake.worker import MooncakeV2Worker

            self._worker = MooncakeV2Worker(vllm_config, engine_id, settings)

    # ---- scheduler side ----------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def has_pending_block_frees(self) -> bool:
        return self._scheduler.has_pending_block_frees()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return MooncakeV2Stats(data=data) if data is not None else MooncakeV2Stats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return MooncakeV2PromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker side -------------------------------------------------------------------------

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """No (vLLM 0.33 asks; it then refuses `enable_sleep_mode` with this connector, naming it). The
        worker registers its KV caches with the Mooncake transfer engine and publishes their addresses to
        decode peers; sleep releases and remaps that memory, so held blocks and every peer's metadata
        would point at stale pages. Refusing is the honest answer until re-registration and a metadata
        refresh are built and tested."""
        return False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeV2Metadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous; nothing waits per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Pull model: the decode reads from the prefill's own cache, nothing is pushed."""

    def wait_for_save(self) -> None:
        """Pull model: nothing to save."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return (self._worker or self._scheduler).get_stats()

    def shutdown(self) -> None:
        (self._worker or self._scheduler).shutdown()
