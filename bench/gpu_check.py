"""The GPU check: this project's transfer, pool and broadcast code on CUDA memory, and what copying MLA
and GQA pages costs there, in one JSON report, within 10 minutes on one GPU and without a package registry.

`bench/gpu_check.sh` runs it on the GPU host with what `bench/gpu_check_prepare.sh` fetched on a CPU
host (the CUDA Mooncake wheel, msgspec, Mooncake's system libraries). Each part reports "ok" with its
figures, or "skipped"/"failed" with the reason, and the next part runs anyway:

- environment: Python, torch and CUDA, the device, nvidia-smi, the bundle, the commit;
- mooncake_transfer: two transfer engines (connectors.mooncake.transfer) on loopback tcp, a read of
  device memory into device memory, bytes compared;
- mooncake_pool: mooncake_master on loopback and the pool client (connectors.store.backends.mooncake),
  put from and get into device memory, bytes compared;
- broadcast: two ranks (gloo: NCCL refuses two ranks on one GPU) run kvpp_core.broadcast over device
  tensors, steps that reference 10% of the blocks (exactly those, where kvpp_core.packing.choose moves them so) and
  steps that move every block; every staging slot must hold its owner's bytes after each layer;
- copy: one MLA layer's pages (16-token blocks of 576 bf16 values) at 4K/32K/128K tokens of history:
  one device copy of the whole layer, the scattered history blocks as coalesced ranges against one
  copy per block, and a CUDA-IPC copy out of another process's memory; each >= 3 repeats, interleaved,
  min/median/max;
- packing: issue 37's kernels at 32K/128K tokens, 100/50/10% of the blocks referenced, contiguous,
  scattered or in runs (bench/packing.py's layouts): the ranges sent before it, the referenced runs copied as
  they lie, one gather of exactly the referenced blocks and its placement (kvpp_core.packing.LayerPack: int64 rows; placement as bytes for
  comparison), one copy of the packed bytes standing in for the collective, and the whole layer; what
  `choose` picks and whether that met the issue's targets (never above the whole layer, at most half of it
  at 10%); a copy call's fixed cost against kvpp_core.packing.DEVICE_CALL_BYTES; bytes compared;
- gqa_packing: the same kernels on a GQA rank's pages in vLLM's CPU attention layout ([blocks, kv_heads, block,
  2 x head]) at the per-rank page size of Qwen3-235B-A22B at TP8 (one KV head of 128 bf16 values per rank, blocks
  of 128 tokens: 64 KiB a page), at 32K/128K tokens; K and V written and checked through the kernel's own views.

`--dry-run` runs every part on CPU tensors with small sizes (a test runs it), so the code paths are
exercised where no GPU exists; its report says so, and none of its figures (targets included) is a GPU's.

    python -m bench.gpu_check [--dry-run] [--out bench/results/gpu_check.json] [--skip part,...]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

PARTS = ("environment", "mooncake_transfer", "mooncake_pool", "broadcast", "copy", "packing", "gqa_packing")
BLOCK_TOKENS = 16
PAGE_BYTES = BLOCK_TOKENS * (512 + 64) * 2  # one MLA block of one layer: kv_lora_rank + rope, bf16
HISTORY_TOKENS = (4096, 32768, 131072)
DRY_HISTORY_TOKENS = (256, 512, 1024)
PACKING_TOKENS = (32768, 131072)
DRY_PACKING_TOKENS = (2048, 4096)
REPEATS = 5
GQA_MODEL, GQA_TP = "qwen3-235b-a22b", 8
"""The GQA part's pages: Qwen3-235B-A22B at TP8, one KV head of 128 bf16 values per rank (each head on 2 ranks)."""
BUNDLE_ENV = "KVPP_GPU_BUNDLE"


class Skip(Exception):
    """A part cannot run here; the message says why."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(work: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    work()
    _sync(device)
    return time.perf_counter() - started


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def _pattern(nbytes: int, seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)


# ---- parts ----------------------------------------------------------------------------------------
def environment(device: torch.device, dry_run: bool) -> dict:
    report = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
              "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "dry_run": dry_run,
              "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        report.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                      memory_bytes=props.total_memory)
    smi = shutil.which("nvidia-smi")
    if smi:
        out = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.memory",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        report["nvidia_smi"] = out.stdout.strip() or out.stderr.strip()
    try:
        import mooncake

        report["mooncake"] = str(Path(mooncake.__file__).parent)
    except ImportError as exc:
        report["mooncake"] = f"not importable: {exc}"
    bundle = os.environ.get(BUNDLE_ENV)
    if bundle and Path(bundle).is_dir():
        report["bundle"] = sorted(p.name for p in Path(bundle).iterdir())
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1]) if shutil.which("git") else None
    report["commit"] = git.stdout.strip() if git is not None and git.returncode == 0 else None
    return report


def _mooncake_or_skip(module: str) -> None:
    try:
        __import__(module)
    except ImportError as exc:
        raise Skip(f"{module} does not import ({exc}); it needs the CUDA driver and the bundle of "
                   f"bench/gpu_check_prepare.sh made for this Python ({sys.version_info.major}."
                   f"{sys.version_info.minor})") from exc


def mooncake_transfer(device: torch.device, dry_run: bool) -> dict:
    _mooncake_or_skip("mooncake.engine")
    from connectors.mooncake.transfer import Desc, MooncakeTransfer

    nbytes = (1 << 20) if dry_run else (256 << 20)
    src, dst = _pattern(nbytes, 1, device), torch.zeros(nbytes, dtype=torch.uint8, device=device)
    server, client = MooncakeTransfer("127.0.0.1"), MooncakeTransfer("127.0.0.1")
    try:
        server.register([(src.data_ptr(), nbytes)])
        client.register([(dst.data_ptr(), nbytes)])
        pieces = [Desc(dst.data_ptr() + off, src.data_ptr() + off, min(client.max_entry_bytes, nbytes - off))
                  for off in range(0, nbytes, client.max_entry_bytes)]
        seconds = []
        for i in range(3):
            dst.zero_()
            seconds.append(_timed(lambda: client.read(server.session, pieces), device))
            if not torch.equal(src, dst):
                raise AssertionError(f"read {i}: the bytes read differ from the source")
    finally:
        client.close()
        server.close()
    return {"bytes": nbytes, "protocol": "tcp", "seconds": _spread(seconds),
            "bytes_per_s_median": nbytes / statistics.median(seconds), "bytes_checked": True}


def _start_master() -> tuple[subprocess.Popen, str]:
    import mooncake

    binary = Path(mooncake.__file__).parent / "mooncake_master"
    binary = str(binary) if binary.exists() else shutil.which("mooncake_master")
    if binary is None:
        raise Skip("mooncake_master is neither in the mooncake package nor on PATH")
    rpc, metrics = _free_port(), _free_port()
    proc = subprocess.Popen([binary, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--metrics_host=127.0.0.1",
                             f"--metrics_port={metrics}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "MC_LOG_LEVEL": "ERROR"})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", rpc)) == 0:
                return proc, f"127.0.0.1:{rpc}"
        if proc.poll() is not None:
            raise AssertionError(f"mooncake_master exited with {proc.returncode}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("mooncake_master did not listen within 30 s")


def mooncake_pool(device: torch.device, dry_run: bool) -> dict:
    _mooncake_or_skip("mooncake.store")
    from connectors.store.backends.base import Status
    from connectors.store.backends.bounds import CallPolicy
    from connectors.store.backends.mooncake import MooncakeBackend
    from connectors.store.backends.settings import MooncakeSettings

    objects, object_bytes = (8, 64 << 10) if dry_run else (64, 4 << 20)
    master, address = _start_master()
    try:
        client = MooncakeBackend(MooncakeSettings(master_server_address=address, local_hostname="127.0.0.1",
                                                  global_segment_size=max(64 << 20, 2 * objects * object_bytes),
                                                  local_buffer_size=16 << 20), policy=CallPolicy.fixed(60.0))
        src = _pattern(objects * object_bytes, 2, device)
        dst = torch.zeros_like(src)
        client.register(src.data_ptr(), src.numel())
        client.register(dst.data_ptr(), dst.numel())
        keys = [f"gpu-check-{i}" for i in range(objects)]
        ptrs = [[src.data_ptr() + i * object_bytes] for i in range(objects)]
        put_s = _timed(lambda: _expect(client.put(keys, ptrs, [[object_bytes]] * objects), "put", Status), device)
        into = [[dst.data_ptr() + i * object_bytes] for i in range(objects)]
        get_s = _timed(lambda: _expect(client.get(keys, into, [[object_bytes]] * objects), "get", Status), device)
        if not torch.equal(src, dst):
            raise AssertionError("the objects read back differ from the ones put")
    finally:
        master.kill()
        master.wait(10)
    return {"objects": objects, "object_bytes": object_bytes, "put_s": put_s, "get_s": get_s, "bytes_checked": True}


def _expect(statuses, what: str, status_type) -> None:
    bad = [s for s in statuses if s is not status_type.OK]
    if bad:
        raise AssertionError(f"{what}: {len(bad)} of {len(statuses)} objects failed ({bad[0]})")


def _broadcast_rank(rank: int, port: int, device_name: str, layers: int, blocks: int, results) -> None:
    import torch.distributed as dist

    from bench.packing import referenced
    from kvpp_core.allocation import CacheLayer, place
    from kvpp_core.broadcast import LayerBroadcaster
    from kvpp_core.ownership import rank_layout

    device = torch.device(device_name)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        caches = [CacheLayer(f"model.layers.{i}.self_attn.attn", PAGE_BYTES, i) for i in range(layers)]
        layout = rank_layout(range(layers), 2, rank)
        placement = place(caches, layout, blocks)
        backing = torch.zeros(placement.total_bytes, dtype=torch.uint8, device=device)
        regions = {c.layer_id: [backing[placement.span(c.name)]] for c in caches}
        broadcaster = LayerBroadcaster(layout, regions, blocks, dist.group.WORLD, [0, 1], 120.0)
        for lid in layout.owned:
            regions[lid][0].copy_(_pattern(regions[lid][0].numel(), 100 + lid, device))
        ids = referenced(blocks, 0.1, "scattered")
        index = torch.tensor(ids)
        seconds: dict[str, list[float]] = {"referenced_10_percent": [], "every_block": []}
        wrong = []
        for i in range(4):
            kind = "every_block" if i % 2 else "referenced_10_percent"
            checked = slice(None) if kind == "every_block" else index

            def step() -> None:
                for lid in layout.foreign:
                    regions[lid][0].zero_()  # what a step leaves out must stay zero
                _sync(device)
                broadcaster.begin_step(True, None if kind == "every_block" else ids)
                for lid in layout.target_layers:
                    broadcaster.before_layer(lid)
                    if lid in layout.foreign:
                        got = regions[lid][0].view(blocks, PAGE_BYTES).cpu()
                        want = _pattern(regions[lid][0].numel(), 100 + lid, torch.device("cpu")).view(blocks, PAGE_BYTES)
                        if not torch.equal(got[checked], want[checked]) or (
                                kind != "every_block" and int(got.sum()) != int(got[index].sum())):
                            wrong.append((kind, lid))
                broadcaster.end_step()
            seconds[kind].append(_timed(step, device))
        results.put((rank, {"seconds": seconds, "wrong_layers": wrong, "bytes_received": broadcaster.stats.bytes,
                            "whole_layers": broadcaster.stats.whole_layers}))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc(limit=3)}))
    finally:
        dist.destroy_process_group()


def _two_processes(target, args: tuple, timeout: float) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, *args, results)) for rank in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(results.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def broadcast(device: torch.device, dry_run: bool) -> dict:
    # 8192 blocks: 128K tokens of history per layer, where packing 10% pays on a GPU (kvpp_core.packing.choose)
    layers, blocks = (4, 64) if dry_run else (8, 8192)
    out = _two_processes(_broadcast_rank, (_free_port(), str(device), layers, blocks), timeout=240)
    errors = {r: o["error"] for r, o in out.items() if "error" in o}
    if errors:
        raise AssertionError(f"broadcast ranks failed: {errors}")
    wrong = {r: o["wrong_layers"] for r, o in out.items() if o["wrong_layers"]}
    if wrong:
        raise AssertionError(f"staging slots did not hold their owner's bytes: {wrong} (rank: layers)")
    steps = {kind: _spread([max(s) for s in zip(*(o["seconds"][kind] for o in out.values()))])
             for kind in out[0]["seconds"]}
    foreign = layers // 2  # per rank, over 2 steps of each kind
    received = {r: o["bytes_received"] for r, o in out.items()}
    return {"transport": "torch.distributed (gloo)", "layers": layers, "blocks": blocks, "page_bytes": PAGE_BYTES,
            "step_seconds": steps, "bytes_received": received,
            "referenced_steps_exact": all(o["whole_layers"] == 2 * foreign for o in out.values()),
            "bytes_checked": True}


def _ipc_owner(rank: int, queue, done, device_name: str, nbytes: int, results) -> None:
    """Rank 0 of the IPC copy: allocates a layer in its own memory and shares it."""
    layer = _pattern(nbytes, 7, torch.device(device_name))
    if layer.device.type == "cpu":
        layer.share_memory_()
    queue.put(layer)
    done.wait(timeout=300)
    results.put((rank, {}))


def _ipc_reader(rank: int, queue, done, device_name: str, repeats: int, results) -> None:
    """Rank 1: copies the other process's layer into its own staging buffer, timed, bytes compared."""
    device = torch.device(device_name)
    try:
        shared = queue.get(timeout=120)
        staging = torch.empty_like(shared)
        seconds = [_timed(lambda src=shared: staging.copy_(src), device) for _ in range(repeats)]
        ok = torch.equal(staging.cpu(), _pattern(shared.numel(), 7, torch.device("cpu")))
        del shared
        results.put((rank, {"seconds": seconds, "bytes_checked": ok}))
    except BaseException:
        results.put((rank, {"error": traceback.format_exc(limit=3)}))
    finally:
        done.set()


def _ipc_copy(device: torch.device, nbytes: int, repeats: int) -> dict:
    ctx = torch.multiprocessing.get_context("spawn")
    queue, done, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_ipc_owner, args=(0, queue, done, str(device), nbytes, results)),
             ctx.Process(target=_ipc_reader, args=(1, queue, done, str(device), repeats, results))]
    for p in procs:
        p.start()
    try:
        out = dict(results.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if "error" in out[1]:
        raise AssertionError(f"IPC reader failed: {out[1]['error']}")
    if not out[1]["bytes_checked"]:
        raise AssertionError("the IPC copy differs from the owner's bytes")
    return {"seconds": _spread(out[1]["seconds"]), "bytes_per_s_median": nbytes / statistics.median(out[1]["seconds"])}


def copy_pages(device: torch.device, dry_run: bool) -> dict:
    """Per history length: the modes interleaved within each repeat; history blocks scattered over a cache
    four times the history (a busy engine's block table), so ranges come from coalescing real block ids."""
    from bench.packing import ranges_before

    report = {"page_bytes": PAGE_BYTES, "ipc": "torch.multiprocessing (CUDA IPC handles)" if device.type == "cuda"
              else "torch.multiprocessing (shared CPU memory; dry run)"}
    for tokens in DRY_HISTORY_TOKENS if dry_run else HISTORY_TOKENS:
        blocks = tokens // BLOCK_TOKENS
        rng = random.Random(tokens)
        ids = sorted(rng.sample(range(4 * blocks), blocks))
        ranges = ranges_before(ids)  # as the broadcast sent them before issue 37: a few gaps bridged
        src = _pattern(4 * blocks * PAGE_BYTES, tokens, device).view(4 * blocks, PAGE_BYTES)
        dst = torch.zeros_like(src)
        whole_src, whole_dst = src[:blocks], dst[:blocks]
        modes: dict[str, Callable[[], None]] = {
            "whole_layer": lambda: whole_dst.copy_(whole_src),
            "coalesced_ranges": lambda: [dst[r.start:r.stop].copy_(src[r.start:r.stop]) for r in ranges],
            "per_block": lambda: [dst[b].copy_(src[b]) for b in ids],
        }
        figures: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(REPEATS + 1):  # the first round warms up
            for mode, work in modes.items():
                figures[mode].append(_timed(work, device))
        index = torch.tensor(ids, device=device)
        if not torch.equal(dst.index_select(0, index), src.index_select(0, index)):
            raise AssertionError(f"{tokens} tokens: copied blocks differ from their source")
        layer_bytes = blocks * PAGE_BYTES
        entry = {"blocks": blocks, "layer_bytes": layer_bytes, "ranges": len(ranges)}
        for mode, values in figures.items():
            entry[mode] = {"seconds": _spread(values[1:]), "bytes_per_s_median": layer_bytes / statistics.median(values[1:])}
        entry["cuda_ipc"] = _ipc_copy(device, layer_bytes, REPEATS)
        report[f"{tokens}_tokens"] = entry
    return report


def _pack_and_place(src: torch.Tensor, dst: torch.Tensor, device: torch.device, seed: int,
                    holds_exactly: Callable[[torch.Tensor], bool]) -> dict:
    """One layer's pages (`src`: the owner's, `dst`: a receiver's, each `[blocks, page bytes]` bytes), per
    configuration of referenced blocks the modes interleaved within each repeat (the first warms up); then one
    gather, move and placement of exactly the referenced blocks, which `holds_exactly(index)` checks in the
    receiver's pages."""
    from bench.packing import configurations, label, ranges_before, referenced
    from kvpp_core.packing import LayerPack, Move, StepBlocks, choose

    blocks, page_bytes = src.shape
    sent, got = LayerPack([src]), LayerPack([dst])
    buffer = torch.empty(blocks * page_bytes, dtype=torch.uint8, device=device)
    received = torch.empty_like(buffer)
    one = _spread([_timed(lambda: dst[:1].copy_(src[:1]), device) for _ in range(REPEATS * 4)])
    entry: dict = {"blocks": blocks, "layer_bytes": blocks * page_bytes, "configs": {}}
    for fraction, layout in configurations():
        ids = referenced(blocks, fraction, layout, seed=int(fraction * 1000) + seed)
        step, ranges = StepBlocks(ids), ranges_before(ids)
        index = torch.tensor(ids, device=device)
        k = len(ids) * page_bytes
        modes: dict[str, Callable[[], None]] = {
            "whole": lambda: dst.copy_(src),
            "ranges": lambda ranges=ranges: [dst[r.start:r.stop].copy_(src[r.start:r.stop]) for r in ranges],
            "runs": lambda runs=step.runs: [dst[r.start:r.stop].copy_(src[r.start:r.stop]) for r in runs],
            "gather": lambda index=index: sent.gather(index, buffer),
            "move": lambda k=k: received[:k].copy_(buffer[:k]),
            "place": lambda index=index: got.place(index, received),
            "place_bytes": lambda index=index, k=k: dst.index_copy_(0, index, received[:k].view(-1, page_bytes)),
        }
        figures: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(REPEATS + 1):
            for mode, work in modes.items():
                figures[mode].append(_timed(work, device))
        dst.zero_()
        sent.gather(index, buffer)
        received.copy_(buffer)
        got.place(index, received)
        if not holds_exactly(index):
            raise AssertionError(f"{blocks} blocks, {label(fraction, layout)}: placed blocks differ from the owner's")
        runs = {m: v[1:] for m, v in figures.items()}
        packed = [g + m + p for g, m, p in zip(runs["gather"], runs["move"], runs["place"])]
        move = choose(step, blocks, page_bytes, device, collective=True)
        chosen = {Move.PACKED: packed, Move.RUNS: runs["runs"], Move.WHOLE: runs["whole"]}[move]
        over_whole = [c / w for c, w in zip(chosen, runs["whole"])]
        entry["configs"][label(fraction, layout)] = {
            "referenced_blocks": len(step), "range_blocks": sum(len(r) for r in ranges),
            **{f"{m}_s": _spread(v) for m, v in runs.items()}, "packed_s": _spread(packed),
            "choice": move.value, "chosen_over_whole": _spread(over_whole),
            "packed_over_whole": _spread([p / w for p, w in zip(packed, runs["whole"])]),
            "bytes_checked": True,
        }
    worst = max(c["chosen_over_whole"]["median"] for c in entry["configs"].values())
    at10 = max(c["chosen_over_whole"]["median"] for name, c in entry["configs"].items() if name.startswith("10%"))
    whole_bandwidth = entry["layer_bytes"] / statistics.median(runs["whole"])
    entry["call_s"] = one
    entry["call_bytes_measured"] = one["median"] * whole_bandwidth
    entry["targets"] = {"chosen_over_whole_worst": worst, "never_above_whole": worst <= 1.0,
                        "chosen_over_whole_at_10_percent_worst": at10, "half_at_10_percent": at10 <= 0.5}
    return entry


def packing(device: torch.device, dry_run: bool) -> dict:
    """MLA pages (16-token blocks of 576 bf16 values), per layer size; bytes compared row by row."""
    from kvpp_core.packing import call_bytes

    report: dict = {"page_bytes": PAGE_BYTES, "call_bytes_assumed": call_bytes(device),
                    "collective": "one device copy of the packed bytes stands in for it (one GPU: no NCCL pair)"}
    for tokens in DRY_PACKING_TOKENS if dry_run else PACKING_TOKENS:
        blocks = tokens // BLOCK_TOKENS
        src = _pattern(blocks * PAGE_BYTES, tokens, device).view(blocks, PAGE_BYTES)
        dst = torch.zeros_like(src)

        def holds_exactly(index: torch.Tensor, src=src, dst=dst) -> bool:
            return torch.equal(dst[index], src[index]) and int(dst.sum()) == int(dst[index].sum())

        report[f"{tokens}_tokens"] = _pack_and_place(src, dst, device, 0, holds_exactly)
    return report


def _kv_views(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V caches in a CPU attention page tensor `[blocks, kv_heads, block, 2 x head]`, as vLLM's kernel
    takes them (`vllm/v1/attention/backends/cpu_attn.py`: a view `[blocks, kv_heads, 2 x block, head]`, split in
    two at dim 2)."""
    blocks, heads, block, two_head = pages.shape
    return pages.view(blocks, heads, 2 * block, two_head // 2).chunk(2, dim=2)


def gqa_packing(device: torch.device, dry_run: bool) -> dict:
    """A GQA rank's pages in vLLM's CPU attention layout, at the per-rank page size of GQA_MODEL at GQA_TP
    (kvpp_core.model: its KV heads per rank, head size and dtype; CPU_ATTN's block size): K and V filled through
    the kernel's own views, then the packing part's modes and one gather and placement of the referenced blocks,
    checked through the K and V views of the receiver (every referenced block equal, every other block zero)."""
    from kvpp_core.cpu_backends import CPU_ATTN
    from kvpp_core.model import PRESETS
    from kvpp_core.packing import call_bytes

    model = PRESETS[GQA_MODEL]
    block, heads, head = CPU_ATTN.default_block_size, model.kv_heads_per_rank(GQA_TP), model.head_dim
    dtype = getattr(torch, model.kv_dtype)
    page_bytes = heads * block * 2 * head * torch.tensor([], dtype=dtype).element_size()
    if page_bytes != model.page_bytes(block, GQA_TP):
        raise AssertionError(f"the kernel's page ({page_bytes} B) is not the planner's ({model.page_bytes(block, GQA_TP)} B)")
    report: dict = {"model": model.name, "tp": GQA_TP, "replica_group_ranks": GQA_TP // model.num_kv_heads,
                    "kv_heads_per_rank": heads, "head_dim": head, "dtype": model.kv_dtype, "block_size": block,
                    "page_bytes": page_bytes, "layout": "[blocks, kv_heads, block, 2 x head] (vLLM's CPU attention)",
                    "call_bytes_assumed": call_bytes(device)}
    for tokens in DRY_PACKING_TOKENS if dry_run else PACKING_TOKENS:
        blocks = tokens // block
        src = torch.zeros(blocks, heads, block, 2 * head, dtype=dtype, device=device)
        gen = torch.Generator().manual_seed(tokens)
        for view in _kv_views(src):  # K, then V: finite values (a random byte pattern could hold NaNs)
            view.copy_(torch.randn(view.shape, generator=gen).to(dtype))
        dst = torch.zeros_like(src)
        src_bytes, dst_bytes = src.view(torch.uint8).view(blocks, page_bytes), dst.view(torch.uint8).view(blocks, page_bytes)

        def holds_exactly(index: torch.Tensor, src=src, dst=dst, dst_bytes=dst_bytes) -> bool:
            same = all(torch.equal(d[index], s[index]) for d, s in zip(_kv_views(dst), _kv_views(src)))
            return same and int(dst_bytes.count_nonzero()) == int(dst_bytes[index].count_nonzero())

        report[f"{tokens}_tokens"] = _pack_and_place(src_bytes, dst_bytes, device, 1, holds_exactly)
    return report


# ---- driver ---------------------------------------------------------------------------------------
RUNNERS: dict[str, Callable[[torch.device, bool], dict]] = {
    "environment": environment, "mooncake_transfer": mooncake_transfer, "mooncake_pool": mooncake_pool,
    "broadcast": broadcast, "copy": copy_pages, "packing": packing, "gqa_packing": gqa_packing,
}


def run(dry_run: bool, skip: set[str]) -> dict:
    """Every part, each reported on its own: ok with its figures, skipped or failed with the reason."""
    if not dry_run and not torch.cuda.is_available():
        device = None
    else:
        device = torch.device("cpu") if dry_run else torch.device("cuda", 0)
    report = {"benchmark": "gpu_check", "dry_run": dry_run, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "parts": {}}
    for name in PARTS:
        started = time.perf_counter()
        if name in skip:
            result = {"status": "skipped", "reason": "--skip"}
        elif device is None and name != "environment":
            result = {"status": "skipped", "reason": "torch sees no CUDA device (use --dry-run for the CPU paths)"}
        else:
            try:
                result = {"status": "ok", **RUNNERS[name](device or torch.device("cpu"), dry_run)}
            except Skip as exc:
                result = {"status": "skipped", "reason": str(exc)}
            except Exception as exc:  # the report names it; the next part still runs
                result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc(limit=4)}
        result["wall_s"] = round(time.perf_counter() - started, 3)
        report["parts"][name] = result
        print(f"[gpu_check] {name}: {result['status']} ({result['wall_s']} s)"
              + (f": {result['reason']}" if "reason" in result else ""), file=sys.stderr, flush=True)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU tensors, small sizes: the code paths, no GPU figures")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu_check.json")
    ap.add_argument("--skip", default="", help=f"comma-separated parts to skip, of {', '.join(PARTS)}")
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(PARTS)
    if unknown:
        ap.error(f"--skip: unknown part(s) {', '.join(sorted(unknown))}; parts are {', '.join(PARTS)}")
    report = run(args.dry_run, skip)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(args.out)
    return int(any(p["status"] == "failed" for p in report["parts"].values()))


if __name__ == "__main__":
    sys.exit(main())
