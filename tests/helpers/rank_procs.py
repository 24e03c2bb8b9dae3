"""Real processes standing in for a cache-replica group's ranks (spawned, one gloo group), and KV caches
allocated the way vLLM's allocate_kv_cache does: shared by the shared-memory and zero-copy tests."""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

from deploy.services.ports import free_port


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
    until `expect` ranks (default all) answered or `timeout`; return ({rank: (status, payload)}, elapsed).
    `timeout` is a liveness bound (a rank that hangs never answers): far above any wait a scenario configures
    plus the spawned ranks' start on a loaded host; `elapsed` is for failure messages."""
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


def join_group(rank: int, world: int, port: int, env: dict, scenario: str, num_layers: int, staging: int,
               page: int, blocks: int):
    """In a rank process: the gloo group, and this rank's caches, layout and placement. The "other_host"
    scenario gives the last rank a /dev/shm of its own (KVPP_TEST_OTHER_SHM), as on another host."""
    import os

    import torch.distributed as dist

    from kvpp_core import shm_broadcast
    from kvpp_core.allocation import CacheLayer, place
    from kvpp_core.ownership import rank_layout

    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if scenario == "other_host" and rank == world - 1:
        shm_broadcast.SHM_DIR = shm_broadcast.Path(os.environ["KVPP_TEST_OTHER_SHM"])
    layers = [CacheLayer(f"model.layers.{i}.self_attn.attn", page, i) for i in range(num_layers)]
    layout = rank_layout(range(num_layers), world, rank, staging)
    return layers, layout, place(layers, layout, blocks)


def report_outcome(rank: int, results, body) -> None:
    """Run `body()` (a rank's scenario, which puts its own "ok" result) and put any failure as its kind."""
    import traceback

    from kvpp_core.broadcast import KvppBroadcastError
    from kvpp_core.config import KvppConfigError

    try:
        body()
    except KvppBroadcastError as exc:
        results.put((rank, "broadcast_error", str(exc)))
    except KvppConfigError as exc:
        results.put((rank, "config_error", str(exc)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
