"""A vLLM launch in the planner's terms, so that a running engine is validated by exactly the rules
`kvpp check` applies to a deployment spec."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvpp_core.config import KvppConfig
from kvpp_core.cpu_backends import BACKENDS, host_has_amx, selected
from kvpp_core.layer_settings import transport_choice
from kvpp_core.model import ModelSpec, normalize_dtype
from kvpp_core.topology import Topology


@dataclass(frozen=True)
class LaunchRequest:
    """Engine features the launch asked for by name (`--enable-prefix-caching`, ...; None: left to vLLM).
    vLLM turns some of them off on CPU without an error, so only the request tells they were wanted."""

    prefix_caching: bool | None = None
    chunked_prefill: bool | None = None
    async_scheduling: bool | None = None
    attention_backend: str | None = None
    """`--attention-backend` as given (vLLM runs CPU_MLA instead of AMX_MLA on a host without AMX)."""


@dataclass(frozen=True)
class KvppSetup:
    """The parts of a vLLM launch that decide whether KVPP may run."""

    model: ModelSpec | None
    """None only when KVPP is off (then only the connectors' settings are checked)."""
    topology: Topology
    enforce_eager: bool
    kvpp: KvppConfig
    kv_connector: str | None = None
    kv_role: str | None = None
    kv_extra: dict[str, Any] = field(default_factory=dict)
    cudagraph_mode: str | None = None
    """vLLM's resolved CUDA graph mode (NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE);
    None when unknown (a deployment spec): vLLM's default then, FULL_AND_PIECEWISE on GPUs."""
    splitting_ops: tuple[str, ...] | None = None
    """The ops vLLM splits the compiled graph at; None when unknown."""
    speculative_method: str | None = None
    """speculative_config.method (None: no speculative decoding)."""
    device: str | None = None
    """Where the KV cache lives (vLLM's device type: cpu, cuda, npu, ...); None when unknown (a spec)."""
    machine: str | None = None
    """The serving host's architecture (platform.machine()); None when unknown (checked elsewhere)."""
    nnodes: int = 1
    """Hosts one instance spans (vLLM's --nnodes; a spec's hosts)."""
    attention_backend: str | None = None
    """The CPU attention kernel the target model runs on (kvpp_core.cpu_backends); None off CPU or when unknown."""
    draft_attention_backend: str | None = None
    """The CPU attention kernel of the MTP/draft caches, which vLLM picks apart from the target's."""
    dtype: str | None = None
    """The model's compute (and KV cache) dtype; None when unknown."""
    block_size: int | None = None
    """Tokens per KV block as the engine runs them; None when unknown."""
    expert_parallel: bool = False
    """vLLM's --enable-expert-parallel."""
    transport: str | None = None
    """KVPP_BROADCAST_TRANSPORT as the launch's environment sets it (kvpp_core.layer_settings); None when unknown."""
    request: LaunchRequest = LaunchRequest()

    def __post_init__(self) -> None:
        # The cache-replica groups follow the model's KV (kvpp_core.topology): derived here once, for every setup.
        if self.model is not None and self.topology.kv_heads != self.model.replicated_kv_heads:
            object.__setattr__(self, "topology", replace(self.topology, kv_heads=self.model.replicated_kv_heads))


def _pp_partition(value: str | None) -> tuple[int, ...] | None:
    """vLLM's explicit PP split (VLLM_PP_LAYER_PARTITION="38,40"), so stage layers match vLLM's."""
    return tuple(int(x) for x in value.split(",")) if value else None


def _cpu_kernels(vllm_config) -> tuple[str | None, str | None]:
    """The CPU attention kernels of the target and of its drafter, chosen by vLLM's rule (None off CPU)."""
    if vllm_config.device_config.device_type != "cpu":
        return None, None
    amx, mla = host_has_amx(), vllm_config.model_config.use_mla
    target = vllm_config.attention_config.backend
    kernel = selected(None if target is None else target.name, amx, mla).name
    speculative = vllm_config.speculative_config
    if speculative is None:
        return kernel, None
    draft = speculative.attention_backend
    return kernel, selected(None if draft is None else draft.name, amx, mla).name


def _block_size(cache_config, kernel: str | None) -> int:
    """The block size the engine will run: a CPU kernel's own rule over what the launch asked (vLLM 0.33 sets
    the kernel's default only once the backend is chosen, after the config is built)."""
    asked = cache_config.block_size if cache_config.user_specified_block_size else None
    return BACKENDS[kernel].block_size(asked) if kernel else cache_config.block_size


def setup_from_vllm_config(vllm_config, kvpp: KvppConfig, request: LaunchRequest = LaunchRequest()) -> KvppSetup:
    transfer = vllm_config.kv_transfer_config
    connector = dict(
        kv_connector=None if transfer is None else transfer.kv_connector,
        kv_role=None if transfer is None else transfer.kv_role,
        kv_extra={} if transfer is None else dict(transfer.kv_connector_extra_config or {}),
    )
    if not kvpp.enabled:  # only the connectors' settings are checked: never describe a model KVPP does not run on
        return KvppSetup(model=None, topology=Topology(tp=1), enforce_eager=True, kvpp=kvpp, **connector)
    import platform

    import vllm.envs as envs

    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    compilation = vllm_config.compilation_config
    speculative = vllm_config.speculative_config
    dtype = normalize_dtype(str(model_config.dtype))
    kernel, draft_kernel = _cpu_kernels(vllm_config)
    backend = vllm_config.attention_config.backend
    return KvppSetup(
        model=ModelSpec.from_hf_dict(model_config.hf_config.to_dict(), model_config.model).with_overrides(
            kv_dtype=dtype if vllm_config.cache_config.cache_dtype == "auto" else None),
        topology=Topology(
            tp=parallel.tensor_parallel_size,
            pp=parallel.pipeline_parallel_size,
            pp_layers=_pp_partition(envs.VLLM_PP_LAYER_PARTITION),
            pcp=parallel.prefill_context_parallel_size,
            dcp=parallel.decode_context_parallel_size,
            dp=parallel.data_parallel_size,
            # vLLM's own resolution: VLLM_USE_V2_MODEL_RUNNER when set, else V2 wherever Triton runs
            # and no feature needs V1 (the CUDA default); an unset variable is not V1.
            runner="v2" if vllm_config.use_v2_model_runner else "v1",
        ),
        enforce_eager=model_config.enforce_eager,
        kvpp=kvpp,
        **connector,
        cudagraph_mode=None if compilation.cudagraph_mode is None else compilation.cudagraph_mode.name,
        splitting_ops=None if compilation.splitting_ops is None else tuple(compilation.splitting_ops),
        speculative_method=None if speculative is None else speculative.method,
        device=vllm_config.device_config.device_type,
        machine=platform.machine(),
        nnodes=parallel.nnodes,
        attention_backend=kernel,
        draft_attention_backend=draft_kernel,
        dtype=dtype,
        block_size=_block_size(vllm_config.cache_config, kernel),
        expert_parallel=parallel.enable_expert_parallel,
        transport=transport_choice(),
        request=replace(request, attention_backend=None if backend is None else backend.name),
    )
