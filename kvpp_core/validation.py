"""Checks a KVPP deployment against the constraints KVPP is known to work under.

Every problem is reported at once, each naming the option to change and how, so that an operator
fixes a launch command in one pass. Pure Python: the vLLM adapter and `kvpp check`/`kvpp plan` build
a `KvppSetup` and call `validate`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from kvpp_core.config import ENABLE_KEY, KvppConfig, KvppConfigError
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology

MOONCAKE = "MooncakeConnectorV2"
STORE = "AscendStoreConnector"
MULTI = "MultiConnector"
_DISABLE = f"remove {ENABLE_KEY} from --additional-config"

# AscendStoreConnector extra-config keys KVPP depends on: (required value, the connector's default).
_STORE_FLAGS = {
    "use_layerwise": (False, False),
    "load_async": (True, False),
    "discard_partial_chunks": (True, True),
    "consumer_is_to_put": (False, False),
}
_STORE_FLAG_WHY = {
    "use_layerwise": "layerwise pooling would save/load layers this rank does not own",
    "load_async": "KVPP restores its persistent buffers with asynchronous loads only",
    "discard_partial_chunks": "only whole blocks can be sharded by owner",
    "consumer_is_to_put": "consumer write-back is not supported with KVPP",
}


@dataclass(frozen=True)
class Problem:
    severity: str
    """"error" (KVPP must not start) or "warning" (it starts but something is off)."""
    option: str
    message: str
    """What is wrong and the fix."""

    def __str__(self) -> str:
        return f"{self.option}: {self.message}"


@dataclass(frozen=True)
class KvppSetup:
    """The parts of a vLLM launch that decide whether KVPP may run."""

    model: ModelSpec
    topology: Topology
    enforce_eager: bool
    kvpp: KvppConfig
    kv_connector: str | None = None
    kv_role: str | None = None
    kv_extra: dict[str, Any] = field(default_factory=dict)
    kv_events: bool = False
    cudagraph_mode: str | None = None
    """vLLM's resolved CUDA graph mode (NONE, PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE);
    None when unknown (a deployment spec): vLLM's default then, FULL_AND_PIECEWISE on GPUs."""
    splitting_ops: tuple[str, ...] | None = None
    """The ops vLLM splits the compiled graph at; None when unknown."""


KV_UPDATE_OP = "vllm::unified_mla_kv_cache_update"
"""The custom op in which vLLM 0.32 writes an MLA layer's new KV, and in which KVPP delivers the layer."""
_GRAPH_SAFE_MODES = ("NONE", "PIECEWISE")


def validate(setup: KvppSetup) -> list[Problem]:
    """All problems of `setup`; empty when KVPP is off or everything is supported."""
    if not setup.kvpp.enabled:
        return []
    problems = [*_model_rules(setup.model), *_parallel_rules(setup), *_graph_rules(setup)]
    problems += _connector_rules(setup)
    return problems


def raise_for_errors(problems: Iterable[Problem]) -> list[Problem]:
    """Raise KvppConfigError listing every error, one per line; return the warnings."""
    problems = list(problems)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise KvppConfigError("\n".join(str(p) for p in errors))
    return [p for p in problems if p.severity == "warning"]


def _error(option: str, message: str) -> Problem:
    return Problem("error", option, message)


def _model_rules(model: ModelSpec) -> list[Problem]:
    problems = []
    if model.attention not in ("mla", "sfa"):
        problems.append(_error("model", (
            f"{model.name} uses {model.attention} attention; KVPP supports only MLA/SFA models whose "
            f"per-layer cache is identical on every TP rank (DeepSeek-V2/V3, Kimi-K2, GLM-5.x); {_DISABLE}")))
    if model.hybrid:
        problems.append(_error("model", (
            f"{model.name} is a hybrid model (it mixes non-MLA layers); KVPP supports only non-hybrid "
            f"MLA/SFA models; {_DISABLE}")))
    return problems


def _parallel_rules(setup: KvppSetup) -> list[Problem]:
    topo, problems = setup.topology, []
    if topo.dcp > 1:
        problems.append(_error("decode_context_parallel_size", (
            f"KVPP does not support decode context parallel (DCP {topo.dcp}); set "
            f"--decode-context-parallel-size 1 or {_DISABLE}")))
    if topo.pcp > 1 and topo.runner == "v1":
        problems.append(_error("prefill_context_parallel_size", (
            f"KVPP with PCP {topo.pcp} needs Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1 or "
            "--prefill-context-parallel-size 1")))
    if topo.group_size == 1 and topo.pcp == 1:
        problems.append(Problem("warning", "tensor_parallel_size", (
            "TP=1 without PCP: a cache-replica group of one rank owns every layer and needs no staging, so "
            f"KVPP is inert (capacity ratio 1.0); use TP>1 (or PCP on runner V2) or {_DISABLE}")))
    return problems


def _graph_rules(setup: KvppSetup) -> list[Problem]:
    """Compiled mode is fine as long as every layer's KV write runs as Python on every step: KVPP delivers
    the layer there (inside the op that splits the graph); a captured CUDA graph replays without it."""
    if setup.enforce_eager:
        return []
    if setup.model.attention == "sfa":
        return [_error("enforce_eager", (
            f"KVPP on an SFA model ({setup.model.name}) runs in eager mode only: its indexer writes the key "
            "cache inside vllm::sparse_attn_indexer, where KVPP cannot deliver the layer first; "
            "add --enforce-eager"))]
    mode = setup.cudagraph_mode
    if mode not in _GRAPH_SAFE_MODES:
        shown = "vLLM's default FULL_AND_PIECEWISE" if mode is None else mode
        return [_error("compilation_config.cudagraph_mode", (
            f"{shown} captures whole forward passes in CUDA graphs, whose replay skips KVPP's per-layer "
            "broadcast (layers would attend over stale KV); use "
            "--compilation-config '{\"cudagraph_mode\": \"PIECEWISE\"}' or add --enforce-eager"))]
    if mode == "PIECEWISE" and setup.splitting_ops is not None and KV_UPDATE_OP not in setup.splitting_ops:
        return [_error("compilation_config.splitting_ops", (
            f"piecewise CUDA graphs must split at {KV_UPDATE_OP} (KVPP delivers each layer there, outside "
            f"the captured pieces); leave splitting_ops unset or add {KV_UPDATE_OP}, or add --enforce-eager"))]
    return []


def _connector_rules(setup: KvppSetup) -> list[Problem]:
    connector, role = setup.kv_connector, setup.kv_role
    if connector is None:
        return []
    if connector == MULTI:
        return _multi_connector_rules(setup)
    problems = []
    if role == "kv_consumer":
        problems.append(_error("kv_role", (
            "KVPP runs only on prefill nodes (kv_producer, or kv_both with the pool); a kv_consumer "
            f"(decode) node is not supported: {_DISABLE} on that node")))
    if connector == MOONCAKE:
        if role not in ("kv_producer", "kv_consumer"):
            problems.append(_error("kv_role", (
                f"{MOONCAKE} supports KVPP only with kv_role kv_producer (the prefill node), got {role!r}; "
                'set "kv_role": "kv_producer"')))
    elif connector == STORE:
        if role not in ("kv_producer", "kv_both", "kv_consumer"):
            problems.append(_error("kv_role", (
                f"{STORE} supports KVPP with kv_role kv_producer or kv_both, got {role!r}; "
                'set "kv_role": "kv_producer" or "kv_both"')))
        problems += _store_flag_rules(setup.kv_extra)
        if setup.kv_events:
            problems.append(_error("kv_events_config", (
                f"KV cache events are not supported by {STORE} with KVPP; disable enable_kv_cache_events "
                f"or {_DISABLE}")))
    else:
        problems.append(_error("kv_connector", (
            f"{connector!r} is not validated with KVPP; use {MOONCAKE} (P/D prefill node) or {STORE} "
            f"(KV pool), or {_DISABLE}")))
        return problems
    # Neither connector knows how PCP splits a request's tokens across ranks' shards.
    if setup.topology.pcp > 1:
        problems.append(_error("prefill_context_parallel_size", (
            f"{connector} with KVPP does not support PCP (PCP {setup.topology.pcp}); set "
            f"--prefill-context-parallel-size 1 or {_DISABLE}")))
    return problems


def _multi_connector_rules(setup: KvppSetup) -> list[Problem]:
    """vLLM's MultiConnector (e.g. P/D plus a pool on one prefill node): each child obeys its own rules."""
    children = setup.kv_extra.get("connectors")
    if not isinstance(children, list) or not children:
        return [_error("kv_connector_extra_config.connectors", (
            f"{MULTI} needs a non-empty list of child connector configs under \"connectors\""))]
    problems = []
    for i, child in enumerate(children):
        where = f"kv_connector_extra_config.connectors[{i}]"
        if not isinstance(child, dict):
            problems.append(_error(where, f"must be a connector config object, got {child!r}"))
            continue
        child_setup = replace(
            setup,
            kv_connector=child.get("kv_connector"),
            kv_role=child.get("kv_role", setup.kv_role),
            kv_extra=child.get("kv_connector_extra_config") or {},
        )
        problems += [replace(p, option=f"{where}.{p.option}") for p in _connector_rules(child_setup)]
    return problems


def _store_flag_rules(extra: dict[str, Any]) -> list[Problem]:
    problems = []
    for key, (required, default) in _STORE_FLAGS.items():
        option = f"kv_connector_extra_config.{key}"
        fix = f'set "{key}": {str(required).lower()}'
        value = extra.get(key, default)
        parsed = _as_bool(value)
        if parsed is None:
            problems.append(_error(option, f"must be true or false, got {value!r}; {fix}"))
        elif parsed != required:
            source = "defaults to" if key not in extra else "is"
            problems.append(_error(option, (
                f"{source} {str(parsed).lower()} but KVPP needs {str(required).lower()} "
                f"({_STORE_FLAG_WHY[key]}); {fix}")))
    return problems


def _as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return None
