"""`kvpp ports`: the side-channel ports a MooncakeConnectorV2 instance binds, and overlaps between
instances sharing a host.

The ports come from connectors.mooncake.ports.PortLayout, the same code the connector's workers bind with, so
what this prints is what the servers will use.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from connectors.common.hosts import canonical_host
from connectors.mooncake.ports import PortLayout, overlaps

from deploy.bounds import MAX_PARALLEL
from deploy.cli import args as cli_args

NODE_FORMAT = "NAME=KV_PORT:TP[:PP[:PCP[:DP]]]"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ports", help="MooncakeConnectorV2 handshake/control ports of an instance; overlaps between instances",
        description="With --kv-port: list one instance's worker handshake ports (per dp/pp/pcp/tp rank) and "
        "scheduler control ports. With --node (repeatable) or --spec: list each instance's range and report "
        "ranges that overlap on one host (exit code 1).",
    )
    p.add_argument("--kv-port", type=cli_args.port, help="the instance's kv_port (base of its range)")
    for flag in ("--tp", "--pp", "--pcp", "--dp"):
        p.add_argument(flag, type=cli_args.parallel_size, default=1)
    p.add_argument("--node", action="append", default=[], metavar=NODE_FORMAT,
                   help="an instance on the same host, e.g. prefill=37000:2 decode=37010:1")
    p.add_argument("--spec", type=cli_args.path_text, default=None, metavar="FILE",
                   help="a deployment spec (kvpp check format): every P/D instance, grouped by host")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def parse_node(text: str) -> tuple[str, PortLayout]:
    """`prefill=37000:2:1:1:1` -> ("prefill", PortLayout(37000, tp=2, pp=1, pcp=1, dp=1))."""
    name, sep, rest = text.partition("=")
    parts = rest.split(":")
    if not sep or not name or not name.isprintable() or not 2 <= len(parts) <= 5:
        raise ValueError(f"--node {text!r}: expected {NODE_FORMAT}, e.g. prefill=37000:2")
    try:
        numbers = [int(x) for x in parts]
    except ValueError:
        raise ValueError(f"--node {text!r}: KV_PORT, TP, PP, PCP and DP must be integers") from None
    if any(n > MAX_PARALLEL for n in numbers[1:]):
        raise ValueError(f"--node {text!r}: TP, PP, PCP and DP must be at most {MAX_PARALLEL}")
    sizes = dict(zip(("tp", "pp", "pcp", "dp"), numbers[1:]))
    try:
        return name, PortLayout(numbers[0], **sizes)
    except ValueError as exc:
        raise ValueError(f"--node {text!r}: {exc}") from None


def describe(layout: PortLayout) -> dict:
    """Every port of one instance with the rank that binds it."""
    workers = [
        {"dp": dp, "pp": pp, "pcp": pcp, "tp": tp, "port": layout.handshake_port(dp, pp, pcp, tp)}
        for dp in range(layout.dp) for pp in range(layout.pp) for pcp in range(layout.pcp) for tp in range(layout.tp)
    ]
    control = [{"dp": dp, "port": layout.control_port(dp)} for dp in range(layout.dp)]
    return {"kv_port": layout.kv_port, "tp": layout.tp, "pp": layout.pp, "pcp": layout.pcp, "dp": layout.dp,
            "first": layout.ports.start, "last": layout.last_port, "workers": workers, "control": control}


def _spec_hosts(path: str) -> dict[str, list[tuple[str, PortLayout]]]:
    from deploy.deployment.resolved import resolve
    from deploy.deployment.spec import load_spec

    hosts: dict[str, list[tuple[str, PortLayout]]] = defaultdict(list)
    for instance in resolve(load_spec(path)).instances:
        if instance.kv_ports_problem is not None:
            raise ValueError(instance.kv_ports_problem)
        if instance.kv_ports is None:
            continue
        for host in dict.fromkeys(map(canonical_host, instance.instance.hosts)):
            hosts[host].append((instance.instance.where, instance.kv_ports))
    return hosts


def run(args: argparse.Namespace) -> int:
    modes = sum(bool(x) for x in (args.kv_port is not None, args.node, args.spec))
    if modes != 1:
        raise ValueError("give exactly one of --kv-port (one instance), --node ... (instances on one host) or --spec FILE")
    if args.kv_port is not None:
        info = describe(PortLayout(args.kv_port, tp=args.tp, pp=args.pp, pcp=args.pcp, dp=args.dp))
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            print(f"kv_port {info['kv_port']} (tp={info['tp']} pp={info['pp']} pcp={info['pcp']} dp={info['dp']}): "
                  f"ports {info['first']}-{info['last']}")
            for w in info["workers"]:
                print(f"  worker dp{w['dp']} pp{w['pp']} pcp{w['pcp']} tp{w['tp']}: handshake {w['port']}")
            for c in info["control"]:
                print(f"  scheduler dp{c['dp']}: control {c['port']}")
        return 0

    hosts = {"(this host)": [parse_node(n) for n in args.node]} if args.node else _spec_hosts(args.spec)
    report, clashes = [], []
    for host, layouts in hosts.items():
        for name, layout in layouts:
            report.append({"host": host, "name": name, "first": layout.ports.start, "last": layout.last_port})
        for a, b, shared in overlaps(layouts):
            clashes.append({"host": host, "a": a, "b": b, "first": shared.start, "last": shared.stop - 1})
    if args.json:
        print(json.dumps({"instances": report, "overlaps": clashes}, indent=2))
    else:
        for r in report:
            print(f"{r['host']}: {r['name']}: {r['first']}-{r['last']}")
        for c in clashes:
            print(f"OVERLAP on {c['host']}: {c['a']} and {c['b']} share {c['first']}-{c['last']}; move one kv_port "
                  "so the ranges are disjoint (an instance uses kv_port .. kv_port + tp*pp*pcp*dp + dp - 1)")
        if not clashes:
            print("no overlaps")
    return 1 if clashes else 0
