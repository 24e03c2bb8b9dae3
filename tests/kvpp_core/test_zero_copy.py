"""Zero-copy KVPP over real processes: segments in /dev/shm, a gloo group for the handshake, the KV backing
allocated the way vLLM does and adopted, foreign views rebound onto their owner's pages.

Each step every rank runs every layer: the KV write (`write`: only the owner's happens), then the read
(`before_read`, then the bytes). Scenarios make one side slow so that a missing flag shows up as wrong
bytes: a slow owner catches a read before the owner's write (and, with the wait skipped, shows that the
check fails when the wait is missing); a slow reader catches a rank entering the next step, where it
overwrites its pages, while a peer still reads this one; a peer zeroing the step's new blocks late (as
vLLM's runner does in every cache it binds, the owner's pages included) catches an owner writing first.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from kvpp_core import shm_broadcast, zero_copy
from tests.helpers.rank_procs import join_group, report_outcome, run_ranks, vllm_like_caches

pytestmark = pytest.mark.integration

BLOCKS = 4
PAGE = 64
STEPS = 3
READER_MARK = 7  # what a reader would write if its write were not skipped


def _token(layer: int, step: int) -> int:
    return 10 + layer * 3 + step * 41


def _rank(rank, world, port, num_layers, scenario, env, results):
    def body():
        layers, layout, placement = join_group(rank, world, port, env, scenario, num_layers, 0, PAGE, BLOCKS)
        shm = shm_broadcast.ShmGroup.negotiate(layers, layout, placement, None, list(range(world)),
                                               torch.device("cpu"), zero_copy.REQUIRED_BY)
        caches = zero_copy.adopt(shm, vllm_like_caches(layers, placement, BLOCKS, PAGE), placement)
        zero_copy.check_bound(shm, caches, placement)  # every foreign view is on its owner's pages
        zc = zero_copy.ZeroCopyLayers(layout, shm, 3.0 if scenario == "stall" else 30.0)
        if scenario == "skip_wait" and rank != 0:
            zc.before_read = zc._seen.add  # the negative control: a reader that reads without waiting
        if scenario == "skip_barrier":
            zc._step_barrier = lambda: None  # the negative control: a rank that starts a step while peers read
        bound = {lid: caches[f"model.layers.{lid}.self_attn.attn"].view(torch.uint8) for lid in range(num_layers)}
        stale = []
        for step in range(STEPS):
            zc.begin_step(True)
            for lid in layout.owned:
                bound[lid][(step - 1) % BLOCKS].zero_()  # the block read last step, freed, reallocated and zeroed
            if scenario == "late_zeroing" and rank != 0:
                time.sleep(0.05)  # vLLM's CPU runner zeroes the step's new blocks in every cache it binds, late here
            if scenario == "late_zeroing":
                for lid in layout.target_layers:
                    bound[lid][step % BLOCKS].zero_()
            for lid in layout.target_layers:
                owner = layout.owner_of(lid)
                if scenario == "die" and step == 1 and rank == owner == world - 1:
                    os._exit(3)
                if scenario == "stall" and step == 1 and rank == owner == world - 1:
                    time.sleep(60)
                if scenario in ("slow_owner", "skip_wait") and rank == owner:
                    time.sleep(0.05)
                value = _token(lid, step) if rank == owner else READER_MARK
                zc.write(lid, lambda lid=lid, value=value: bound[lid][step % BLOCKS].fill_(value))
                zc.before_read(lid)
                reads = [bound[lid][step % BLOCKS].clone()]
                if scenario in ("slow_reader", "skip_barrier") and rank != owner:
                    time.sleep(0.05)  # attention still reading while the owner could start the next step
                    reads.append(bound[lid][step % BLOCKS].clone())
                if any(not torch.all(r == _token(lid, step)) for r in reads):
                    stale.append((step, lid))
            zc.end_step()
        results.put((rank, "ok", {"stale": stale, "stats": zc.stats.as_dict(), "owned": list(layout.owned)}))
        dist.barrier()
        dist.destroy_process_group()

    report_outcome(rank, results, body)


def _run(world, num_layers, scenario="plain", env=None, expect=None, timeout=90.0):
    return run_ranks(_rank, world, (num_layers, scenario, env or {}), expect, timeout)


def _assert_exact(out, world, num_layers):
    assert sorted(out) == list(range(world)), out
    for status, report in out.values():
        assert status == "ok", report
        assert report["stale"] == []
        foreign = num_layers - len(report["owned"])
        stats = report["stats"]
        assert stats["bytes"] == 0, "zero-copy copies nothing"
        assert stats["reads"] == STEPS * foreign and stats["writes_skipped"] == STEPS * foreign
        assert stats["forward_steps"] == STEPS
        assert stats["waits"] <= stats["reads"] and (stats["waits"] > 0) == (stats["wait_seconds"] > 0)


@pytest.mark.parametrize("world,num_layers", [(2, 6), (3, 7)])
def test_readers_see_the_owners_writes_in_place(world, num_layers):
    out, _ = _run(world, num_layers)
    _assert_exact(out, world, num_layers)


@pytest.mark.parametrize("scenario", ["slow_owner", "slow_reader", "late_zeroing"])
def test_no_read_before_the_owner_wrote_and_no_step_while_a_peer_reads(scenario):
    out, _ = _run(3, 6, scenario)
    _assert_exact(out, 3, 6)
    if scenario == "slow_owner":  # reads reach their layer while its owner sleeps before writing: they wait
        assert sum(report["stats"]["waits"] for _, report in out.values()) > 0


def test_negative_control_a_reader_that_skips_the_wait_reads_stale_pages():
    out, _ = _run(2, 4, "skip_wait")
    status, report = out[1]
    assert status == "ok", report
    assert report["stale"], "without the wait the reader must have read before the slow owner's write"


def test_negative_control_without_the_step_barrier_a_slow_reader_sees_the_next_step_zero_its_block():
    out, _ = _run(3, 6, "skip_barrier")
    assert {status for status, _ in out.values()} == {"ok"}, out
    assert any(report["stale"] for _, report in out.values())


def test_dead_owner_fails_the_readers_step_naming_layer_and_ranks():
    out, elapsed = _run(3, 6, "die", expect=2)
    assert sorted(out) == [0, 1], (out, elapsed)
    assert {status for status, _ in out.values()} == {"broadcast_error"}, out
    # Noticed from the owner's pid, not by the 30 s read timeout (whose message is "no write within 30 s").
    assert any("zero-copy read of layer 4 (owner kvpp rank 2)" in p and "(pid" in p and "has exited" in p
               for _, p in out.values()), out


def test_stalled_owner_fails_the_step_after_the_timeout():
    out, elapsed = _run(2, 4, "stall", expect=1)
    assert sorted(out) == [0], (out, elapsed)  # it answered within the liveness deadline: no hang
    status, payload = out[0]
    # The configured 3 s bound is what failed it (the message names it), whatever the host's load.
    assert status == "broadcast_error" and "waiting for kvpp rank 1: no write within 3 s" in payload, payload


def test_ranks_that_cannot_share_pages_refuse_zero_copy(tmp_path):
    out, _ = _run(2, 4, "other_host", env={"KVPP_TEST_OTHER_SHM": str(tmp_path)})
    assert {status for status, _ in out.values()} == {"config_error"}, out
    message = "".join(p for _, p in out.values())
    assert "kvpp_staging_buffers is 0 (zero-copy)" in message and "set kvpp_staging_buffers to 2" in message
    forced, _ = _run(2, 4, env={"KVPP_BROADCAST_TRANSPORT": "collective"})
    assert {status for status, _ in forced.values()} == {"config_error"}, forced
