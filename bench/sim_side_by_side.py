"""`kvpp simulate` beside KVCache.AI's hit-rate simulator (`kvcache-simulator` on PyPI, pinned) on the same traces,
at equal capacity and on the same measurement window, and, for a trace captured from this project's engine, beside
the hits vLLM itself reported.

kvcache-simulator runs in a virtual environment of its own that this bench makes (KVSIM_VENV, under the
gitignored build/): a driver there reads each trace with its `parse_trace_file` and runs its own sweep
(`run_cpp_sweep`, the C++ backend its CLI runs by default) at the capacity in blocks given here, which its CLI
derives from a GiB budget and its model catalogue instead. Its window: the last half of the requests in trace
order, hits counted once the cache was full before it (an underfilled budget is left out, `measurementMode`).
`kvpp simulate`'s hits (deploy/simulation, in process) and vLLM's (`num_cached_tokens`) are summed over the same
requests; the whole trace's rate is given too.

The traces, one block size and capacity each for both simulators:
- the shipped samples tests/data/traces/mooncake.jsonl (512-token blocks, 12 of them) and bailian.jsonl (16-token
  blocks, 64: about the least an engine takes whose longest request needs 62; kvcache-simulator's cache is not
  full by its window then, so it measures nothing there and says so);
- a synthetic multi-turn agent workload (deploy/simulation/synthetic.py) written as a Mooncake trace, 128-token
  blocks, 1,200 of them;
- the trace captured from the project's engine (bench/sim_capture.py, tests/data/traces/captured.jsonl: the tiny
  MLA model on AMX_MLA, block 128, the engine's 70 usable blocks), replayed by `kvpp simulate` step for step as the engine ran it, and given to
  kvcache-simulator as the Mooncake-style trace of its prompts (each prompt's full blocks named by their chained
  hashes, its partial last block by an id no other block has).
Engines as `kvpp simulate` models them by default (one colocated engine, its scheduler's defaults, vLLM's
asynchronous scheduling and the default cost model), except the captured trace's, which are the capture's.

    .venv/bin/python -m bench.sim_side_by_side [--out bench/results/sim_side_by_side.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import msgspec

from deploy.simulation.cluster import Simulation
from deploy.simulation.costs import DEFAULT, CostModel
from deploy.simulation.formats import read_trace, write_public
from deploy.simulation.state import EngineConfig
from deploy.simulation.synthetic import Workload, public_lines
from deploy.simulation.trace import TraceLine

KVSIM = "kvcache-simulator==0.1.3"
KVSIM_VENV = Path("build/kvcache-simulator")
SAMPLES = Path("tests/data/traces")
WINDOW = 0.5
"""kvcache-simulator's warm-up: the first half of the requests (its `warmup_fraction`)."""
POLICIES = ("lru", "optimal")
DRIVER = """
import json, sys
from kvcache_sim.cpp_backend import run_cpp_sweep
from kvcache_sim.trace import parse_trace_file
ask = json.loads(sys.argv[1])
trace = parse_trace_file(ask["trace"], block_size=ask["block_size"])
warmup = int(trace.request_count * ask["warmup"])
sweep = run_cpp_sweep(trace, capacities=[ask["capacity"]], policies=ask["policies"], warmup_requests=warmup)
print(json.dumps({"requests": trace.request_count, "warmup_requests": warmup, "unique_blocks": sweep.unique_blocks,
                  "ceiling": sweep.ceiling.to_json(),
                  **{p: sweep.results[(p, ask["capacity"])].to_json() for p in ask["policies"]}}))
"""


def kvsim_python() -> Path:
    """The interpreter of kvcache-simulator's own environment, made (and the pinned release installed) if missing."""
    python = KVSIM_VENV / "bin" / "python"
    check = [str(python), "-c", "import importlib.metadata as m; print(m.version('kvcache-simulator'))"]
    if python.exists() and subprocess.run(check, capture_output=True, text=True).stdout.strip() == KVSIM.split("==")[1]:
        return python
    venv.create(KVSIM_VENV, with_pip=True, clear=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", KVSIM], check=True)
    return python


def kvsim(trace: Path, block_size: int, capacity: int) -> dict:
    ask = {"trace": str(trace), "block_size": block_size, "capacity": capacity, "policies": list(POLICIES),
           "warmup": WINDOW}
    out = subprocess.run([str(kvsim_python()), "-c", DRIVER, json.dumps(ask)], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout)


def kvpp(trace: Path, block_size: int, capacity: int, fmt: str, engine: dict | None = None,
         costs: CostModel = DEFAULT) -> dict:
    """`kvpp simulate`'s hits per request on `trace` with `capacity` usable blocks (vLLM's num_gpu_blocks is one
    more: its null block): the whole trace's rate and the window's."""
    engine = engine or {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "async": True,
                        "max_model_len": min(32768, capacity * block_size)}  # the longest an engine this small takes
    config = EngineConfig(capacity + 1, block_size, engine["max_num_batched_tokens"], engine["max_num_seqs"],
                          engine["max_model_len"], False, async_scheduling=engine["async"])
    log: list[dict] = []
    result = Simulation(config, 1, "round-robin", costs, "off", log=log).run(
        read_trace(trace, block_size, block_size, fmt=fmt))
    hits = [x["hit_tokens"] for x in sorted(log, key=lambda x: x["index"])]
    return {"hit_rate": result.hit_rate, "hits": hits, "preemptions": result.preemptions,
            "scheduling": "async" if engine["async"] else "sync"}


def window(hits: list[int], prompts: list[int]) -> float:
    start = int(len(hits) * WINDOW)
    return sum(hits[start:]) / sum(prompts[start:])


def prompts_of(trace: Path, block_size: int, fmt: str) -> list[int]:
    return [r.prompt for r in read_trace(trace, block_size, block_size, fmt=fmt)]


def row(name: str, trace: Path, block_size: int, capacity: int, fmt: str, kvsim_trace: Path | None = None,
        engine: dict | None = None, costs: CostModel = DEFAULT, vllm: list[int] | None = None) -> dict:
    prompts = prompts_of(trace, block_size, fmt)
    ours = kvpp(trace, block_size, capacity, fmt, engine, costs)
    theirs = kvsim(kvsim_trace or trace, block_size, capacity)
    out = {"trace": name, "file": str(trace), "block_size": block_size, "capacity_blocks": capacity,
           "requests": len(prompts), "window_first_request": int(len(prompts) * WINDOW),
           "kvpp_simulate": {"whole": ours["hit_rate"], "window": window(ours["hits"], prompts),
                             "preemptions": ours["preemptions"], "scheduling": ours["scheduling"]},
           "kvcache_simulator": theirs}
    if vllm is not None:
        out["vllm"] = {"whole": sum(vllm) / sum(prompts), "window": window(vllm, prompts)}
        out["per_request_equal"] = sum(a == b for a, b in zip(ours["hits"], vllm))
    return out


def synthetic(tmp: Path) -> Path:
    work = Workload(conversations=300, turns=8, rate=2.0, system_prompts=4, system_tokens=1024, first_tokens=512,
                    growth_tokens=256, output_tokens=128, think_s=20.0, variation=0.3, seed=3)
    path = tmp / "synthetic.mooncake.jsonl"
    write_public(public_lines(work, "mooncake", 128), path, "mooncake")
    return path


def captured_for_kvsim(tmp: Path) -> tuple[Path, list[int], dict]:
    """The captured trace as kvcache-simulator reads it (its prompts' blocks), vLLM's hits and the capture's record."""
    meta = json.loads((SAMPLES / "captured.json").read_text())
    bs = meta["engine"]["block_size"]
    decoder = msgspec.json.Decoder(TraceLine)
    path = tmp / "captured.mooncake.jsonl"
    with open(SAMPLES / "captured.jsonl", "rb") as f, open(path, "w") as out:
        for i, raw in enumerate(f):
            line = decoder.decode(raw)
            ids = [str(h) for h in line.prompt_hashes] + ([f"partial-{i}"] if line.prompt_len % bs else [])
            out.write(json.dumps({"timestamp": line.arrival_s, "input_length": line.prompt_len,
                                  "output_length": line.output_len, "hash_ids": ids}) + "\n")
    return path, [r["vllm_cached_tokens"] for r in meta["requests"]], meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/sim_side_by_side.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvpp-side-by-side-") as tmp:
        tmp = Path(tmp)
        rows.append(row("Mooncake sample", SAMPLES / "mooncake.jsonl", 512, 12, "mooncake"))
        rows.append(row("Bailian sample", SAMPLES / "bailian.jsonl", 16, 64, "bailian"))
        rows.append(row("synthetic multi-turn (Mooncake format)", synthetic(tmp), 128, 1200, "mooncake"))
        kvsim_trace, vllm, meta = captured_for_kvsim(tmp)
        engine = meta["engine"]
        rows.append(row("captured from the engine", SAMPLES / "captured.jsonl", engine["block_size"],
                        engine["num_gpu_blocks"] - 1, "kvpp", kvsim_trace,
                        {"max_num_batched_tokens": engine["max_num_batched_tokens"],
                         "max_num_seqs": engine["max_num_seqs"], "max_model_len": engine["max_model_len"],
                         "async": False}, msgspec.convert(meta["replay_costs"], CostModel), vllm))
    out = {"command": ".venv/bin/python -m bench.sim_side_by_side " + shlex.join(sys.argv[1:]), "kvcache_simulator": KVSIM,
           "window": f"the last {1 - WINDOW:.0%} of the requests, in trace order", "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for r in rows:
        k, s = r["kvpp_simulate"], r["kvcache_simulator"]
        print(f"{r['trace']:40} {r['capacity_blocks']:>5} blocks: kvpp simulate {k['window']:.3f} (whole {k['whole']:.3f}), "
              f"kvcache-simulator lru {s['lru']['hitRate']:.3f} ({s['lru']['measurementMode']}), optimal "
              f"{s['optimal']['hitRate']:.3f}" + (f", vLLM {r['vllm']['window']:.3f} (whole {r['vllm']['whole']:.3f}),"
                                                  f" {r['per_request_equal']}/{r['requests']} requests equal"
                                                  if "vllm" in r else ""))


if __name__ == "__main__":
    main()
