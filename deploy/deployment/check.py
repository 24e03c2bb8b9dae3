"""`kvpp check SPEC`: every problem of a deployment spec before the cluster finds it.

KVPP rules come from kvpp_core.validation (the connectors' from connectors.launch) and layer splits
from kvpp_core.topology, applied to the values `kvpp render` emits, as deploy.deployment.resolved
resolved them (the ports by connectors.mooncake.ports' rule); this module adds only what spans
instances (shared hosts, P/D wiring, the pool).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from kvpp_core.config import KvppConfigError, parse_additional_config
from kvpp_core.cpu_backends import AMX_MLA, BACKENDS, CPU_ATTN, CPU_MLA, CpuKernel
from kvpp_core.platforms import PLATFORMS, VLLM_CPU
from connectors.common.hosts import MOONCAKE_IPV6, canonical_host, ip_version
from connectors.common.kv_caches import replica_heads
from connectors.mooncake.heads import runnable_tps, tp_pairing_problem
from kvpp_core.capacity import plan_capacity
from kvpp_core.config import ZERO_COPY
from kvpp_core.layer_settings import TRANSPORT_ENV, transport_choice
from kvpp_core.model import ModelSpec
from kvpp_core.modes import NAMED, Mode, resolve as resolve_mode, shm_needed, shm_note
from connectors.mooncake.ports import overlaps
from kvpp_core.topology import Topology
from kvpp_core.setup import KvppSetup
from kvpp_core.validation import Problem, validate
from connectors.launch import connector_rules
from connectors.common.names import MOONCAKE, MULTI, STORE

from connectors.store.settings import StoreSettings, read_store_settings, role_actions
from connectors.store.layouts import KeyLayout, key_differences
from connectors.store.shards import StageLayers

from deploy.deployment import launch
from deploy.deployment.resolved import ResolvedInstance, ResolvedSpec, resolve
from deploy.deployment.spec import Instance, Spec, SpecError, load_spec


@dataclass(frozen=True)
class Finding:
    where: str
    problem: Problem

    @property
    def severity(self) -> str:
        return self.problem.severity

    def __str__(self) -> str:
        return f"{self.severity}: {self.where}: {self.problem}"


def _error(where: str, option: str, message: str) -> Finding:
    return Finding(where, Problem("error", option, message))


def _warning(where: str, option: str, message: str) -> Finding:
    return Finding(where, Problem("warning", option, message))


def check_spec(spec: Spec) -> list[Finding]:
    """All findings, errors and warnings, in spec order."""
    return check_resolved(resolve(spec))


def check_resolved(resolved: ResolvedSpec) -> list[Finding]:
    """check_spec of a spec already resolved, so that render checks the very values it writes."""
    spec, findings = resolved.spec, []
    model = _model(resolved, findings)
    for instance in resolved.instances:
        findings += _instance_findings(spec, instance, model)
    findings += _platform_findings(resolved, model)
    findings += _wiring_findings(spec)
    findings += _pairing_findings(spec, model)
    findings += _host_findings(resolved)
    findings += _pool_layout_findings(resolved, model)
    findings += _family_findings(spec)
    findings += _router_findings(resolved)
    return findings


def _model(resolved: ResolvedSpec, findings: list[Finding]) -> ModelSpec | None:
    """The spec's model as resolved; where it did not read and KVPP or a layer split needs it, an error."""
    if resolved.model is None and any(i.enable_kvpp or i.pp_layers for i in resolved.spec.instances):
        findings.append(_error("model", "model.preset", (
            f"{resolved.model_problem}; KVPP and layer-split checks need the model's layers: set model.preset or "
            "make model.path readable where kvpp check runs")))
    return resolved.model


def _topology(inst: Instance, model: ModelSpec | None) -> Topology:
    """The instance's parallel layout, with the model's KV heads where it has replicable ones (its cache-replica
    groups are then the TP ranks of one KV head)."""
    return Topology(tp=inst.tp, pp=inst.pp, pp_layers=inst.pp_layers, pcp=inst.pcp, dcp=inst.dcp, dp=inst.dp,
                    runner=inst.runner, kv_heads=model.replicated_kv_heads if model is not None else None)


def _instance_findings(spec: Spec, instance: ResolvedInstance, model: ModelSpec | None) -> list[Finding]:
    setup, out = _instance_setup(instance, model)
    if setup is not None:
        out += [Finding(instance.instance.where, problem) for problem in validate(setup, connector_rules, spec.platform)]
    return out


def _instance_setup(instance: ResolvedInstance, model: ModelSpec | None) -> tuple[KvppSetup | None, list[Finding]]:
    """An instance's launch in the planner's terms (None where the spec cannot say), and what stops that."""
    inst = instance.instance
    where, out = inst.where, []
    try:
        topo = _topology(inst, model)
    except ValueError as exc:
        return None, [_error(where, "pp_layers" if "split" in str(exc) else "parallel sizes", str(exc))]
    if model is not None:
        try:
            topo.stage_layers(model.num_layers)
        except ValueError as exc:
            out.append(_error(where, "pp_layers", str(exc)))
    try:
        kvpp = parse_additional_config(instance.additional_config)
    except KvppConfigError as exc:
        return None, out + [_error(where, "additional_config", str(exc))]
    try:
        transport = transport_choice(instance.env)
    except KvppConfigError as exc:
        return None, out + [_error(where, f"env {TRANSPORT_ENV}", str(exc))]
    engine = instance.engine
    if engine.flag_problems:
        return None, out + [_error(where, f"extra_args {flag}", why) for flag, why in engine.flag_problems]
    if model is None:
        return None, out
    dtype = engine.dtype or model.kv_dtype
    if engine.kv_cache_dtype is None:
        model = model.with_overrides(kv_dtype=dtype)
    # MultiConnector (P/D plus pool) goes in whole: validation checks each child with its own rules.
    kv_cfg = instance.kv_transfer_config or {}
    setup = KvppSetup(model=model, topology=topo, enforce_eager=inst.enforce_eager, kvpp=kvpp,
                      kv_connector=kv_cfg.get("kv_connector"), kv_role=kv_cfg.get("kv_role"),
                      kv_extra=kv_cfg.get("kv_connector_extra_config") or {},
                      cudagraph_mode=engine.cudagraph_mode, splitting_ops=engine.splitting_ops,
                      speculative_method=engine.speculative_method, nnodes=len(inst.hosts),
                      device=engine.device, attention_backend=engine.kernel,
                      draft_attention_backend=engine.draft_kernel, dtype=dtype, block_size=engine.block_size,
                      expert_parallel=inst.ep, transport=transport, request=engine.request)
    return setup, out


@dataclass(frozen=True)
class KvppLayout:
    """How a KVPP instance shards its KV: the mode it runs and why (kvpp_core.modes), its cache-replica groups
    (kvpp_core.topology: the TP ranks of a stage for an MLA model, those holding one KV head for a GQA model), and
    what zero-copy asks of its hosts' /dev/shm (None: not zero-copy)."""

    where: str
    mode: Mode
    groups: str
    shm: str | None


def kvpp_layouts(path: str) -> list[KvppLayout]:
    """The layout of each KVPP instance of the spec at `path`; none where the spec does not load or an instance's
    launch cannot be read (`run_check` says why)."""
    try:
        resolved = resolve(load_spec(path))
    except SpecError:
        return []
    layouts = []
    for instance in resolved.instances:
        setup, _ = _instance_setup(instance, resolved.model)
        if setup is not None and setup.kvpp.enabled:
            mode = resolve_mode(setup)
            note = shm_note(_shm_needed(instance, setup), mode.reason == NAMED) if mode.zero_copy else None
            layouts.append(KvppLayout(instance.instance.where, mode, setup.topology.describe_group(), note))
    return layouts


CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
"""vllm-cpu's KV budget per rank in GiB (0 or unset: its own default)."""


def _shm_needed(instance: ResolvedInstance, setup: KvppSetup) -> int | None:
    """The /dev/shm zero-copy takes on the instance's busiest host, where the spec gives the KV budget
    (memory.kv_cache_memory_bytes, or VLLM_CPU_KVCACHE_SPACE in its env) and the block size."""
    inst = instance.instance
    space = str(instance.env.get(CPU_KV_SPACE_ENV, "0"))
    budget = inst.memory.kv_cache_memory_bytes or (int(space) << 30 if space.isdigit() else 0)
    if not budget or setup.block_size is None:
        return None
    model = setup.model.with_overrides(mtp_layers=setup.model.mtp_layers if setup.speculative_method else 0)
    try:
        plan = plan_capacity(model, setup.topology, budget, setup.block_size, ZERO_COPY)
    except ValueError:
        return None  # the instance's own findings say why
    return shm_needed(plan, inst.dp, len(inst.hosts))


def _platform_findings(resolved: ResolvedSpec, model: ModelSpec | None) -> list[Finding]:
    """What the spec's platform decides for every instance at once, said once: vllm-cpu's kernels named where the
    platform has none, or one the model does not run on; on vllm-cpu an MLA kernel left to each serving host
    (AMX_MLA where the CPU has AMX, CPU_MLA elsewhere), where its dtype, block size and prefix-cache rules then
    go unchecked."""
    platform = resolved.spec.platform
    if PLATFORMS[platform].device != "cpu":
        named = [i for i in resolved.instances if i.engine.request.attention_backend in BACKENDS]
        if not named:
            return []
        kernels = "/".join(dict.fromkeys(i.engine.request.attention_backend for i in named))
        return [_error("platform", "extra_args --attention-backend", (
            f"{_listed(named)} name{'s' * (len(named) == 1)} vllm-cpu's kernel{'s' * ('/' in kernels)} "
            f"({kernels}), which platform {platform} does not run; set platform: {VLLM_CPU.name}, or drop "
            "--attention-backend"))]
    if model is None:
        return []
    out = _kernel_kind_findings(resolved, model)
    if model.attention != "mla":
        return out
    unnamed = [i for i in resolved.instances if i.engine.kernel is None]
    if not unnamed:
        return out
    return out + [_warning("platform", "extra_args --attention-backend", (
        f"{_listed(unnamed)} leave{'s' * (len(unnamed) == 1)} the MLA kernel to each serving host: vllm-cpu runs "
        f"{_kernel_terms(AMX_MLA)} on a CPU with AMX and {_kernel_terms(CPU_MLA)} elsewhere, so kvpp check applies "
        f"neither's rules to {'it' if len(unnamed) == 1 else 'them'}; name it: --attention-backend {AMX_MLA.name} "
        f"--dtype bfloat16 on CPUs with AMX, else --attention-backend {CPU_MLA.name}"))]


def kernel_kind_problem(named: str | None, model: ModelSpec) -> str | None:
    """Why `--attention-backend named` (a vllm-cpu kernel) is not the kernel vLLM runs `model` on (None when it is,
    or names none): vLLM runs standard attention on CPU_ATTN only and MLA on an MLA kernel, and takes a name of the
    other kind without an error (it logs "Cannot use ... backend on CPU"), so the named kernel's rules would not be
    the engine's."""
    kernel = BACKENDS.get(named)
    if kernel is None or kernel.mla == (model.attention != "gqa"):
        return None
    if model.attention == "gqa":
        return (f"{kernel.name} is an MLA kernel, and {model.name} uses standard (GQA) attention, which vLLM runs on "
                f"{CPU_ATTN.name} whatever is named; set --attention-backend {CPU_ATTN.name} or drop it")
    return (f"{kernel.name} is standard attention's kernel, and {model.name} is an {model.attention.upper()} model, "
            f"which vLLM runs on {AMX_MLA.name} (CPUs with AMX) or {CPU_MLA.name}; name one of those or drop "
            "--attention-backend")


def _kernel_kind_findings(resolved: ResolvedSpec, model: ModelSpec) -> list[Finding]:
    problems = [(i, p) for i in resolved.instances if (p := kernel_kind_problem(i.engine.request.attention_backend,
                                                                                  model))]
    return [_error(i.instance.where, "extra_args --attention-backend", p) for i, p in problems]


def _kernel_terms(kernel: CpuKernel) -> str:
    """A CPU MLA kernel and what it runs (kvpp_core.cpu_backends)."""
    dtypes = " or ".join(kernel.dtypes) if kernel.dtypes else "any dtype"
    return (f"{kernel.name} ({dtypes}, blocks of {kernel.block_size(None)}, prefix cache "
            f"{'on' if kernel.prefix_caching else 'off'})")


def _listed(instances: list[ResolvedInstance] | list[Instance]) -> str:
    names = [i.instance.where if isinstance(i, ResolvedInstance) else i.where for i in instances]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _wiring_findings(spec: Spec) -> list[Finding]:
    out = []
    if spec.disaggregated:
        for inst in spec.instances:
            if inst.kv_port is None:
                out.append(_error(inst.where, "kv_port", (
                    f"P/D with {MOONCAKE} needs a kv_port on every prefill and decode instance (the base of "
                    "its handshake ports); set kv_port, e.g. 37000 for the prefill and 37010 for the decode")))
    else:
        for inst in spec.instances:
            if inst.kv_port is not None:
                out.append(_warning(inst.where, "kv_port", "kv_port is unused without decode instances (it is the "
                                    "base of P/D handshake ports); remove it or add the decode instances"))
    for inst in spec.instances:
        if inst.uses_pool and spec.pool is None:
            out.append(_error(inst.where, "uses_pool", "uses_pool is true but the spec has no pool section; add "
                              "pool (backend, address, lookup_rpc_port) or set uses_pool: false"))
    if spec.pool is not None and not any(i.uses_pool for i in spec.instances):
        out.append(_warning("pool", "pool", "no instance uses the pool (prefill instances do by default unless "
                            "uses_pool: false); remove the pool section or set uses_pool: true"))
    return out


def _pairing_findings(spec: Spec, model: ModelSpec | None) -> list[Finding]:
    """Decode instances that cannot read some prefill's KV: the proxy pairs any prefill with any decode, and a decode
    rank reads each layer from a prefill rank holding exactly its KV heads (connectors.mooncake.heads, the rule the
    handshake applies). TP sizes vLLM cannot shard the model at are left to vLLM's own refusal."""
    if model is None or not spec.disaggregated:
        return []
    heads = model.replicated_kv_heads
    runnable = None if heads is None else set(runnable_tps(heads, max(i.tp for i in spec.instances)))
    out = []
    for decode in spec.decode:
        for tp in dict.fromkeys(p.tp for p in spec.prefill):
            if runnable is not None and not {tp, decode.tp} <= runnable:
                continue
            problem = tp_pairing_problem(heads, tp, decode.tp)
            if problem is not None:
                prefills = _listed([p for p in spec.prefill if p.tp == tp])
                out.append(_error(decode.where, "tp", f"cannot read the KV cache of {prefills}: {problem}"))
    return out


def _host_findings(resolved: ResolvedSpec) -> list[Finding]:
    """Ports that collide between instances sharing a host (every node of an instance reserves them;
    one host written two ways, `fd00:0::1` and `fd00::1`, is one host)."""
    by_host: dict[str, list[ResolvedInstance]] = defaultdict(list)
    for instance in resolved.instances:
        for host in dict.fromkeys(map(canonical_host, instance.instance.hosts)):
            by_host[host].append(instance)
    out = []
    for host, instances in by_host.items():
        layouts = []
        # Without decode instances no connector binds kv_port's ports (_wiring_findings warns of it).
        for instance in instances if resolved.spec.disaggregated else []:
            if instance.kv_ports_problem is not None:
                out.append(_error(instance.instance.where, "kv_port", instance.kv_ports_problem))
            elif instance.kv_ports is not None:
                layouts.append((instance.instance.where, instance.kv_ports))
        for a, b, shared in overlaps(layouts):
            out.append(_error(b, "kv_port", (
                f"on host {host} its handshake/control ports overlap {a}'s at {shared.start}-{shared.stop - 1}; "
                f"move kv_port so the ranges are disjoint (each instance uses kv_port .. "
                "kv_port + tp*pp*pcp*dp + dp - 1)")))
        out += _single_port_clashes(host, instances, layouts)
    return out


def _single_port_clashes(host: str, instances: list[ResolvedInstance], layouts) -> list[Finding]:
    out = []
    http: dict[int, str] = {}
    lookup: dict[int, str] = {}
    for instance in instances:
        inst = instance.instance
        if inst.port in http:
            out.append(_error(inst.where, "port", f"HTTP port {inst.port} on host {host} is also used by "
                              f"{http[inst.port]}; give each instance on a host its own port"))
        http.setdefault(inst.port, inst.where)
        port = instance.lookup_rpc_port
        if port is not None:
            if port in lookup:
                out.append(_error(inst.where, "lookup_rpc_port", (
                    f"lookup_rpc_port {port} on host {host} is also used by {lookup[port]}; the pool lookup "
                    "channel is per instance: set a distinct lookup_rpc_port on this instance")))
            lookup.setdefault(port, inst.where)
    for port, owner in http.items():
        for where, layout in layouts:
            if port in layout.ports:
                out.append(_error(owner, "port", f"HTTP port {port} on host {host} falls inside {where}'s "
                                  f"handshake range {layout.ports.start}-{layout.last_port}; move one of them"))
    return out + _events_port_clashes(host, instances, {**lookup, **http}, layouts)


def _events_port_clashes(host: str, instances: list[ResolvedInstance], taken: dict[int, str],
                         layouts) -> list[Finding]:
    """A KV event publisher's ports (live and replay) against each other and every other port the host's
    instances bind."""
    out, events = [], {}
    for inst in (i.instance for i in instances if i.instance.kv_events):
        for key, port in (("kv_events_port", inst.kv_events_port), ("kv_events_replay_port", inst.events_replay_port)):
            if port > 65535:
                out.append(_error(inst.where, key, f"kv_events_port {inst.kv_events_port} leaves no port after it for "
                                  "the replay endpoint; set kv_events_replay_port"))
                continue
            owner = events.get(port) or taken.get(port) or next(
                (f"{where}'s handshake range" for where, layout in layouts if port in layout.ports), None)
            if owner is not None:
                out.append(_error(inst.where, key, (
                    f"KV event port {port} on host {host} is also used by {owner}; give each instance on a host its "
                    f"own {key}" + (" (kv_events_port + 1 unless set)" if key == "kv_events_replay_port" else ""))))
            events.setdefault(port, f"{inst.where}'s {key}")
    return out


_LAYOUT_FIX = {
    "model": "start every instance with the same model.path",
    "kv_dtype": "give every instance the same --dtype/--kv-cache-dtype",
    "block_size": "set the same memory.block_size on every instance",
    "kvpp": "set the same enable_kvpp on every instance",
    "group_size": "use the same tp (and pcp) on every KVPP instance",
    "heads": "use TP sizes that give every rank the same KV heads on every instance (a GQA shard holds its rank's "
             "heads)",
    "stages": "use the same pp, pp_layers and speculative (MTP) setting on every instance",
}


@dataclass(frozen=True)
class _PoolMember:
    inst: Instance
    pool: str
    layout: KeyLayout
    loads: bool
    saves: bool


def _pool_layout_findings(resolved: ResolvedSpec, model: ModelSpec | None) -> list[Finding]:
    """Instances on one pool whose pool keys never meet (connectors.store.layouts): they share its
    memory but no prefix (a warning, against the pool's first instance). An instance that only reads
    the pool while every writer keys blocks differently can never hit (an error)."""
    members = [m for instance in resolved.instances if (m := _pool_member(resolved.spec, instance, model)) is not None]
    out = []
    for pool in dict.fromkeys(m.pool for m in members):
        group = [m for m in members if m.pool == pool]
        writers = [m for m in group if m.saves]
        for m in group:
            if m.loads and not m.saves and writers and all(key_differences(m.layout, w.layout) for w in writers):
                shown, fixes = _differences(m, writers[0])
                out.append(_error(m.inst.where, "pool", (
                    f"reads pool {pool} but every instance writing it keys blocks differently (vs "
                    f"{writers[0].inst.where}: {shown}), so it can never hit; {fixes}, or give it a pool of its own")))
            elif m is not group[0] and key_differences(m.layout, group[0].layout):
                shown, fixes = _differences(m, group[0])
                out.append(_warning(m.inst.where, "pool", (
                    f"shares pool {pool} with {group[0].inst.where} but their pool keys differ in {shown}: pooled "
                    "objects are keyed per layout and owner shard, so neither reuses the other's prefixes (they "
                    f"only split its memory); {fixes}, or give them separate pools")))
    return out


def _differences(a: _PoolMember, b: _PoolMember) -> tuple[str, str]:
    """The differing key fields of two members, shown, and their fixes."""
    fields = key_differences(a.layout, b.layout)
    shown = ", ".join(f"PP stages ({a.inst.name}: {_stages(a.layout)}, {b.inst.name}: {_stages(b.layout)})"
                      if f == "stages" else
                      f"{f} ({a.inst.name}: {getattr(a.layout, f)!r}, {b.inst.name}: {getattr(b.layout, f)!r})"
                      for f in fields)
    return shown, "; ".join(_LAYOUT_FIX[f] for f in fields)


def _stages(layout: KeyLayout) -> str:
    """Layers per stage, e.g. `39+40+mtp1`."""
    return "+".join(f"{len(s.target_layers)}" + (f"+mtp{s.mtp_caches}" if s.mtp_caches else "") for s in layout.stages)


def _pool_member(spec: Spec, instance: ResolvedInstance, model: ModelSpec | None) -> _PoolMember | None:
    """The instance's pool, key layout and role; None without a pool or when a setting it needs is
    broken (the instance's own findings report that)."""
    inst = instance.instance
    store = _store_connector(instance.kv_transfer_config or {})
    if model is None or spec.pool is None or store is None:
        return None
    cfg = read_store_settings(store.get("kv_connector_extra_config")).value
    try:
        topo = _topology(inst, model)
        ranges = topo.stage_layers(model.num_layers)
    except ValueError:
        return None
    if cfg is None:
        return None
    engine = instance.engine
    mtp = model.mtp_layers if engine.speculative_method is not None else 0
    stages = tuple(StageLayers(i, tuple(r), mtp if i == len(ranges) - 1 else 0) for i, r in enumerate(ranges))
    layout = KeyLayout(model=spec.model.path, kv_dtype=engine.kv_cache_dtype or engine.dtype or "auto",
                       block_size=engine.block_size, kvpp=inst.enable_kvpp, group_size=topo.group_size, stages=stages,
                       heads=replica_heads(topo))
    loads, saves = role_actions(store.get("kv_role"), cfg)
    return _PoolMember(inst, _pool_address(spec, cfg), layout, loads, saves)


def _store_connector(kv_cfg: dict) -> dict | None:
    """The pool connector's config in an instance's kv_transfer_config (alone, or a MultiConnector
    child, whose kv_role defaults to the parent's)."""
    if kv_cfg.get("kv_connector") == STORE:
        return kv_cfg
    if kv_cfg.get("kv_connector") == MULTI:
        children = (kv_cfg.get("kv_connector_extra_config") or {}).get("connectors")
        for child in children if isinstance(children, list) else []:
            if isinstance(child, dict) and child.get("kv_connector") == STORE:
                return {"kv_role": kv_cfg.get("kv_role"), **child}
    return None


def _pool_address(spec: Spec, cfg: StoreSettings) -> str:
    """Where the instance's pool client connects: its own settings, else the rendered config file's."""
    if cfg.backend == "mooncake":
        rendered = spec.pool.mooncake.master_server_address if spec.pool.mooncake else None
        return cfg.backend_settings.master_server_address or rendered or spec.pool.address
    return cfg.backend_settings.meta_service_url or str(spec.pool.settings.get("meta_service_url") or spec.pool.address)


def _family_findings(spec: Spec) -> list[Finding]:
    """The IP literals among the hosts that exchange Mooncake traffic (P/D transfers, the Mooncake
    pool) must be of one family: Mooncake runs IPv4 or IPv6 per deployment (connectors.common.hosts.MOONCAKE_IPV6)."""
    members = [(i.where, "hosts", h) for i in spec.instances
               if spec.disaggregated or (i.uses_pool and _mooncake_pool(spec)) for h in i.hosts]
    if _mooncake_pool(spec):
        members.append(("pool", "pool.address", spec.pool.host))
    literals = [(where, option, host, v) for where, option, host in members if (v := ip_version(host))]
    if not literals:
        return []
    first = literals[0]
    return [_error(where, option, (
        f"{host} is IPv{version} but {first[2]} ({first[0]}) is IPv{first[3]}: Mooncake runs in one family per "
        f"deployment ({MOONCAKE_IPV6}=1 for IPv6, in which mode it cannot reach IPv4 peers); give every host of the "
        f"P/D instances and the Mooncake pool an IPv{first[3]} address (or a name resolving to one)"))
        for where, option, host, version in dict.fromkeys(literals) if version != first[3]]


_ROUTER_PROTOCOLS = {
    "mooncake": "upstream Mooncake's bootstrap protocol (at startup the router asks each prefill's Mooncake "
                "bootstrap server for its engine ids, then sends transfer_id and remote_bootstrap_addr), while "
                f"{MOONCAKE} runs no bootstrap server and its decode pulls with the kv_transfer_params the prefill "
                "returned",
    "moriio": f"the MoRI-IO connector's READ/WRITE protocol, which {MOONCAKE} does not speak",
}
_DISCOVERY_FLAGS = ("--service-discovery", "--vllm-discovery-address", "--prefill-selector", "--decode-selector")


def _router_findings(resolved: ResolvedSpec) -> list[Finding]:
    """What the chosen P/D front (proxy.router) cannot do with the spec's instances."""
    spec = resolved.spec
    proxy, out = spec.proxy, []
    if not spec.disaggregated:
        if proxy.router != "kvpp-proxy" or proxy.extra_args or proxy.metrics_port is not None or proxy.cache_aware:
            out.append(_warning("proxy", "proxy", "without decode instances there is no P/D front to render; "
                                "remove proxy.router, proxy.extra_args, proxy.metrics_port and proxy.cache_aware "
                                "or add decode instances"))
        return out
    if proxy.cache_aware:
        out += _cache_aware_findings(resolved)
    if proxy.router == "kvpp-proxy":
        if proxy.metrics_port is not None:
            out.append(_warning("proxy", "metrics_port", "kvpp proxy serves /metrics on proxy.port; metrics_port "
                                "applies to router: vllm-router only; remove it"))
        return out
    if proxy.max_in_flight is not None:
        out.append(_warning("proxy", "max_in_flight", "the in-flight cap is kvpp proxy's (--max-in-flight); "
                            "vllm-router does not read it; remove it or set router: kvpp-proxy"))
    connector = launch.flag_value(proxy.extra_args, "--kv-connector", "nixl")
    if connector != "nixl":
        out.append(_error("proxy", "extra_args --kv-connector", (
            f"vllm-router's --kv-connector {connector} is {_ROUTER_PROTOCOLS.get(connector, 'not its NIXL mode')}; "
            f"{MOONCAKE} works with vllm-router's default mode (nixl: it forwards the prefill's kv_transfer_params "
            "to the decode verbatim): remove --kv-connector")))
    for flag in _DISCOVERY_FLAGS:
        if any(arg.split("=", 1)[0] == flag for arg in proxy.extra_args):
            out.append(_error("proxy", f"extra_args {flag}", (
                "vllm-router would find its instances by discovery instead of the spec's prefill and decode URLs, "
                "which kvpp render passes it: remove the discovery flags")))
    metrics = resolved.proxy.metrics_port
    host = canonical_host(resolved.proxy.host)
    taken = {proxy.port: "proxy.port", **{i.port: f"{i.where}'s HTTP port" for i in spec.instances
                                          if host in map(canonical_host, i.hosts)}}
    if metrics in taken:
        out.append(_error("proxy", "metrics_port", (
            f"vllm-router's metrics port {metrics} on host {host} is also {taken[metrics]}; set proxy.metrics_port "
            "to a free port (default 29000)")))
    return out


VLLM_ROUTER_EVENT_BLOCK = 16
"""The block size vllm-router 0.1.17 assumes for P/D KV event sources (`--pd-kv-events`: "Block size is 16")."""


def _cache_aware_findings(resolved: ResolvedSpec) -> list[Finding]:
    """What the cache-aware prefill choice needs of the prefills: an event stream each, one per instance, that
    the front can reach and read."""
    out = []
    for instance in (i for i in resolved.instances if i.instance.role == "prefill"):
        inst, engine = instance.instance, instance.engine
        if not inst.kv_events:
            out.append(_error(inst.where, "kv_events", "proxy.cache_aware picks prefills by their KV cache events; "
                              "set kv_events: true on every prefill (or turn proxy.cache_aware off)"))
        if ip_version(inst.hosts[0]) == 6:
            out.append(_error(inst.where, "hosts", (
                f"vLLM 0.32 binds its KV event publisher to tcp://*:{inst.kv_events_port}, IPv4 only, so a front "
                "cannot reach it at an IPv6 address: give the prefills IPv4 addresses or turn proxy.cache_aware off")))
        if inst.dp > 1:
            out.append(_error(inst.where, "dp", (
                f"with dp {inst.dp} vLLM publishes one event stream per DP rank (kv_events_port + rank), and the "
                "front reads one per prefill: use dp: 1 on prefills with proxy.cache_aware, or turn it off")))
        kernel = BACKENDS.get(engine.kernel) if engine.kernel else None
        if engine.request.prefix_caching is False or (kernel is not None and not kernel.prefix_caching):
            why = "--no-enable-prefix-caching" if engine.request.prefix_caching is False else (
                f"vLLM turns it off for MLA models on {engine.kernel}")
            out.append(_warning(inst.where, "kv_events", (
                f"its prefix cache is off ({why}): it publishes no cached blocks, so the front picks it by load "
                "only")))
        if resolved.spec.proxy.router == "vllm-router" and engine.block_size not in (None, VLLM_ROUTER_EVENT_BLOCK):
            out.append(_error("proxy", "cache_aware", (
                f"vllm-router 0.1.17 reads P/D KV events as {VLLM_ROUTER_EVENT_BLOCK}-token blocks, and {inst.where} "
                f"runs {engine.block_size}-token blocks: its kv_aware policy would match no prefix; set router: "
                "kvpp-proxy (its --kv-events reads each event's own block size)")))
    return out


def _mooncake_pool(spec: Spec) -> bool:
    return spec.pool is not None and spec.pool.backend == "mooncake"


def run_check(path: str) -> tuple[list[Finding], int]:
    """Findings and the exit code (1 if any error)."""
    try:
        spec = load_spec(path)
    except SpecError as exc:
        return [_error(path, "spec", p) for p in exc.problems], 1
    findings = check_spec(spec)
    return findings, int(any(f.severity == "error" for f in findings))
