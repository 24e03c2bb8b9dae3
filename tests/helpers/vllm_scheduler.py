"""vLLM's own `Scheduler` with one of this project's connectors and no engine: the ground of the
scheduler-level contract tests, which run under every supported vLLM (`make test` runs them again in
the vLLM 0.33.0 environment). The model runner's part of a step is played by `step`: it samples one
token per scheduled request and reports what the connector's workers would (finished transfers, failed
blocks), exactly in the structures vLLM's runner returns."""

from __future__ import annotations

from collections.abc import Callable, Iterable

BLOCK = 16
EOS_FREE_TOKEN = 7
"""The token every step samples (the tiny model's vocabulary has no EOS there)."""


def engine_config(model: str, kv_transfer_config: dict | None, max_num_batched_tokens: int = 256,
                  max_model_len: int = 1024, max_num_seqs: int = 8):
    """The tiny model's engine config, built by vLLM (the plugin's launch check included) with
    `kv_transfer_config`; the plugin registers the connector names first, as in an engine."""
    from vllm.engine.arg_utils import EngineArgs

    from connectors.plugin import register
    from deploy.services.processes import REFERENCE

    register()
    return EngineArgs(
        model=model, **REFERENCE.engine_args(), enforce_eager=True, max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, enable_chunked_prefill=True,
        enable_prefix_caching=True, kv_transfer_config=kv_transfer_config,
    ).create_engine_config()


def scheduler(model_or_config, kv_transfer_config: dict | None = None, num_blocks: int = 64, block_size: int = BLOCK,
              scheduler_cls=None, **config_args):
    """A real Scheduler (or `scheduler_cls`, e.g. vLLM's AsyncScheduler) over `num_blocks` MLA blocks of the tiny
    model, its connector (if any) built by vLLM; from a model path, or from an `engine_config` a test adjusted
    first."""
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = (engine_config(model_or_config, kv_transfer_config, **config_args)
              if isinstance(model_or_config, str) else model_or_config)
    config.cache_config.num_gpu_blocks = num_blocks  # what the engine sets after profiling the workers
    spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(config.model_config.hf_text_config.num_hidden_layers)]
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return (scheduler_cls or Scheduler)(config, kv_cache_config, StructuredOutputManager(config), block_size=block_size,
                                        log_stats=True)


def request(req_id: str, prompt: list[int], max_tokens: int = 1, kv_transfer_params: dict | None = None,
            block_size: int = BLOCK):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args=None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params})
    return Request(req_id, prompt, params, None, block_hasher=get_request_block_hasher(block_size, sha256))


def step(sched, **report):
    """One engine step: schedule, then `report_step`. Returns (scheduler output, engine outputs)."""
    out = sched.schedule()
    return out, report_step(sched, out, **report)


def report_step(sched, out, finished_sending: Iterable[str] = (), finished_recving: Iterable[str] = (),
                invalid_block_ids: Iterable[int] = (), sample: Callable[[object], int] | None = None):
    """The runner's output for `out` (a token for each scheduled request whose step reaches its end, `sample(request)`
    or EOS_FREE_TOKEN; the scheduler has already counted the step's tokens as computed) with
    the connector workers' report, handed to the scheduler; returns its engine outputs."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = sched.requests[req_id]
        token = EOS_FREE_TOKEN if sample is None else sample(req)
        sampled.append([token] if req.num_computed_tokens >= req.num_tokens else [])
    connector_output = KVConnectorOutput(finished_sending=set(finished_sending) or None,
                                         finished_recving=set(finished_recving) or None,
                                         invalid_block_ids=set(invalid_block_ids))
    runner = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                               sampled_token_ids=sampled, kv_connector_output=connector_output)
    return sched.update_from_output(out, runner)


def free_blocks(sched) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def block_ids(sched, req_id: str) -> list[int]:
    (ids,) = sched.kv_cache_manager.get_block_ids(req_id)
    return list(ids)
