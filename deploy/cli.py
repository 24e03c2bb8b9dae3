"""The `kvpp` command. Each subcommand lives in its own module exposing `register(subparsers)`,
which adds a parser whose `func(args) -> int` runs it."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvpp_core.config import KvppConfigError

SUBCOMMAND_MODULES = [
    "deploy.plan_cmd",
    "deploy.tiny_model",
    "deploy.check_cmd",
    "deploy.render",
    "deploy.proxy",
    "deploy.pool_cmd",
    "deploy.demo",
    "deploy.chaos",
    "deploy.ports_cmd",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpp", description="Plan, check and run KVPP (layer-sharded KV caches) deployments for vLLM."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in dict.fromkeys(SUBCOMMAND_MODULES):  # tolerate a module listed twice by parallel edits
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; user errors become `kvpp: error: ...` lines and exit code 2."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except SystemExit as exc:  # argparse has already printed its usage error
        return exc.code if isinstance(exc.code, int) else 2
    except (KvppConfigError, ValueError, OSError) as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"kvpp: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
