"""testbed/staggered.py's comparison of two runs and its workload's checks, without an engine."""

import math

import msgspec
import pytest

from testbed.staggered import Staggered, assert_bit_identical, logprob_agreement

pytestmark = pytest.mark.unit


def test_logprob_agreement_counts_bit_identical_values_and_the_largest_gap():
    ref = {"outputs": {"0": {"logprobs": [-0.5, -1.25, -2.0]}, "1": {"logprobs": [-0.1]}}}
    got = {"outputs": {"0": {"logprobs": [-0.5, -1.25 + 2e-6, -2.0]}, "1": {"logprobs": [-0.1 - 3e-6]}}}
    agreement = logprob_agreement(ref, got)
    assert agreement["bit_identical"] == 2 and agreement["total"] == 4
    assert agreement["max_abs_diff"] == pytest.approx(3e-6)
    assert logprob_agreement(ref, ref) == {"bit_identical": 4, "total": 4, "max_abs_diff": 0.0}


def test_bit_identical_refuses_one_logprob_one_ulp_off_and_runs_without_logprobs():
    ref = {"outputs": {"0": {"logprobs": [-0.5, -1.25]}, "1": {"logprobs": [-0.1]}}}
    assert assert_bit_identical(ref, ref) == {"bit_identical": 3, "total": 3, "max_abs_diff": 0.0}
    off = {"outputs": {**ref["outputs"], "1": {"logprobs": [math.nextafter(-0.1, 0.0)]}}}
    with pytest.raises(AssertionError, match="'bit_identical': 2"):
        assert_bit_identical(ref, off)
    with pytest.raises(AssertionError, match="'total': 0"):
        assert_bit_identical({"outputs": {}}, {"outputs": {}})


def test_a_churn_needs_one_max_tokens_per_prompt_and_a_probe():
    with pytest.raises(msgspec.ValidationError, match="churn_max_tokens: one per churn prompt, got 1 for 2"):
        msgspec.convert({"prompts": [], "probe": [[1]], "churn": [[2], [3]], "churn_max_tokens": [4]}, Staggered)
    with pytest.raises(ValueError, match="needs probe prompts"):
        Staggered([], churn=[[2]], churn_max_tokens=[4])
    assert Staggered([], probe=[[1]], churn=[[2]], churn_max_tokens=[4]).churn_max_tokens == [4]
