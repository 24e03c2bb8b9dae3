"""The one offline vLLM engine of the tests and the benchmarks: its settings, the one place it is built, and
the one loop that steps its requests.

The engine core runs in the driver's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): one Python start-up
(~20 s here) less per run, and the step at which a request joins depends on the steps taken, not on
wall-clock time, so runs that step at different speeds (KVPP off and on) batch alike. With TP or PP > 1 the
workers are still processes of their own, as in a served engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec

from deploy.services.processes import CPU_ENGINES, REFERENCE
from testbed.block_zeroing import BLOCK_ZEROING
from testbed.kv_events import events_config

Positive = Annotated[int, msgspec.Meta(ge=1)]


class EngineSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """An engine of a local model: fp32 on the reference kernel (exact, any host), or bf16 on AMX_MLA (a host with
    AMX; vLLM's prefix cache and chunked prefill on), as deploy.services.processes.CpuEngine names them."""

    model: str
    kernel: Literal[tuple(CPU_ENGINES)] = REFERENCE.kernel.name
    tp: Positive = 1
    pp: Positive = 1
    """PP stages; the split comes from VLLM_PP_LAYER_PARTITION."""
    mtp: Annotated[int, msgspec.Meta(ge=0)] = 0
    """MTP speculative tokens (the model needs MTP layers)."""
    kvpp: bool = False
    staging: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """kvpp_staging_buffers (0: zero-copy); None: not named, so the default where the engine runs (kvpp_core.modes:
    zero-copy on this host's CPU, where it can run)."""
    compiled: bool = False
    """torch.compile instead of eager mode."""
    kv_bytes: Positive = 64 << 20
    max_model_len: Positive = 1024
    max_num_batched_tokens: Positive | None = None
    max_num_seqs: Positive | None = None
    enable_prefix_caching: bool | None = None
    """None: vLLM's choice (on with AMX_MLA; the reference kernel has it off for MLA)."""
    kv_transfer_config: dict | None = None
    kv_events: str | None = None
    """A ZMQ endpoint (ipc://...) the engine publishes its KV cache events on, replays beside it (testbed.kv_events)."""
    worker_extension: str = ""
    """A worker_extension_cls (qualified name) every worker imports: a test's patches there."""

    @property
    def workers(self) -> int:
        return self.tp * self.pp


def build_llm(settings: EngineSettings, block_zeroing: bool = False):
    """The engine, its scheduler's gauges and counters on (`llm_metric`); `block_zeroing` installs BlockZeroing
    in every worker."""
    if block_zeroing and settings.worker_extension:
        raise ValueError("a worker extension and block zeroing each set the worker extension; use one of them")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    additional = {}
    if settings.kvpp:
        additional = {"enable_kvpp": True, **({} if settings.staging is None else
                                              {"kvpp_staging_buffers": settings.staging})}
    optional: dict[str, Any] = {}
    if settings.workers > 1:
        optional["distributed_executor_backend"] = "mp"
    if settings.kv_transfer_config is not None:
        optional["kv_transfer_config"] = settings.kv_transfer_config
    if settings.kv_events is not None:
        optional["kv_events_config"] = events_config(settings.kv_events)
    for name in ("max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching"):
        if getattr(settings, name) is not None:
            optional[name] = getattr(settings, name)
    return LLM(
        model=settings.model, tensor_parallel_size=settings.tp, pipeline_parallel_size=settings.pp,
        **CPU_ENGINES[settings.kernel].engine_args(settings.mtp), enforce_eager=not settings.compiled,
        kv_cache_memory_bytes=settings.kv_bytes, additional_config=additional,
        max_model_len=settings.max_model_len, seed=0, disable_log_stats=False,
        worker_extension_cls=BLOCK_ZEROING if block_zeroing else settings.worker_extension, **optional,
    )


def greedy(max_tokens: int, extra_args: dict | None = None):
    """Sampling of every driven request: greedy, exactly `max_tokens` tokens, each with its logprob."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True, extra_args=extra_args)


def tokens_and_logprobs(out) -> tuple[list[int], list[float]]:
    """A finished request's tokens and the logprob of each."""
    comp = out.outputs[0]
    return list(comp.token_ids), [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]


def llm_metric(llm, name: str) -> float:
    """One of vLLM's own metrics of the engine, summed over its label sets."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)


class Stepper:
    """Requests stepped by hand (LLM.generate's loop, opened up): a workload adds requests between steps,
    each step is timed, and `after_step` acts after each (zeroing blocks, reading gauges)."""

    def __init__(self, llm, after_step: Callable[[Stepper], None] | None = None):
        self.engine = llm.llm_engine
        self.after_step = after_step
        self.finished: dict[str, Any] = {}
        """Request id -> its final RequestOutput."""
        self.step_seconds: list[float] = []
        self.added_at: dict[str, int] = {}
        self.engine_ids: dict[str, str] = {}
        """Request id -> the id the engine gave it (vLLM 0.32 makes ids unique with a suffix)."""
        self.prefill_steps: dict[str, int] = {}
        """Request id -> the steps from its arrival to its first token: more than one when chunked prefill
        split its prompt (or the scheduler queued it)."""

    def add(self, request_id: str, ids: list[int], params, cache_salt: str | None = None) -> None:
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt
        self.engine_ids[request_id] = self.engine.add_request(request_id, prompt, params)
        self.added_at[request_id] = len(self.step_seconds)

    def block_ids(self, request_id: str) -> list[int]:
        """A running request's KV block ids, from the scheduler of the engine core this process runs
        (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: vLLM 0.32's in-process client)."""
        scheduler = self.engine.engine_core.engine_core.scheduler
        (ids,) = scheduler.kv_cache_manager.get_block_ids(self.engine_ids[request_id])
        return list(ids)

    def step(self) -> None:
        started = time.perf_counter()
        outputs = self.engine.step()
        self.step_seconds.append(time.perf_counter() - started)
        for out in outputs:
            if out.outputs[0].token_ids and out.request_id not in self.prefill_steps:
                self.prefill_steps[out.request_id] = len(self.step_seconds) - self.added_at[out.request_id]
        self.finished.update((out.request_id, out) for out in outputs if out.finished)
        if self.after_step is not None:
            self.after_step(self)

    def finish(self) -> dict[str, Any]:
        """Step until every request has finished; `finished`."""
        while self.engine.has_unfinished_requests():
            self.step()
        return self.finished
