"""`kvpp check SPEC`: every problem of a deployment spec before the cluster finds it.

KVPP rules come from kvpp_core.validation, port ranges from kvpp_core.ports and layer splits from
kvpp_core.topology, applied to exactly the configs `kvpp render` emits (deploy.launch); this module
adds only what spans instances (shared hosts, P/D wiring, the pool).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass

from kvpp_core.config import KvppConfigError, parse_additional_config
from kvpp_core.model import ModelSpec, resolve_model
from kvpp_core.ports import PortLayout, overlaps
from kvpp_core.topology import Topology
from kvpp_core.validation import MOONCAKE, KvppSetup, Problem, validate

from deploy import cli_args, launch
from deploy.spec import Instance, Spec, SpecError, load_spec


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
    findings: list[Finding] = []
    model = _model(spec, findings)
    for inst in spec.instances:
        findings += _instance_findings(spec, inst, model)
    findings += _wiring_findings(spec)
    findings += _host_findings(spec)
    return findings


def _model(spec: Spec, findings: list[Finding]) -> ModelSpec | None:
    needed = any(i.enable_kvpp or i.pp_layers for i in spec.instances)
    try:
        model = resolve_model(spec.model_preset or spec.model_path)
    except ValueError as exc:
        if needed:
            findings.append(_error("model", "model.preset", (
                f"{exc}; KVPP and layer-split checks need the model's layers: set model.preset or make "
                "model.path readable where kvpp check runs")))
        return None
    if spec.mtp_layers is not None:
        model = model.with_overrides(mtp_layers=spec.mtp_layers)
    return model


def _instance_findings(spec: Spec, inst: Instance, model: ModelSpec | None) -> list[Finding]:
    where, out = inst.where, []
    try:
        topo = Topology(tp=inst.tp, pp=inst.pp, pp_layers=inst.pp_layers, pcp=inst.pcp, dcp=inst.dcp, dp=inst.dp,
                        runner=inst.runner)
    except ValueError as exc:
        return [_error(where, "pp_layers" if "split" in str(exc) else "parallel sizes", str(exc))]
    if model is not None:
        try:
            topo.stage_layers(model.num_layers)
        except ValueError as exc:
            out.append(_error(where, "pp_layers", str(exc)))
    try:
        kvpp = parse_additional_config(launch.additional_config(inst))
    except KvppConfigError as exc:
        return out + [_error(where, "additional_config", str(exc))]
    if model is None:
        return out
    # MultiConnector (P/D plus pool) goes in whole: validation checks each child with its own rules.
    kv_cfg = launch.kv_transfer_config(spec, inst) or {}
    setup = KvppSetup(model=model, topology=topo, enforce_eager=inst.enforce_eager, kvpp=kvpp,
                      kv_connector=kv_cfg.get("kv_connector"), kv_role=kv_cfg.get("kv_role"),
                      kv_extra=kv_cfg.get("kv_connector_extra_config") or {}, kv_events=inst.kv_events)
    out += [Finding(where, problem) for problem in validate(setup)]
    return out


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


def _host_findings(spec: Spec) -> list[Finding]:
    """Ports that collide between instances sharing a host (every node of an instance reserves them)."""
    by_host: dict[str, list[Instance]] = defaultdict(list)
    for inst in spec.instances:
        for host in dict.fromkeys(inst.hosts):
            by_host[host].append(inst)
    out = []
    for host, insts in by_host.items():
        layouts = []
        for inst in insts:
            if spec.disaggregated and inst.kv_port is not None:
                try:
                    layouts.append((inst.where, PortLayout(inst.kv_port, tp=inst.tp, pp=inst.pp, pcp=inst.pcp,
                                                           dp=inst.dp)))
                except ValueError as exc:
                    out.append(_error(inst.where, "kv_port", str(exc)))
        for a, b, shared in overlaps(layouts):
            out.append(_error(b, "kv_port", (
                f"on host {host} its handshake/control ports overlap {a}'s at {shared.start}-{shared.stop - 1}; "
                f"move kv_port so the ranges are disjoint (each instance uses kv_port .. "
                "kv_port + tp*pp*pcp*dp + dp - 1)")))
        out += _single_port_clashes(spec, host, insts, layouts)
    return out


def _single_port_clashes(spec: Spec, host: str, insts: list[Instance], layouts) -> list[Finding]:
    out = []
    http: dict[int, str] = {}
    lookup: dict[int, str] = {}
    for inst in insts:
        if inst.port in http:
            out.append(_error(inst.where, "port", f"HTTP port {inst.port} on host {host} is also used by "
                              f"{http[inst.port]}; give each instance on a host its own port"))
        http.setdefault(inst.port, inst.where)
        port = launch.lookup_port(spec, inst)
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
    return out


def run_check(path: str) -> tuple[list[Finding], int]:
    """Findings and the exit code (1 if any error)."""
    try:
        spec = load_spec(path)
    except SpecError as exc:
        return [_error(path, "spec", p) for p in exc.problems], 1
    findings = check_spec(spec)
    return findings, int(any(f.severity == "error" for f in findings))


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "check", help="check a deployment spec (KVPP rules, ports, layer splits, pool) before launching",
        description="Print one line per problem with its fix; errors first, then warnings. Exit 1 on errors.",
    )
    p.add_argument("spec", type=cli_args.path_text, help="deployment spec (YAML)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    findings, code = run_check(args.spec)
    errors = [f for f in findings if f.severity == "error"]
    warnings = [f for f in findings if f.severity != "error"]
    for finding in errors + warnings:
        print(cli_args.printable(str(finding)), file=sys.stderr)
    if not errors:
        print(f"{args.spec}: ok ({len(warnings)} warning{'s' * (len(warnings) != 1)})")
    return code
