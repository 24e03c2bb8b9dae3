"""Bounded backend calls: a stalled call costs its bound once, then calls fail fast until it returns, and whoever gave
it buffers learns when it can no longer touch them; a client that found the pool failing opens its breaker and
refuses every call at once, its prober (never a request's call) asks again with an existence check once the
backoff ended, and calls go on once the pool answers. Narrow fakes of the native store; the real one is in
test_mooncake.py."""

from __future__ import annotations

import threading
import time

import pytest

from connectors.store.backends.backoff import PoolBackoff
from connectors.store.backends.base import PROBE_KEY, BoundedCalls, BoundedClient, Status
from connectors.store.backends.bounds import CallBounds, CallPolicy
from tests.helpers.clock import Clock

pytestmark = pytest.mark.unit


def test_a_stalled_call_returns_within_its_bound_and_fails_fast_after():
    calls = BoundedCalls(CallBounds(CallPolicy.fixed(1.0)), max_stuck=1)
    release = threading.Event()
    start = time.monotonic()
    assert calls.run(lambda: [Status.OK] if release.wait(30) else [], 1) == [Status.TIMEOUT]
    # Liveness: the 1 s bound with 9 s for a loaded host, where the call itself would take 30 s.
    assert time.monotonic() - start < 10, "bounded by the bound, not by the call's 30 s"
    (late,) = calls.late()
    assert not late.done(), "the timed-out call is still running and is listed until it returns"
    ran = []
    assert calls.run(lambda: ran.append(1) or [Status.OK], 1) == [Status.TIMEOUT], "fail fast"
    assert ran == [], "failed fast: the call was not even started, so nothing waited for the 1 s bound"
    release.set()
    assert late.result(timeout=10)[0] == [Status.OK]
    deadline = time.monotonic() + 10  # the done-callback that unlists it runs just after the result is set
    while calls.late() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls.late() == []
    assert calls.run(lambda: [Status.OK], 1) == [Status.OK], "recovers once the call returns"
    assert calls.run(lambda: [1 / 0], 2) == [Status.FAILED] * 2, "a client that raised failed, it did not crash"
    assert calls.run(lambda: [Status.OK], 2) == [Status.FAILED] * 2, "an answer for fewer keys than asked is none"
    calls.close()


def test_only_data_calls_that_moved_every_byte_measure_the_rate():
    bounds = CallBounds(CallPolicy(0.5, 3.0))
    calls = BoundedCalls(bounds)
    assert calls.run(lambda: [Status.OK], 1) == [Status.OK] and bounds.rate() is None, "an existence check moves nothing"
    calls.run(lambda: [Status.OK, Status.FAILED], 2, nbytes=1 << 20)
    assert bounds.rate() is None, "a partly failed put says nothing of the link"
    calls.run(lambda: time.sleep(0.01) or [Status.OK], 1, nbytes=1 << 20)
    assert 0 < bounds.rate() <= (1 << 20) / 0.01
    calls.close()


class _Store:
    """The native calls a BoundedClient makes, answering what the test sets, counting each call by name."""

    def __init__(self):
        self.calls: list[str] = []
        self.exist = [1]
        self.data = Status.OK
        self.stall = threading.Event()
        self.stall.set()

    def batch_is_exist(self, keys):
        self.calls.append("probe" if keys == [PROBE_KEY] else "exists")
        self.stall.wait(30)
        return (self.exist * len(keys))[:len(keys)]

    def data_call(self, keys):
        self.calls.append("data")
        self.stall.wait(30)
        return [self.data] * len(keys)

    def close(self):
        pass


class _Client(BoundedClient):
    """A BoundedClient over `_Store`, with a clock the test moves. Its puts and gets move 1 MiB per key."""

    def __init__(self, clock):
        self._store = _Store()
        self._guard(CallPolicy(0.2, 0.5, backoff_s=1.0, backoff_max_s=8.0), prober=False)  # the test probes
        self._backoff = PoolBackoff(1.0, 8.0, clock=clock)

    def data(self, keys, settled=None):
        return self._bounded(lambda: self._store.data_call(keys), keys, len(keys) << 20, settled)


@pytest.fixture
def client():
    clock = Clock()
    c = _Client(clock)
    yield c, c._store, clock
    c._store.stall.set()
    c.close()


def test_a_pool_that_did_not_answer_is_asked_again_only_by_the_prober(client):
    c, store, clock = client
    store.exist = [-1]  # the master cannot be reached
    assert c.exists(["a", "b"]) == [Status.FAILED] * 2
    assert c.breaker_opens() == 1
    store.exist = [1]
    store.calls.clear()
    assert c.exists(["a"]) == [Status.REFUSED] and c.data(["a"]) == [Status.REFUSED]
    assert not c.probe_if_due(), "the backoff has not passed"
    clock.now += 1.01
    assert c.exists(["a"]) == [Status.REFUSED] and c.data(["a"]) == [Status.REFUSED], "no request's call probes"
    assert store.calls == [], "refused calls never reach the store"
    assert c.probe_if_due() and store.calls == ["probe"], "the prober asks, about a key no object has"
    assert c.data(["a", "b"]) == [Status.OK] * 2 and c.exists(["a"]) == [Status.OK]
    assert store.calls == ["probe", "data", "exists"] and c.breaker_opens() == 1


def test_a_probe_the_pool_does_not_answer_doubles_the_backoff(client):
    c, store, clock = client
    store.exist = [-1]
    c.exists(["a"])
    clock.now += 1.01
    assert c.probe_if_due() and c.data(["a"]) == [Status.REFUSED], "the probe failed: calls are still refused"
    clock.now += 1.01
    assert not c.probe_if_due(), "the second failure in a row doubled the backoff"
    clock.now += 1.0
    store.exist = [1]
    assert c.probe_if_due() and c.data(["a"]) == [Status.OK]
    assert c.breaker_opens() == 1, "one opening, however long it stayed open"


def test_the_prober_closes_the_breaker_by_itself_once_the_pool_answers():
    """The real prober thread and clock: backoff 0.05 s."""

    class Client(BoundedClient):
        def __init__(self):
            self._store = _Store()
            self._guard(CallPolicy(0.2, 0.5, backoff_s=0.05, backoff_max_s=0.2))

    c, store = Client(), None
    store = c._store
    store.exist = [-1]
    assert c.exists(["a"]) == [Status.FAILED]
    store.exist = [1]
    deadline = time.monotonic() + 20  # liveness: a few backoff periods of 0.05-0.2 s, on a loaded host
    while c.exists(["a"]) != [Status.OK]:
        assert time.monotonic() < deadline, "the breaker never closed"
        time.sleep(0.01)
    assert "probe" in store.calls and store.calls.count("exists") == 2, "the first call, then the one let through"
    c.close()


def test_a_call_is_settled_once_it_can_no_longer_touch_its_buffers(client):
    """`settled` runs exactly once: at once for a call refused, answered or failed, and only when a late call returns."""
    c, store, clock = client
    settled = []
    assert c.data(["a"], lambda: settled.append("answered")) == [Status.OK] and settled == ["answered"]
    store.stall.clear()
    assert c.data(["a"], lambda: settled.append("late")) == [Status.TIMEOUT]
    assert settled == ["answered"], "the late call still runs"
    assert c.data(["a"], lambda: settled.append("refused")) == [Status.REFUSED]
    assert settled == ["answered", "refused"]
    store.stall.set()
    deadline = time.monotonic() + 10
    while "late" not in settled:
        assert time.monotonic() < deadline, "the late call's return was never told"
        time.sleep(0.01)
    assert sorted(settled) == ["answered", "late", "refused"]


def test_a_call_past_its_bound_starts_a_backoff_and_a_failed_put_does_not(client):
    c, store, clock = client
    store.data = Status.FAILED  # e.g. no space: an answer about these objects
    assert c.data(["a"]) == [Status.FAILED]
    assert c.data(["a"]) == [Status.FAILED], "still asked"
    store.data = Status.OK
    store.stall.clear()  # the segment holder stops
    start = time.monotonic()
    assert c.data(["a"]) == [Status.TIMEOUT]  # what fired: the bound
    # Liveness: the 0.5 s bound with 4.5 s for a loaded host, where the stalled call would take 30 s.
    assert time.monotonic() - start < 5
    assert c.exists(["a"]) == [Status.REFUSED], "the lookup after it fails at once"
    store.stall.set()
