"""The decode step with a fragmented cache, per KVPP mode, before and after issue 37 (exactly the referenced blocks).

Each engine (the tiny 16-layer MLA model, TP2, offline through testbed's driver, one per mode and round) serves the
same job (testbed/staggered.py's probe): a decode batch (`--batch` requests of `--context-blocks` blocks each,
`--decode-tokens` tokens) on the fresh cache; a churn that hands out every block of the cache (requests of two
blocks decoding one block more, in lockstep, so their blocks interleave) and frees it again, stale; the same batch
again, its blocks now scattered among the churn's. On `AMX_MLA` vLLM's prefix cache keeps the churn's histories
cached between the batch's blocks: the cache full of idle histories issue 37's targets are set on.

Modes (`--modes`): KVPP off; staging (2 buffers) as this checkout runs it; `staging-before`, the same engine
running the code at `--before` (bench/before.py; default the commit before issue 37); zero-copy. Per pass: the
decode step (median of the pass's steps but its prefill), the bytes a worker received per decode step (its KVPP
counters), answers against KVPP off's of the round. Every round runs every mode once, each round starting one mode
later; ratios over KVPP off are taken within a round, reported as min/median/max.

`--kernel CPU_MLA` (default: fp32, block 16, any host) or `AMX_MLA` (bf16, block 128, vLLM's prefix cache on; a host
with AMX). Issue 37's targets are for AMX_MLA: staging's decode step with the churned cache at most 1.10x KVPP off's.

    flock /tmp/kvpp-engine.lock .venv/bin/python -m bench.fragmented [--kernel CPU_MLA] [--modes off,staging,
        staging-before] [--rounds 3] [--kv-mib 256] [--out bench/results/fragmented.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.before import Before, code_at
from bench.summary import host, interleaved, spread
from deploy.services.processes import CPU_ENGINES
from testbed.engine import EngineSettings
from testbed.engine_run import Job, run_engine
from testbed.prompts import token_prompts
from testbed.staggered import Staggered

BEFORE = "c8d1b82"
"""The commit before issue 37: a step sent at most 16 coalesced ranges of each layer (bench/packing.py's
`ranges_before`), the shared-memory transport copied the same ranges."""
MODES = {"off": {}, "staging": {"kvpp": True, "staging": 2}, "staging-before": {"kvpp": True, "staging": 2},
         "zero-copy": {"kvpp": True, "staging": 0}}
PASSES = ("fresh", "churned")


def workload(model: str, block: int, blocks_most: int, batch: int, context_blocks: int, decode: int,
             draw: Callable[..., list[list[int]]] = token_prompts) -> Staggered:
    """The batch twice around a churn that hands out `blocks_most` blocks (the largest cache of the modes run):
    one-block prompts decoding five blocks more together, so that their blocks interleave, then finishing in five
    groups of every fifth request (tests/helpers/pp_pair.py's churn, scaled to the cache). `draw(model, lengths,
    seed)`: the prompts' tokens."""
    churn = math.ceil(blocks_most / 6)
    return Staggered(prompts=[], steps_between_waves=0, max_tokens=decode,
                     probe=draw(model, [context_blocks * block] * batch, seed=2),
                     churn=draw(model, [block] * churn, seed=3),
                     churn_max_tokens=[5 * block - 5 + i % 5 for i in range(churn)])


def run(model: str, mode: str, kernel: str, kv_bytes: int, job: Staggered, before: Before | None) -> dict:
    print(f"[bench] {mode} ...", file=sys.stderr, flush=True)
    block = CPU_ENGINES[kernel].block_size
    longest = max(len(p) for p in job.probe) + job.max_tokens + block
    settings = EngineSettings(model=model, kernel=kernel, tp=2, kv_bytes=kv_bytes, max_model_len=longest,
                              **MODES[mode])
    code = {"env": before.env, "roots": before.roots} if mode == "staging-before" else {}
    return run_engine(Job(settings, job), timeout=1800, **code)


def figures(result: dict) -> dict:
    """Per pass: the median decode step, bytes a worker received per decode step (the worker that got most), the
    pass's answers; and the engine's blocks."""
    out = {"num_blocks": result["num_blocks"]}
    for name in PASSES:
        probe = result["probe"][name]
        per_step = [w["bytes"] / w["broadcast_steps"] for w in probe["workers"] if w.get("broadcast_steps")]
        out[name] = {"decode_step_s": statistics.median(probe["step_seconds"][1:]),
                     "bytes_per_decode_step": max(per_step, default=0.0),
                     "whole_layers": sum(w.get("whole_layers", 0) for w in probe["workers"]),
                     "answers": {k: v["token_ids"] for k, v in probe["outputs"].items()}}
    return out


def summarise(rounds: list[dict], modes: list[str]) -> dict:
    """min/median/max per mode and pass, ratios over KVPP off within each round, answers against off's."""
    summary: dict = {}
    for mode in modes:
        entry: dict = {"num_blocks": rounds[0][mode]["num_blocks"]}
        for name in PASSES:
            entry[name] = {
                "decode_step_s": spread(r[mode][name]["decode_step_s"] for r in rounds),
                "bytes_per_decode_step": spread(r[mode][name]["bytes_per_decode_step"] for r in rounds),
                "whole_layers": max(r[mode][name]["whole_layers"] for r in rounds),
                "answers_equal_off": sum(r[mode][name]["answers"] == r["off"][name]["answers"] for r in rounds),
            }
            if mode != "off":
                entry[name]["decode_step_over_off"] = spread(
                    r[mode][name]["decode_step_s"] / r["off"][name]["decode_step_s"] for r in rounds)
        summary[mode] = entry
    for mode in ("staging", "staging-before"):
        if mode in modes:
            summary[mode]["churned_bytes_over_fresh"] = spread(
                r[mode]["churned"]["bytes_per_decode_step"] / r[mode]["fresh"]["bytes_per_decode_step"] for r in rounds)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=list(CPU_ENGINES), default="CPU_MLA")
    ap.add_argument("--modes", default="off,staging,staging-before")
    ap.add_argument("--before", default=BEFORE, help="the commit staging-before runs (default: before issue 37)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-mib", type=int, default=256, help="KV memory per rank")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context-blocks", type=int, default=32, help="each batch request's prompt, in blocks")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--model", help="model dir (default: build the 16-layer tiny model)")
    ap.add_argument("--note", default="", help="what else ran on the host (recorded in the results)")
    ap.add_argument("--out", default="bench/results/fragmented.json")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or "off" not in modes:
        ap.error(f"--modes: off and any of {', '.join(m for m in MODES if m != 'off')}; unknown: {', '.join(unknown)}")
    if args.rounds < 3:
        ap.error("--rounds: at least 3 (min/median/max need them)")
    engine = CPU_ENGINES[args.kernel]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        before = stack.enter_context(code_at(args.before)) if "staging-before" in modes else None
        model = args.model
        if model is None:
            from deploy.harness.tiny_model import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "tiny16", layers=16))
        blocks_most = _most_blocks(model, args.kv_mib << 20, engine, modes)
        job = workload(model, engine.block_size, blocks_most, args.batch, args.context_blocks, args.decode_tokens)
        rounds: list[dict] = [{} for _ in range(args.rounds)]
        for index, mode in interleaved(modes, args.rounds):
            rounds[index][mode] = figures(run(model, mode, args.kernel, args.kv_mib << 20, job, before))
    result = {
        "kernel": args.kernel, "dtype": engine.dtype, "block_size": engine.block_size,
        "workload": {"batch": args.batch, "context_tokens": args.context_blocks * engine.block_size,
                     "decode_tokens": args.decode_tokens, "churn_requests": len(job.churn), "kv_bytes": args.kv_mib << 20,
                     "tp": 2, "rounds": args.rounds},
        "before": None if before is None else {"ref": before.ref, "commit": before.commit},
        "modes": summarise(rounds, modes),
        "host": host(args.note),
        "command": "flock /tmp/kvpp-engine.lock .venv/bin/python -m bench.fragmented " + " ".join(sys.argv[1:]),
        "rounds": rounds,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))


def _most_blocks(model: str, kv_bytes: int, engine, modes: list[str]) -> int:
    """The most blocks any of the modes' engines will hold (`kvpp plan`), which the churn hands out."""
    from kvpp_core.capacity import plan_capacity
    from kvpp_core.model import ModelSpec
    from kvpp_core.topology import Topology

    spec = ModelSpec.from_hf_config(model).with_overrides(kv_dtype=engine.dtype)
    plans = [plan_capacity(spec, Topology(tp=2), kv_bytes, block_size=engine.block_size,
                           staging=MODES[m].get("staging", 2)) for m in modes]
    return max(max(p.blocks_on, p.blocks_off) for p in plans)


if __name__ == "__main__":
    main()
