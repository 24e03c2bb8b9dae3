"""Describe a running vLLM configuration in the planner's terms, so that the engine is validated
by exactly the rules `kvpp check` applies to a deployment spec."""

from __future__ import annotations

from kvpp_core.config import KvppConfig
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology
from kvpp_core.validation import KvppSetup


def _pp_partition(value: str | None) -> tuple[int, ...] | None:
    """vLLM's explicit PP split (VLLM_PP_LAYER_PARTITION="38,40"), so stage layers match vLLM's."""
    return tuple(int(x) for x in value.split(",")) if value else None


def setup_from_vllm_config(vllm_config, kvpp: KvppConfig) -> KvppSetup:
    import vllm.envs as envs

    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    transfer = vllm_config.kv_transfer_config
    events = vllm_config.kv_events_config
    compilation = vllm_config.compilation_config
    speculative = vllm_config.speculative_config
    return KvppSetup(
        model=ModelSpec.from_hf_dict(model_config.hf_config.to_dict(), model_config.model),
        topology=Topology(
            tp=parallel.tensor_parallel_size,
            pp=parallel.pipeline_parallel_size,
            pp_layers=_pp_partition(envs.VLLM_PP_LAYER_PARTITION),
            pcp=parallel.prefill_context_parallel_size,
            dcp=parallel.decode_context_parallel_size,
            dp=parallel.data_parallel_size,
            runner="v2" if envs.VLLM_USE_V2_MODEL_RUNNER else "v1",  # None (auto) means V1 here
        ),
        enforce_eager=model_config.enforce_eager,
        kvpp=kvpp,
        kv_connector=None if transfer is None else transfer.kv_connector,
        kv_role=None if transfer is None else transfer.kv_role,
        kv_extra={} if transfer is None else dict(transfer.kv_connector_extra_config or {}),
        kv_events=bool(events is not None and events.enable_kv_cache_events),
        cudagraph_mode=None if compilation.cudagraph_mode is None else compilation.cudagraph_mode.name,
        splitting_ops=None if compilation.splitting_ops is None else tuple(compilation.splitting_ops),
        speculative_method=None if speculative is None else speculative.method,
    )
