"""A KV pool that stops answering, under concurrent clients: what it costs each request.

The local P/D stack of `kvpp chaos` (Mooncake pool, prefill TP=2 with KVPP and the pool connector at its
default bounds, decode TP=1, `kvpp proxy`) serves the chaos clients' prompts (four share a prefix, every
prompt's whole blocks pooled after its first answer). Each run is one pool probe (deploy/harness/chaos_pool.py):
the prompts timed without the pool (a fresh cache_salt each: the recompute), then `--clients` clients send
them back to back while the pool is stopped (SIGSTOP: the segment holder, 1 s later the master) for `--stall`
seconds from the holder's stop. Per run: every request overlapping the stall, its seconds, min / median / max,
the limit (the prefill's per-request pool bound + the slowest recompute + the probe's slack) and the prefill's
pool counters (what fired). The load runs `--gap` seconds between runs. Exit 1 unless every run kept the limit.

    flock /tmp/kvpp-engine.lock .venv/bin/python -m bench.pool_stall [--runs 5] [--clients 4] [--stall 12]
        [--workdir DIR] [--out bench/results/pool_stall.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.summary import host, spread
from deploy.harness.chaos import Fault, run_chaos
from deploy.harness.chaos_pool import POOL_STALL_S
from deploy.harness.chaos_stack import StackSettings


def summarise(report: dict) -> dict:
    """Per run: the requests' seconds (min / median / max), the limit and whether every request kept it."""
    runs = []
    for probe in report["pool_probes"]:
        seconds = [r["seconds"] for r in probe["requests"]]
        runs.append({"requests": len(seconds), "seconds": spread(seconds) if seconds else None,
                     "limit_s": probe["limit_s"], "recompute_s": probe["recompute_s"],
                     "over_limit": probe["over_limit"],
                     "within_limit": not probe["problems"] and not probe["over_limit"], "counters": probe["counters"],
                     "problems": probe["problems"]})
    every = [r["seconds"] for p in report["pool_probes"] for r in p["requests"]]
    return {"runs": runs, "all_requests": spread(every) if every else None,
            "runs_within_limit": sum(r["within_limit"] for r in runs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="pool stalls, one probe each (default 5)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--stall", type=float, default=POOL_STALL_S, metavar="S", help="seconds the pool is stopped")
    ap.add_argument("--gap", type=float, default=4.0, metavar="S", help="load between runs (default 4)")
    ap.add_argument("--workdir", type=Path, help="model, logs and pool state (default: a temp dir)")
    ap.add_argument("--note", default="", help="what else shared the host, for the results file")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    if args.runs < 1 or args.clients < 1 or args.stall <= 0:
        ap.error("--runs and --clients must be >= 1 and --stall > 0")
    schedule = [Fault("stall", "pool", args.stall)] * args.runs
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvpp-pool-stall-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        report = run_chaos(workdir, lambda: schedule, args.clients, 0, args.gap, StackSettings())
    out = {"command": " ".join(["python -m bench.pool_stall", *sys.argv[1:]]), "host": host(args.note),
           "clients": args.clients, "stall_s": args.stall, "seconds": round(time.monotonic() - start),
           **summarise(report), "chaos_ok": report["ok"], "chaos_problems": report["problems"],
           "probes": report["pool_probes"]}
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "probes"}, indent=1))
    return 0 if out["runs_within_limit"] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
