"""PoolBackoff (the breaker) on a clock the test moves: every call refused while it is open, the prober's ticket only
once a period passed and one at a time, periods doubling up to the longest, outcomes of calls admitted before a
failure ignored, recovery, openings counted, and a pool that keeps failing asked at most once per longest period."""

from __future__ import annotations

import pytest

from connectors.store.backends.backoff import PoolBackoff
from tests.helpers.clock import Clock

pytestmark = pytest.mark.unit


@pytest.fixture
def pool():
    clock = Clock()
    return PoolBackoff(1.0, 8.0, clock=clock), clock


def test_failures_in_a_row_double_the_period_up_to_the_longest(pool):
    backoff, clock = pool
    backoff.failed(backoff.admit(), "test")
    periods = []
    for _ in range(6):
        start = clock.now
        while (probe := backoff.probe()) is None:
            assert backoff.admit() is None, "every call is refused while the breaker is open"
            clock.now += 0.01
        periods.append(round(clock.now - start, 1))
        assert probe.probe and backoff.probe() is None and backoff.admit() is None, "one probe at a time"
        backoff.failed(probe, "still down")
    assert periods == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert backoff.opens == 1


def test_a_probe_the_pool_answers_lets_calls_through(pool):
    backoff, clock = pool
    backoff.failed(backoff.admit(), "test")
    assert backoff.retry_in() == pytest.approx(1.0)
    assert backoff.probe() is None, "not before the period passed"
    clock.now += 1.0
    probe = backoff.probe()
    backoff.answered(probe)
    assert backoff.retry_in() == 0.0 and backoff.probe() is None, "closed: nothing to probe"
    tickets = [backoff.admit() for _ in range(3)]
    assert all(t is not None and not t.probe for t in tickets)


def test_calls_admitted_before_the_failure_neither_lengthen_nor_end_the_backoff(pool):
    backoff, clock = pool
    in_flight = [backoff.admit() for _ in range(3)]
    backoff.failed(in_flight[0], "the master died")
    backoff.failed(in_flight[1], "the same death, seen by a call already running")
    assert backoff.retry_in() == pytest.approx(1.0), "one failure, not two"
    backoff.answered(in_flight[2])
    assert backoff.admit() is None, "a call that happened to succeed does not end it"


def test_a_pool_that_fails_again_soon_after_answering_is_backed_off_longer(pool):
    """No flapping at the first period: a failure within the longest period of calls going through again continues
    the doubling."""
    backoff, clock = pool
    backoff.failed(backoff.admit(), "test")
    clock.now += 1.0
    backoff.answered(backoff.probe())
    clock.now += 5.0  # answered for 5 s, less than the longest period (8 s)
    backoff.failed(backoff.admit(), "again")
    assert backoff.retry_in() == pytest.approx(2.0)
    assert backoff.opens == 2


def test_a_pool_that_answered_for_the_longest_period_starts_again_from_the_first(pool):
    backoff, clock = pool
    backoff.failed(backoff.admit(), "down")
    for _ in range(3):
        clock.now += backoff.retry_in()
        backoff.failed(backoff.probe(), "down")
    clock.now += backoff.retry_in()
    backoff.answered(backoff.probe())
    clock.now += 8.0
    backoff.failed(backoff.admit(), "a new failure")
    assert backoff.retry_in() == pytest.approx(1.0)


def test_a_pool_that_fails_every_other_call_is_asked_at_most_once_per_longest_period(pool):
    """It cannot flap forever: each probe is answered, and the first call after it fails. Over ten simulated minutes
    the calls that reach the failing pool (and cost a request their bound) settle to one per longest period."""
    backoff, clock = pool
    failures, end = 0, clock.now + 600
    while clock.now < end:
        probe = backoff.probe()
        if probe is not None:
            backoff.answered(probe)
        ticket = backoff.admit()
        if ticket is not None:
            backoff.failed(ticket, "flaky")
            failures += 1
        clock.now += 0.05
    assert failures <= 600 / 8 + 4, failures  # 1 + 2 + 4 s, then every 8 s
    assert failures >= 600 / 8 - 4, "and it keeps asking: a pool that comes back is used again"
