"""`kvpp demo`: the whole suite on one machine (deploy.harness.demo), reported on one screen or as JSON."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

from deploy.cli import args as cli_args
from deploy.harness import demo as harness
from deploy.harness.testbed import TestbedError, unavailable_reason
from deploy.services.processes import ProcessError


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run prefill (KVPP) + decode + pool + proxy on this machine and report",
                              description=harness.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--workdir", type=cli_args.path, help="where the model, logs and pool state go (default: a temp dir)")
    p.add_argument("--hosts", action="store_true",
                   help="spread the stack over five hosts (network namespaces on a bridge, needs root) and run "
                   "it from `kvpp render` scripts; without root it runs on loopback and says so")
    p.set_defaults(func=run)


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run_demo's cleanup, unlike the default action


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    demo = harness.run_demo
    if args.hosts:
        reason = unavailable_reason()
        if reason:
            harness.progress(f"--hosts: {reason}; running on loopback instead")
        else:
            demo = harness.run_demo_hosts
    try:
        if args.workdir is None:
            with tempfile.TemporaryDirectory(prefix="kvpp-demo-") as tmp:
                report = demo(Path(tmp))
        else:
            args.workdir.mkdir(parents=True, exist_ok=True)
            report = demo(args.workdir)
    except (ProcessError, harness.DemoError, TestbedError) as exc:
        # The message names the process and ends with its log tail: what the user needs, not our stack.
        print(f"kvpp demo: failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0 if report["answers_match"] else 1


def print_report(report: dict) -> None:
    cap, xfer, pool = report["capacity"], report["transfer"], report["pool"]
    engine = report["engine"]
    print("KVPP demo: tiny 16-layer MLA model, prefill TP=2 with KVPP, decode TP=1, Mooncake pool")
    print(f"  engine         {engine['kernel']}, {engine['dtype']}, block size {engine['block_size']}")
    print(f"  KV capacity    off {cap['blocks_off']} blocks, on {cap['blocks_on']} blocks: {cap['ratio']:.2f}x "
          f"(plan {cap['plan_blocks_off']} -> {cap['plan_blocks_on']}, {cap['plan_ratio']:.2f}x)")
    rate = xfer["bytes"] / xfer["seconds"] / 1e6 if xfer["seconds"] else 0.0
    print(f"  P/D transfer   {xfer['pulls']} pulls, {xfer['bytes']:,} bytes in {xfer['seconds']:.3f} s "
          f"({rate:.0f} MB/s), {xfer['failures']} failed")
    print(f"  KV pool        {pool['hit_tokens']} prompt tokens loaded from the pool "
          f"({pool['loaded_bytes']:,} bytes loaded, {pool['saved_bytes']:,} bytes saved); "
          f"{pool['local_hit_tokens']} from vLLM's own prefix cache")
    for name, r in report["requests"].items():
        mark = "same as colocated" if r["matches_reference"] else "DIFFERS from colocated"
        if r["matches_reference"] and r["parted_at_near_tie"] is not None:
            mark = f"same as colocated up to a bf16 near tie at token {r['parted_at_near_tie']}"
        print(f"  {name:<18} {r['seconds']:6.2f} s  {mark}: {r['text']!r}")
    print(f"  answers match a colocated engine: {'yes' if report['answers_match'] else 'NO'}")
    if "hosts" in report:
        print("  hosts          " + ", ".join(f"{n} {a}" for n, a in report["hosts"].items())
              + f"; scripts in {report['rendered']}")
