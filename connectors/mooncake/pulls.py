"""Bounded, per-prefill-fair execution of a decode worker's pulls.

Pulls run on a small thread pool, at most `per_prefill` at a time for one prefill engine (FIFO per
prefill). A dead or hung prefill costs each of its pulls up to its stall bound (its metadata fetch
included); capped per prefill, it cannot take every thread while pulls from healthy prefills wait.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class PullPool:
    def __init__(self, workers: int, per_prefill: int, initializer: Callable[[], None] | None = None) -> None:
        if workers < 1 or per_prefill < 1:
            raise ValueError(f"need at least one pull thread and one pull per prefill, got {workers}, {per_prefill}")
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvpp-mooncake-pull",
                                        initializer=initializer)
        self._per_prefill = per_prefill
        self._lock = threading.Lock()
        self._running: dict[Hashable, int] = defaultdict(int)
        self._queued: dict[Hashable, deque] = defaultdict(deque)

    def submit(self, prefill: Hashable, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            start = self._running[prefill] < self._per_prefill
            if start:
                self._running[prefill] += 1
            else:
                self._queued[prefill].append((future, fn, args))
        if start:
            self._pool.submit(self._run, prefill, future, fn, args)
        return future

    def _run(self, prefill: Hashable, future: Future, fn: Callable[..., Any], args: tuple) -> None:
        """Run one pull, then this prefill's queued ones on the same thread (its slot stays taken)."""
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:
                    future.set_exception(exc)
            with self._lock:
                queue = self._queued.get(prefill)
                if not queue:
                    self._queued.pop(prefill, None)
                    self._running[prefill] -= 1
                    if not self._running[prefill]:
                        del self._running[prefill]
                    return
                future, fn, args = queue.popleft()

    def shutdown(self) -> None:
        with self._lock:
            for queue in self._queued.values():
                for future, _, _ in queue:
                    future.cancel()
            self._queued.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
