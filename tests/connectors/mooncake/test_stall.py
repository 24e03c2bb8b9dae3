"""When a decode gives a pull up: the stall bound's arithmetic (connectors/mooncake/stall.py)."""

from __future__ import annotations

import math

import pytest

from connectors.mooncake.stall import EWMA_WEIGHT, INITIAL_RATE, SLACK, LinkRate, PrefillProgress, StallWatch

pytestmark = pytest.mark.unit


def test_the_link_rate_is_conservative_until_measured_then_an_ewma_of_successful_pulls():
    rate = LinkRate()
    assert rate.bytes_per_s == INITIAL_RATE
    rate.record(0, 1.0)
    rate.record(1000, 0.0)  # nothing measured: no change
    assert rate.bytes_per_s == INITIAL_RATE
    rate.record(2_000_000_000, 1.0)  # the first measurement replaces the assumption
    assert rate.bytes_per_s == 2e9
    rate.record(1_000_000_000, 1.0)
    assert rate.bytes_per_s == pytest.approx((1 - EWMA_WEIGHT) * 2e9 + EWMA_WEIGHT * 1e9)


def test_a_pull_s_deadline_is_its_bound_after_the_later_of_its_submission_and_its_prefill_s_last_progress():
    rate, progress = LinkRate(initial=1e9), PrefillProgress()
    assert progress.last == -math.inf
    watch = StallWatch(2.0, rate, progress, since=100.0)
    assert watch.deadline() == 102.0
    assert not watch.expired(101.9) and watch.expired(102.0)
    # Bytes in flight add their time at the slackened rate: 1 GB at 1 GB/s, SLACK times over.
    assert watch.deadline(in_flight_bytes=1_000_000_000) == pytest.approx(102.0 + SLACK)
    # A read from the same prefill landing (this pull's or another's) moves the clock; it never goes back.
    other = StallWatch(2.0, rate, progress, since=90.0)
    other.progressed(105.0)
    other.progressed(104.0)
    assert progress.last == 105.0 and watch.deadline() == 107.0 and other.deadline() == 107.0
    # A pull submitted after the prefill last progressed counts from its submission.
    late = StallWatch(2.0, rate, progress, since=110.0)
    assert late.deadline() == 112.0


def test_a_pull_queued_behind_a_stalled_prefill_is_expired_when_its_turn_comes():
    progress = PrefillProgress()
    progress.saw(50.0)  # the prefill's last read landed at 50 s, then it stalled
    queued = StallWatch(2.0, LinkRate(), progress, since=50.5)  # queued while the first pull hangs
    assert queued.expired(54.0)  # its turn came after the first pull's bound and drain: given up at once


def test_a_stall_bound_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        StallWatch(0.0, LinkRate(), PrefillProgress(), since=0.0)
