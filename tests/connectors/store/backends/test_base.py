"""Bounded backend calls: a stalled backend costs its bound once, then fails fast until it returns."""

from __future__ import annotations

import threading
import time

import pytest

from connectors.store.backends.base import BoundedCalls

pytestmark = pytest.mark.unit


def test_a_stalled_call_returns_within_its_bound_and_fails_fast_after():
    calls = BoundedCalls(timeout_s=1.0, max_stuck=1)
    release = threading.Event()
    start = time.monotonic()
    assert calls.run(lambda: release.wait(30) and "late", lambda: "timeout", lambda e: "error") == "timeout"
    # Liveness: the 1 s bound with 9 s for a loaded host, where the call itself would take 30 s.
    assert time.monotonic() - start < 10, "bounded by the timeout, not by the call's 30 s"
    (late,) = calls.late()
    assert not late.done(), "the timed-out call is still running and is listed until it returns"
    ran = []
    assert calls.run(lambda: ran.append(1), lambda: "timeout", lambda e: "error") == "timeout", "fail fast"
    assert ran == [], "failed fast: the call was not even started, so nothing waited for the 1 s bound"
    release.set()
    assert late.result(timeout=10) == "late"
    deadline = time.monotonic() + 10  # the done-callback that unlists it runs just after the result is set
    while calls.late() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls.late() == []
    assert calls.run(lambda: "ok", lambda: "timeout", lambda e: "error") == "ok", "recovers once the call returns"
    assert calls.run(lambda: 1 / 0, lambda: "timeout", lambda e: type(e).__name__) == "ZeroDivisionError"
    calls.close()
