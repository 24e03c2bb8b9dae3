"""The decode's pull pool: prefills in parallel, bounded per prefill."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_pulls_from_different_prefills_run_in_parallel_bounded_per_prefill():
    import threading

    from connectors.mooncake.pulls import PullPool

    pool = PullPool(workers=3, per_prefill=2)
    gate, lock = threading.Event(), threading.Lock()
    running: dict[str, int] = {"dead": 0, "live": 0}
    peak = dict(running)

    def pull(prefill):
        with lock:
            running[prefill] += 1
            peak[prefill] = max(peak[prefill], running[prefill])
        if prefill == "dead":
            gate.wait(10)  # a hung prefill
        with lock:
            running[prefill] -= 1
        return prefill

    try:
        hung = [pool.submit("dead", pull, "dead") for _ in range(5)]
        live = [pool.submit("live", pull, "live") for _ in range(4)]
        assert [f.result(timeout=5) for f in live] == ["live"] * 4  # not stuck behind the dead prefill
        assert peak == {"dead": 2, "live": 1} and not any(f.done() for f in hung)
        gate.set()
        assert [f.result(timeout=5) for f in hung] == ["dead"] * 5
        assert peak["dead"] == 2
    finally:
        gate.set()
        pool.shutdown()
