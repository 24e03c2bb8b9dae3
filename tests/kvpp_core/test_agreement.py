"""What a group's ranks agree on at start (kvpp_core/agreement.py), over real processes and a gloo group: every rank
reaches the same mode from the same gathered facts, or every rank refuses with the same message.

Each rank resolves the mode of a TP2 (or TP3) launch of DeepSeek-V2-Lite on this CPU host with a KV budget of its own,
as an engine's worker does in determine_available_memory. /dev/shm is this host's; "other_host" gives the last rank a
directory of another file system instead (KVPP's segments go there), as on another host or in another container."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpp_core.shm_broadcast import shm_space
from tests.helpers.rank_procs import report_outcome, run_ranks

pytestmark = pytest.mark.integration

MIB = 1 << 20
SMALL_BUDGET = 8 * MIB
"""Zero-copy's backing for this budget fits any /dev/shm a CPU host serves from (2 x 9 MiB here: 24 GiB free)."""


def _rank(rank, world, port, scenario, staging, budget, env, results):
    def body():
        import torch.distributed as dist

        from kvpp_core import agreement, shm_broadcast
        from kvpp_core.allocation import CacheLayer
        from kvpp_core.config import KvppConfig
        from kvpp_core.model import PRESETS
        from kvpp_core.setup import KvppSetup
        from kvpp_core.topology import Topology

        os.environ.update(env.get(rank, {}), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        if scenario == "other_host" and rank == world - 1:
            shm_broadcast.SHM_DIR = Path(os.environ["KVPP_TEST_OTHER_SHM"])
        model = PRESETS["deepseek-v2-lite"]
        setup = KvppSetup(model, Topology(tp=world), enforce_eager=True,
                          kvpp=KvppConfig(enabled=True, staging_buffers=staging), device="cpu", machine="x86_64")
        layers = [CacheLayer(f"model.layers.{i}.self_attn.attn", model.page_bytes(16), i)
                  for i in range(model.num_layers)]
        mode = agreement.agree(setup, layers, rank, budget, None)
        results.put((rank, "ok", str(mode)))
        dist.destroy_process_group()

    report_outcome(rank, results, body)


def _run(world=2, scenario="plain", staging=None, budget=SMALL_BUDGET, env=None):
    """{rank: (status, mode or message)} of every rank; `env`: per rank, what it adds to its environment."""
    out, elapsed = run_ranks(_rank, world, (scenario, staging, budget, env or {}))
    assert sorted(out) == list(range(world)), f"only ranks {sorted(out)} answered within {elapsed:.0f} s: {out}"
    return out


def _one(out) -> tuple[str, str]:
    """The one outcome every rank reached."""
    outcomes = set(out.values())
    assert len(outcomes) == 1, out
    return next(iter(outcomes))


def test_ranks_sharing_a_roomy_dev_shm_run_zero_copy():
    status, mode = _one(_run())
    assert status == "ok" and mode.startswith("zero-copy (kvpp_staging_buffers 0): the default where"), mode


def test_a_layer_setting_on_one_rank_only_is_refused_on_every_rank_naming_the_rank_and_value():
    status, message = _one(_run(3, env={1: {"KVPP_BROADCAST_WHOLE_CACHE": "1"}}))
    assert status == "config_error" and message.startswith(
        "KVPP_BROADCAST_WHOLE_CACHE is 1 on rank 1 but 0 on rank 0: it changes how a layer moves"), message
    status, message = _one(_run(env={1: {"KVPP_BROADCAST_TRANSPORT": "collective"}}, staging=2))
    assert status == "config_error" and message.startswith(
        "KVPP_BROADCAST_TRANSPORT is collective on rank 1 but auto on rank 0"), message


def test_ranks_that_do_not_share_dev_shm_run_staging_and_naming_zero_copy_is_refused(tmp_path):
    env = {1: {"KVPP_TEST_OTHER_SHM": str(tmp_path)}}
    status, mode = _one(_run(scenario="other_host", env=env))
    assert status == "ok" and mode.startswith("staging (kvpp_staging_buffers 2): the default here, since zero-copy "
                                              "cannot run: it reads a peer's KV pages in place"), mode
    assert "rank 1 " in mode and "does not share rank 0's" in mode
    status, message = _one(_run(scenario="other_host", env=env, staging=0))
    assert status == "config_error" and message.startswith("additional_config.kvpp_staging_buffers: 0 (zero-copy): "
                                                           "it reads a peer's KV pages in place"), message


def test_a_dev_shm_that_cannot_hold_the_backing_runs_staging_and_naming_zero_copy_is_refused_naming_the_size():
    """Each rank's budget is all of /dev/shm's free space: one rank's backing might fit, two cannot."""
    free, _ = shm_space()
    status, mode = _one(_run(budget=free))
    assert status == "ok" and mode.startswith("staging (kvpp_staging_buffers 2): the default here, since zero-copy "
                                              "cannot run: it keeps the KV backing in /dev/shm, and the 2 rank(s) on "), mode
    status, message = _one(_run(budget=free, staging=0))
    assert status == "config_error" and "/dev/shm has " in message and "give /dev/shm at least " in message, message
    assert "--shm-size" in message and message.endswith("or set kvpp_staging_buffers to 2 (staging buffers, any "
                                                        "device and host layout)")
    status, mode = _one(_run(budget=free, staging=2))  # staging named: nothing to check
    assert (status, mode) == ("ok", "staging (kvpp_staging_buffers 2): named by the launch's kvpp_staging_buffers")
