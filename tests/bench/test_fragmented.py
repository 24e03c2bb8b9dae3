"""The fragmented-cache bench's arithmetic without an engine: the churn it builds around the probe, and ratios taken
within a round."""

import pytest

from bench.fragmented import PASSES, summarise, workload

pytestmark = pytest.mark.unit


def test_the_churn_hands_out_every_block_and_the_probe_is_the_batch():
    job = workload("/nonexistent", block=16, blocks_most=260, batch=3, context_blocks=4, decode=6,
                   draw=lambda model, lengths, seed: [[seed] * n for n in lengths])
    assert [len(p) for p in job.probe] == [64] * 3 and job.max_tokens == 6 and job.prompts == []
    assert len(job.churn) == 44 and all(len(p) == 16 for p in job.churn)  # ceil(260 / 6) one-block prompts
    # each grows by five blocks (less 1-5 tokens): six blocks apiece, 264 >= 260, finishing in five groups
    assert sorted(set(job.churn_max_tokens)) == [75, 76, 77, 78, 79]
    assert all(-(-(16 + t) // 16) == 6 for t in job.churn_max_tokens)


def _round(off_step: float, staging_step: float, fresh_bytes: float, churned_bytes: float) -> dict:
    def mode(step: float, fresh: float, churned: float, answers: list[int]) -> dict:
        return {"num_blocks": 100, **{name: {"decode_step_s": step, "bytes_per_decode_step": b, "whole_layers": 0,
                                             "answers": {"0": answers}} for name, b in zip(PASSES, (fresh, churned))}}

    return {"off": mode(off_step, 0.0, 0.0, [1, 2]), "staging": mode(staging_step, fresh_bytes, churned_bytes, [1, 2])}


def test_ratios_are_taken_within_a_round_and_answers_counted_against_offs():
    rounds = [_round(1.0, 1.1, 100.0, 100.0), _round(2.0, 2.4, 100.0, 300.0), _round(0.5, 0.5, 100.0, 200.0)]
    rounds[2]["staging"]["churned"]["answers"] = {"0": [1, 3]}
    summary = summarise(rounds, ["off", "staging"])
    over_off = summary["staging"]["fresh"]["decode_step_over_off"]
    assert (over_off["min"], over_off["median"], over_off["max"]) == pytest.approx((1.0, 1.1, 1.2))
    churned = summary["staging"]["churned_bytes_over_fresh"]
    assert (churned["min"], churned["median"], churned["max"]) == pytest.approx((1.0, 2.0, 3.0))
    assert summary["staging"]["fresh"]["answers_equal_off"] == 3
    assert summary["staging"]["churned"]["answers_equal_off"] == 2
    assert "decode_step_over_off" not in summary["off"]["fresh"]
