"""The shared-memory layer broadcast over real processes: segments in /dev/shm, a gloo group for the
handshake, the KV backing allocated the way vLLM does (one zeroed buffer carved into views) and adopted.

Each scenario makes one side slow on purpose, so that a missing flag would show up as wrong bytes:
a slow owner catches a receiver that reads before the owner's step writes are in place, a slow
receiver catches an owner that writes new tokens over a layer still being copied.
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch
import torch.distributed as dist

from kvpp_core import shm_broadcast
from kvpp_core.config import KvppConfigError
from tests.helpers.rank_procs import join_group, report_outcome, run_ranks, vllm_like_caches

pytestmark = pytest.mark.integration

BLOCKS = 24
PAGE = 16 << 10  # bytes per block and cache: an MLA block's order of size (16 tokens x 576 bf16 values: 18 KiB)
REFERENCED = {"narrow": [20, 1, 2, 1], "scattered": list(range(0, 24, 2))}
"""A step's block ids (unsorted, one repeated): narrow, 3 blocks in 2 runs, copied run by run; scattered, 12 runs of
one block each, where 12 copies cost more than copying the whole layer once."""
STEPS = 3
NEW_TOKEN = 255


@functools.cache
def _expected(layer: int, step: int) -> torch.Tensor:
    """The owner's history of `layer` at `step`: distinct per layer, block and step."""
    base = torch.arange(BLOCKS * PAGE, dtype=torch.int64).reshape(BLOCKS, PAGE)
    return ((base * 13 + layer * 37 + step * 89) % 251).to(torch.uint8)


def _rank(rank, world, port, num_layers, staging, scenario, env, results):
    def body():
        layers, layout, placement = join_group(rank, world, port, env, scenario, num_layers, staging, PAGE, BLOCKS)
        shm = shm_broadcast.ShmGroup.negotiate(layers, layout, placement, None, list(range(world)),
                                               torch.device("cpu"))
        if shm is None:
            results.put((rank, "collective", None))
            return
        leftovers = sorted(p.name for p in shm_broadcast.SHM_DIR.glob(f"{shm.name}*"))
        caches = shm.adopt(vllm_like_caches(layers, placement, BLOCKS, PAGE))
        flat = torch.empty(0, dtype=torch.uint8).set_(next(iter(caches.values())).untyped_storage())
        timeout = 3.0 if scenario == "stall" else 30.0
        bc = shm.broadcaster(flat, timeout)
        bound = {lid: caches[f"model.layers.{lid}.self_attn.attn"].view(torch.uint8) for lid in range(num_layers)}
        checked = 0
        for step in range(STEPS):
            if scenario == "slow_owner" and rank == 0:
                time.sleep(0.1)  # the first layers' owner is late with its writes; its peers are not
            for lid in layout.owned:
                bound[lid].copy_(_expected(lid, step))  # the previous step's and the pool's writes
            ids = REFERENCED.get(scenario)
            if ids:
                for lid in layout.foreign:
                    bound[lid].zero_()
            bc.begin_step(True, ids if step % 2 == 0 or ids is None else (lambda: ids))
            for lid in layout.target_layers:
                if scenario == "die" and step == 1 and rank == world - 1 and lid == layout.target_layers[-1]:
                    os._exit(3)
                if scenario == "stall" and step == 1 and rank == world - 1 and lid == layout.target_layers[-1]:
                    time.sleep(60)
                if scenario == "slow_receiver" and lid not in layout.owned:
                    time.sleep(0.03)
                bc.before_layer(lid)
                want = _expected(lid, step)
                if scenario == "narrow" and lid not in layout.owned:
                    sent = torch.zeros(BLOCKS, dtype=torch.bool)
                    sent[ids] = True
                    want = torch.where(sent[:, None], want, torch.zeros_like(want))
                assert torch.equal(bound[lid], want), f"rank {rank} step {step} layer {lid} differs"
                checked += 1
                bound[lid][1, :8] = NEW_TOKEN  # the attention writes this step's tokens into block 1
            bc.end_step()
        results.put((rank, "ok", {"checked": checked, "stats": bc.stats.as_dict(), "leftovers": leftovers,
                                  "owned": list(layout.owned)}))
        dist.barrier()
        dist.destroy_process_group()

    report_outcome(rank, results, body)


def _run(world, num_layers, staging=2, scenario="plain", env=None, expect=None, timeout=90.0):
    return run_ranks(_rank, world, (num_layers, staging, scenario, env or {}), expect, timeout)


def _assert_delivered(out, world, num_layers, blocks_per_layer=BLOCKS):
    assert sorted(out) == list(range(world)), out
    for rank, (status, report) in out.items():
        assert status == "ok", report
        assert report["checked"] == STEPS * num_layers
        foreign = num_layers - len(report["owned"])
        assert report["stats"]["bytes"] == STEPS * foreign * blocks_per_layer * PAGE
        assert report["stats"]["whole_layers"] == (STEPS * foreign if blocks_per_layer == BLOCKS else 0)
        assert report["stats"]["layers"] == STEPS * num_layers
        assert 0 < report["stats"]["flight_seconds"] and report["stats"]["wait_seconds"] <= report["stats"]["flight_seconds"]
        assert report["leftovers"] == [], "segments must be unlinked once every rank mapped them"


# (2, 3, 2): rank 0 has one foreign layer, so one staging slot, rank 1 two: segments of unequal layout.
@pytest.mark.parametrize("world,num_layers,staging", [(2, 16, 2), (3, 7, 2), (4, 9, 3), (2, 5, 1), (2, 3, 2)])
def test_every_layer_arrives_byte_identical(world, num_layers, staging):
    out, _ = _run(world, num_layers, staging)
    _assert_delivered(out, world, num_layers)


@pytest.mark.parametrize("scenario", ["slow_owner", "slow_receiver"])
def test_no_read_before_the_owner_is_ready_and_no_write_while_a_peer_copies(scenario):
    out, _ = _run(3, 6, 2, scenario)
    _assert_delivered(out, 3, 6)


def test_a_step_copies_exactly_its_referenced_blocks():
    """3 of 24 blocks referenced: each foreign layer copies those 3 and no other (the staging slot is zeroed before
    every step, and every block left out must stay zero)."""
    out, _ = _run(3, 5, scenario="narrow")
    _assert_delivered(out, 3, 5, blocks_per_layer=3)


def test_a_step_whose_blocks_lie_in_many_runs_copies_the_whole_layer():
    out, _ = _run(3, 5, scenario="scattered")
    _assert_delivered(out, 3, 5)


def test_dead_rank_fails_the_step_on_every_survivor_at_once():
    out, elapsed = _run(3, 6, scenario="die", expect=2)
    assert sorted(out) == [0, 1], (out, elapsed)
    for status, payload in out.values():
        assert status == "broadcast_error", payload
        assert "broadcast of layer" in payload
    # The first survivor to notice names the dead rank; the other may learn it from that one's abort. A dead
    # peer is noticed from its pid (this message), not by the 30 s timeout ("no ... within 30 s").
    assert any("kvpp rank 2 (pid" in payload and "has exited" in payload for _, payload in out.values()), out


def test_stalled_rank_fails_the_step_after_the_timeout():
    out, elapsed = _run(3, 6, scenario="stall", expect=2)
    assert sorted(out) == [0, 1], (out, elapsed)  # both answered within the liveness deadline: no hang
    for status, payload in out.values():
        assert status == "broadcast_error", payload
    # The configured 3 s bound is what failed them (the message names it), whatever the host's load.
    assert any("waiting for kvpp rank 2: no" in payload and "within 3 s" in payload for _, payload in out.values())


def test_ranks_without_a_common_shm_fall_back_to_the_collective(tmp_path):
    env = {"KVPP_TEST_OTHER_SHM": str(tmp_path)}
    out, _ = _run(2, 4, scenario="other_host", env=env)
    assert {status for status, _ in out.values()} == {"collective"}, out
    assert list(tmp_path.iterdir()) == [], "the rank that created its segments elsewhere removed them"
    forced, _ = _run(2, 4, scenario="other_host", env=dict(env, KVPP_BROADCAST_TRANSPORT="shm"))
    assert {status for status, _ in forced.values()} == {"config_error"}, forced
    assert "cannot map its peers' segments" in "".join(p for _, p in forced.values())


def test_collective_override_skips_shared_memory():
    out, _ = _run(2, 4, env={"KVPP_BROADCAST_TRANSPORT": "collective"})
    assert {status for status, _ in out.values()} == {"collective"}, out


@pytest.mark.unit
def test_unknown_transport_is_refused(monkeypatch):
    monkeypatch.setenv("KVPP_BROADCAST_TRANSPORT", "tcp")
    with pytest.raises(KvppConfigError, match="KVPP_BROADCAST_TRANSPORT.*auto, shm, collective"):
        shm_broadcast.transport_choice()
