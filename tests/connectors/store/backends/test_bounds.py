"""CallBounds: the floor for a call that moves nothing, the ceiling until a rate is known, then the floor plus slack
times what the bytes take at the measured rate, never past the ceiling; and how much one put or get moves."""

from __future__ import annotations

import pytest

from connectors.store.backends.bounds import FIRST_CALL_BYTES, WINDOW, CallBounds, CallPolicy

pytestmark = pytest.mark.unit

MB = 1_000_000


def test_a_call_that_moves_nothing_gets_the_floor_and_a_data_call_the_ceiling_until_a_rate_is_known():
    bounds = CallBounds(CallPolicy(0.5, 3.0, slack=4.0))
    assert bounds.timeout_s(0) == 0.5
    assert bounds.timeout_s(100 * MB) == 3.0
    assert bounds.call_bytes() == FIRST_CALL_BYTES


def test_a_data_calls_bound_follows_its_bytes_at_the_measured_rate_within_floor_and_ceiling():
    bounds = CallBounds(CallPolicy(0.5, 3.0, slack=4.0))
    bounds.record(100 * MB, 0.1)  # 1 GB/s
    assert bounds.timeout_s(10 * MB) == pytest.approx(0.5 + 4 * 0.01)
    assert bounds.timeout_s(1000 * MB) == 3.0, "capped at the ceiling"
    assert bounds.call_bytes() == 750 * MB, "what takes a quarter (1 / slack) of the ceiling at 1 GB/s"
    assert bounds.timeout_s(bounds.call_bytes()) == 3.0, "a full call expects 0.75 s in its 3 s"


def test_the_rate_is_the_recent_calls_taken_together():
    bounds = CallBounds(CallPolicy(0.5, 3.0))
    bounds.record(10 * MB, 1.0)
    bounds.record(30 * MB, 1.0)
    assert bounds.rate() == 20 * MB
    for _ in range(WINDOW):
        bounds.record(100 * MB, 1.0)
    assert bounds.rate() == 100 * MB, "older calls drop out of the window"


def test_a_fixed_policy_bounds_every_call_alike():
    bounds = CallBounds(CallPolicy.fixed(20.0))
    bounds.record(100 * MB, 1.0)
    assert bounds.timeout_s(0) == bounds.timeout_s(10 * MB) == bounds.timeout_s(10_000 * MB) == 20.0


def test_a_failure_makes_the_rate_unknown_again():
    """The link may first have to reconnect (about 1 s to a segment holder that stalled): the first data call after
    a failure gets the ceiling, not a bound from the rate before it."""
    bounds = CallBounds(CallPolicy(0.5, 3.0))
    bounds.record(100 * MB, 0.1)
    bounds.forget()
    assert bounds.rate() is None and bounds.timeout_s(10 * MB) == 3.0
