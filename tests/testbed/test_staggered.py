"""testbed/staggered.py's comparison of two runs, without an engine."""

import pytest

from testbed.staggered import logprob_agreement

pytestmark = pytest.mark.unit


def test_logprob_agreement_counts_bit_identical_values_and_the_largest_gap():
    ref = {"outputs": {"0": {"logprobs": [-0.5, -1.25, -2.0]}, "1": {"logprobs": [-0.1]}}}
    got = {"outputs": {"0": {"logprobs": [-0.5, -1.25 + 2e-6, -2.0]}, "1": {"logprobs": [-0.1 - 3e-6]}}}
    agreement = logprob_agreement(ref, got)
    assert agreement["bit_identical"] == 2 and agreement["total"] == 4
    assert agreement["max_abs_diff"] == pytest.approx(3e-6)
    assert logprob_agreement(ref, ref) == {"bit_identical": 4, "total": 4, "max_abs_diff": 0.0}
