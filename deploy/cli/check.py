"""`kvpp check SPEC`: every problem of a deployment spec, one line each with its fix (deploy.deployment.check)."""

from __future__ import annotations

import argparse
import sys

from deploy.cli import args as cli_args
from deploy.deployment.check import kvpp_layouts, run_check


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "check", help="check a deployment spec (KVPP rules, ports, layer splits, pool) before launching",
        description="Print one line per problem with its fix, errors first, then warnings; then the KVPP mode each "
        "KVPP instance runs and why, and its cache-replica groups (the ranks that hold the same KV). Exit 1 on errors.",
    )
    p.add_argument("spec", type=cli_args.path_text, help="deployment spec (YAML)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    findings, code = run_check(args.spec)
    errors = [f for f in findings if f.severity == "error"]
    warnings = [f for f in findings if f.severity != "error"]
    for finding in errors + warnings:
        print(cli_args.printable(str(finding)), file=sys.stderr)
    for layout in kvpp_layouts(args.spec):
        print(cli_args.printable(f"{layout.where}: KVPP mode {layout.mode}"))
        print(cli_args.printable(f"{layout.where}: cache-replica groups: {layout.groups}"))
        if layout.shm is not None:
            print(cli_args.printable(f"{layout.where}: /dev/shm: {layout.shm}"))
    if not errors:
        print(f"{args.spec}: ok ({len(warnings)} warning{'s' * (len(warnings) != 1)})")
    return code
