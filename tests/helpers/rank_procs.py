"""Real processes standing in for a cache-replica group's ranks (spawned, one gloo group), and KV caches
allocated the way vLLM's allocate_kv_cache does: shared by the shared-memory and zero-copy tests."""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

from deploy.services.processes import free_port


def vllm_like_caches(layers, placement, blocks: int, page: int) -> dict[str, torch.Tensor]:
    """fp32 views of one zeroed int8 buffer at the planned offsets (overlapping where the plan aliases)."""
    buf = torch.zeros(placement.total_bytes, dtype=torch.int8)
    out = {}
    for cache in layers:
        offset, nbytes = placement.region(cache.name)
        out[cache.name] = buf[offset:offset + nbytes].view(torch.float32).view(blocks, page // 4)
    return out


def run_ranks(target, world: int, args: tuple, expect: int | None = None, timeout: float = 90.0):
    """Start `target(rank, world, port, *args, results)` in `world` processes; collect (rank, status, payload)
    until `expect` ranks (default all) answered or `timeout`; return ({rank: (status, payload)}, elapsed)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results)) for r in range(world)]
    started = time.monotonic()
    for p in procs:
        p.start()
    out = {}
    while len(out) < (expect or world) and time.monotonic() - started < timeout:
        try:
            rank, status, payload = results.get(timeout=1.0)
        except Exception:
            continue
        out[rank] = (status, payload)
    elapsed = time.monotonic() - started
    for p in procs:
        p.join(timeout=2)
        if p.is_alive():
            p.kill()
    return out, elapsed
