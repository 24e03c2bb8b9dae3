"""Checks a launch: the connectors' settings always, and KVPP against the constraints it is known to
work under when it is on.

Every problem is reported at once, each naming the option to change and how, so that an operator
fixes a launch command in one pass. `validate` is pure Python (`kvpp check`/`kvpp plan` build a
`KvppSetup`); `validate_vllm_config` is the one startup entry point of a running vLLM: the engine
adapter and both connectors call it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from kvpp_core.config import ENABLE_KEY, KvppConfig, KvppConfigError, parse_additional_config
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology

MOONCAKE = "MooncakeConnectorV2"
STORE = "AscendStoreConnector"
MULTI = "MultiConnector"
_DISABLE = f"remove {ENABLE_KEY} from --additional-config"

# AscendStoreConnector extra-config keys KVPP depends on, and the value it needs.
_STORE_FLAGS = {"use_layerwise": False, "load_async": True, "discard_partial_chunks": True, "consumer_is_to_put": False}
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

    model: ModelSpec | None
    """None only when KVPP is off (then only the connectors' settings are checked)."""
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
    speculative_method: str | None = None
    """speculative_config.method (None: no speculative decoding)."""


KV_UPDATE_OP = "vllm::unified_mla_kv_cache_update"
"""The custom op in which vLLM 0.32 writes an MLA layer's new KV, and in which KVPP delivers the layer."""
_GRAPH_SAFE_MODES = ("NONE", "PIECEWISE")


def validate(setup: KvppSetup) -> list[Problem]:
    """All problems of `setup`: the connectors' own settings always, KVPP's rules when it is on."""
    return _kvpp_rules(setup) if setup.kvpp.enabled else _connector_rules(setup)


def _kvpp_rules(setup: KvppSetup) -> list[Problem]:
    """All problems of `setup`; empty when KVPP is off or everything is supported."""
    if not setup.kvpp.enabled:
        return []
    problems = [*_model_rules(setup.model), *_parallel_rules(setup), *_graph_rules(setup), *_draft_rules(setup)]
    problems += _connector_rules(setup)
    return problems


_logged: set[Problem] = set()


def validate_vllm_config(vllm_config) -> list[Problem]:
    """Refuse an unsupported launch with every error at once (KvppConfigError); log each warning once
    per process however many callers (engine, scheduler and worker connectors) ask; return them."""
    from vllm.logger import init_logger

    from kvpp_core.setup import setup_from_vllm_config

    kvpp = parse_additional_config(vllm_config.additional_config)
    if kvpp.enabled:
        setup = setup_from_vllm_config(vllm_config, kvpp)
    else:  # only the connectors' settings are checked: never describe a model KVPP does not run on
        transfer = vllm_config.kv_transfer_config
        setup = KvppSetup(model=None, topology=Topology(tp=1), enforce_eager=True, kvpp=kvpp,
                          kv_connector=None if transfer is None else transfer.kv_connector,
                          kv_role=None if transfer is None else transfer.kv_role,
                          kv_extra={} if transfer is None else dict(transfer.kv_connector_extra_config or {}))
    warnings = raise_for_errors(validate(setup))
    for warning in warnings:
        if warning not in _logged:
            _logged.add(warning)
            init_logger(f"vllm.{__name__}").warning("KVPP: %s", warning)
    return warnings


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


def _draft_rules(setup: KvppSetup) -> list[Problem]:
    """KVPP tells target layers from draft caches by the layer index in a cache's name: MTP and EAGLE heads
    number their layers after the decoder stack, but a separate draft model (`draft_model`) numbers its own
    from 0, so its caches would be taken for target layers and sharded or staged like them."""
    problems = []
    if setup.speculative_method == "draft_model":
        problems.append(_error("speculative_config.method", (
            "a separate draft model (\"draft_model\") numbers its cache layers from 0, so KVPP would take them "
            "for target layers; use the model's MTP layers ({\"method\": \"mtp\"}) or another method, or "
            f"{_DISABLE}")))
    if setup.speculative_method is not None and setup.topology.pp > 1:
        problems.append(_error("speculative_config", (
            f"speculative decoding ({setup.speculative_method}) with pipeline parallelism (PP {setup.topology.pp}) "
            "does not start on vLLM 0.32.0, the release KVPP's adapter supports: the drafter lives on the last "
            "stage only and vLLM's cache initialisation reads it on every stage; drop --speculative-config or "
            "set --pipeline-parallel-size 1")))
    return problems


def _connector_rules(setup: KvppSetup) -> list[Problem]:
    connector, role = setup.kv_connector, setup.kv_role
    if connector is None:
        return []
    if connector == MULTI:
        return _multi_connector_rules(setup)
    if not setup.kvpp.enabled:
        return _settings_rules(connector, setup.kv_extra)
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
        problems += _settings_rules(connector, setup.kv_extra)
    elif connector == STORE:
        if role not in ("kv_producer", "kv_both", "kv_consumer"):
            problems.append(_error("kv_role", (
                f"{STORE} supports KVPP with kv_role kv_producer or kv_both, got {role!r}; "
                'set "kv_role": "kv_producer" or "kv_both"')))
        problems += _store_rules(setup.kv_extra)
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


def _settings_rules(connector: str, extra: dict[str, Any]) -> list[Problem]:
    """Each connector's own reading of its kv_connector_extra_config (the struct its constructor uses)."""
    if connector == STORE:
        return _store_rules(extra, kvpp=False)
    if connector == MOONCAKE:
        from connectors.mooncake.settings import parse_settings

        try:
            parse_settings(extra)
        except ValueError as exc:
            return [_error("kv_connector_extra_config", str(exc))]
    return []


def _store_rules(extra: dict[str, Any], kvpp: bool = True) -> list[Problem]:
    """The pool's own settings problems, then (with KVPP) what KVPP needs of the flags that parsed."""
    import msgspec

    from connectors.store.config import StoreConfig, read_store_config

    parsed = read_store_config(extra)
    problems = [_error(option, message) for option, message in parsed.problems]
    if not kvpp:
        return problems
    reported = {p.option for p in problems}
    defaults = {f.name: f.default for f in msgspec.inspect.type_info(StoreConfig).fields}
    for key, required in _STORE_FLAGS.items():
        option = f"kv_connector_extra_config.{key}"
        value = parsed.given.get(key, defaults[key])
        if option in reported or value == required:
            continue
        source = "is" if key in parsed.given else "defaults to"
        problems.append(_error(option, (
            f"{source} {str(value).lower()} but KVPP needs {str(required).lower()} ({_STORE_FLAG_WHY[key]}); "
            f'set "{key}": {str(required).lower()}')))
    return problems
