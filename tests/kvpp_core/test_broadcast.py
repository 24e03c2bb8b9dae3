"""LayerBroadcaster over real torch.distributed gloo process groups, 2-4 ranks in separate processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

import pytest
import torch

from deploy.services.ports import free_port
from kvpp_core.broadcast import KvppBroadcastError, LayerBroadcaster, coalesce
from kvpp_core.ownership import rank_layout

pytestmark = pytest.mark.integration

NUM_BLOCKS = 6
PAGE = 64  # bytes per block and layer


def _pattern(layer: int, step: int) -> torch.Tensor:
    """What the owner's persistent cache of `layer` holds at `step`: distinct per layer, block, step."""
    base = torch.arange(NUM_BLOCKS * PAGE, dtype=torch.int64).reshape(NUM_BLOCKS, PAGE)
    return ((base * 7 + layer * 31 + step * 101) % 251).to(torch.uint8)


def _worker(rank, world, port, num_layers, staging, scenario, results):
    try:
        import torch.distributed as dist

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        layout = rank_layout(range(num_layers), world, rank, staging)
        persistent = {l: torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.uint8) for l in layout.owned}
        slots = [torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.uint8) for _ in range(layout.staging_slots)]

        def bound(layer):
            return persistent[layer] if layer in persistent else slots[layout.slot_of(layer)]

        regions = {l: [bound(l)] for l in layout.target_layers}
        bc = LayerBroadcaster(layout, regions, NUM_BLOCKS, None, list(range(world)), timeout=5.0)
        report = {"checked": 0, "owned": list(layout.owned)}
        steps = 3
        for step in range(steps):
            for l, buf in persistent.items():
                buf.copy_(_pattern(l, step))
            ranges = [range(1, 3), range(4, 5)] if scenario == "narrow" else None
            if scenario == "narrow":
                for s in slots:
                    s.zero_()
            # Odd steps pass the ranges the way the engine does: asked for at the first broadcast.
            bc.begin_step(True, ranges if step % 2 == 0 or ranges is None else (lambda: ranges))
            for l in layout.target_layers:
                if scenario == "die" and step == 1 and rank == world - 1 and l == layout.target_layers[-1]:
                    os._exit(3)  # a rank vanishes mid-step, in the middle of a layer sequence
                bc.before_layer(l)
                # Let any prefetch of the next layer land, then check it did not clobber this one.
                time.sleep(0.01)
                got, want = bound(l), _pattern(l, step)
                if scenario == "narrow":
                    sent = torch.zeros(NUM_BLOCKS, dtype=torch.bool)
                    for r in ranges:
                        sent[r.start : r.stop] = True
                    want = torch.where(sent[:, None], want, torch.zeros_like(want))
                    if l in persistent:
                        want = _pattern(l, step)
                assert torch.equal(got, want), f"rank {rank} step {step} layer {l} differs"
                report["checked"] += 1
                # The attention then writes this step's new tokens into the bound cache.
                got[1, 0] = 255  # block 1 is sent in every scenario, so the next delivery must restore it
            bc.end_step()
        report["stats"] = bc.stats.as_dict()
        results.put((rank, "ok", report))
        dist.destroy_process_group()
    except KvppBroadcastError as exc:
        results.put((rank, "broadcast_error", str(exc)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def _run(world, num_layers, staging=2, scenario="plain", timeout=120.0):
    """Each rank's (status, payload), collected until every rank that can answer did, or `timeout`: a
    liveness bound (a rank that hangs never answers), far above the 5 s broadcast timeout plus the spawned
    ranks' start on a loaded host."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, num_layers, staging, scenario, results))
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    for p in procs:
        p.start()
    out = {}
    expected = world - 1 if scenario == "die" else world
    while len(out) < expected and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=1.0)
            out[rank] = (status, payload)
        except Exception:
            continue
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return out


@pytest.mark.parametrize("world,num_layers,staging", [(2, 16, 2), (3, 7, 2), (4, 9, 3), (2, 5, 1)])
def test_every_layer_arrives_byte_identical_on_every_rank(world, num_layers, staging):
    out = _run(world, num_layers, staging)
    assert sorted(out) == list(range(world)), out
    for rank, (status, report) in out.items():
        assert status == "ok", report
        assert report["checked"] == 3 * num_layers
        # Every layer, every step, whole layer: bytes = steps * layers * blocks * page.
        assert report["stats"]["bytes"] == 3 * num_layers * NUM_BLOCKS * PAGE
        assert report["stats"]["broadcast_steps"] == 3
        # Each layer's flight (issue to delivered) includes the time the forward waited for it.
        assert 0 < report["stats"]["wait_seconds"] <= report["stats"]["flight_seconds"]


def test_rank_owning_nothing_still_receives_every_layer():
    out = _run(world=4, num_layers=3)
    assert out[3][0] == "ok", out[3]
    assert out[3][1]["owned"] == []
    assert out[3][1]["checked"] == 9


def test_narrowed_block_ranges_send_only_those_blocks():
    out = _run(world=3, num_layers=5, scenario="narrow")
    for rank, (status, report) in out.items():
        assert status == "ok", report
        assert report["stats"]["bytes"] == 3 * 5 * 3 * PAGE  # 3 of 6 blocks per layer


def test_dead_rank_fails_the_step_on_every_survivor_within_bounded_time():
    """Bounded: both survivors answer (within _run's liveness deadline), with the failed layer, where a wait
    without a timeout would hang and answer nothing."""
    out = _run(world=3, num_layers=6, scenario="die")
    assert sorted(out) == [0, 1], out
    for rank, (status, payload) in out.items():
        assert status == "broadcast_error", payload
        assert "KVPP broadcast of layer" in payload


@pytest.mark.unit
def test_coalesce_merges_contiguous_blocks():
    assert coalesce([5, 1, 2, 3, 9, 2]) == [range(1, 4), range(5, 6), range(9, 10)]
    assert coalesce([]) == []


@pytest.mark.unit
def test_coalesce_bridges_the_smallest_gaps_past_the_range_limit():
    ids = [0, 1, 3, 10, 11, 30, 32]  # gaps of 1 (1->3), 6 (3->10), 18 (11->30), 1 (30->32)
    assert coalesce(ids, max_ranges=3) == [range(0, 4), range(10, 12), range(30, 33)]
    assert coalesce(ids, max_ranges=1) == [range(0, 33)]
    assert len(coalesce(list(range(0, 100, 2)))) == 16, "the default limit"
