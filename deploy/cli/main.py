"""The `kvpp` command. Each subcommand lives in its own module of deploy/cli/ exposing
`register(subparsers)`, which adds a parser whose `func(args) -> int` runs it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvpp_core.config import KvppConfigError

from deploy.cli import chaos, check, demo, plan, pool, ports, proxy, render, simulate, tiny_model
from deploy.cli.args import printable

SUBCOMMANDS = (plan, simulate, tiny_model, check, render, proxy, pool, demo, chaos, ports)
"""In the order `kvpp --help` lists them."""


class UsageError(Exception):
    """A command line argparse refused; the message is already one line."""


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one `kvpp: error: ...` line (subparsers inherit the class)."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {' '.join(message.split())} (see `{self.prog} --help`)")

    def _get_values(self, action, arg_strings):
        # `--port=--`: argparse drops the "--" and would hand the command an empty list, unconverted.
        value = super()._get_values(action, arg_strings)
        if action.nargs is None and isinstance(value, list) and not value:
            self.error(f"argument {'/'.join(action.option_strings) or action.dest}: expected one argument")
        return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvpp", description="Plan, check and run KVPP (layer-sharded KV caches) deployments for vLLM."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in SUBCOMMANDS:
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; user errors become `kvpp: error: ...` lines and exit code 2."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except SystemExit as exc:  # --help, or a subcommand's own exit
        return exc.code if isinstance(exc.code, int) else 2
    except (UsageError, KvppConfigError, ValueError, OSError) as exc:
        for line in str(exc).split("\n") if str(exc) else [type(exc).__name__]:
            print(f"kvpp: error: {printable(line)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
