"""The contract every pool backend meets: normalised per-object status codes and bounded calls.

Store clients signal failure in library-specific ways (negative codes, byte counts, b''), and a dead
master can stall a call. The connector must turn all of that into a cache miss within a known time,
so every backend call goes through `BoundedCalls` and every result through `Status`.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Status(enum.IntEnum):
    OK = 0
    MISSING = 1
    """The object is not in the pool (never stored, evicted, or lost with a master restart)."""
    WRONG_SIZE = 2
    """The object exists but its size differs from the layout's: refused, never loaded partially."""
    FAILED = 3
    """The backend reported an error (store down, no space, ...)."""
    TIMEOUT = 4
    """The call did not return within the per-call bound."""


class BackendError(RuntimeError):
    """A backend cannot be set up; the message names the setting to fix."""


class Backend(Protocol):
    """One pool client. `ptrs[i]`/`sizes[i]` list the pieces (one per layer) of object `keys[i]`."""

    name: str

    def register(self, ptr: int, size: int) -> None:
        """Register a memory region for zero-copy transfers; raises BackendError."""

    def exists(self, keys: Sequence[str]) -> list[Status]:
        """OK or MISSING per key; FAILED/TIMEOUT for all keys when the store cannot answer."""

    def put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[Status]:
        ...

    def get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[Status]:
        ...

    def remove(self, keys: Sequence[str]) -> list[Status]:
        ...

    def late_calls(self) -> list[Future]:
        """Calls that returned TIMEOUT but are still running natively: until each is done it may read or
        write the buffers it was given, so the caller must keep them allocated."""

    def close(self) -> None:
        ...


class BoundedCalls:
    """Runs blocking client calls with a deadline.

    A call that misses its deadline keeps running in its thread (C++ calls cannot be cancelled) and is
    listed by `late()` until it returns; while `max_stuck` such calls are outstanding the backend is
    treated as stalled and new calls fail at once instead of piling up threads.
    """

    def __init__(self, timeout_s: float, max_stuck: int = 2) -> None:
        self.timeout_s = timeout_s
        self._max_stuck = max_stuck
        self._pool = ThreadPoolExecutor(max_workers=max_stuck + 2, thread_name_prefix="kvpp-pool-call")
        self._lock = threading.Lock()
        self._late: set[Future] = set()
        self._running = 0

    def run(self, fn: Callable[[], T], on_timeout: Callable[[], T], on_error: Callable[[BaseException], T]) -> T:
        with self._lock:
            if len(self._late) >= self._max_stuck:
                return on_timeout()
        future = self._pool.submit(self._tracked, fn)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            with self._lock:
                self._late.add(future)
            future.add_done_callback(self._unstick)
            return on_timeout()
        except Exception as exc:  # the client library raised: a failure, not a crash
            return on_error(exc)

    def _tracked(self, fn: Callable[[], T]) -> T:
        with self._lock:
            self._running += 1
        try:
            return fn()
        finally:
            with self._lock:
                self._running -= 1

    def _unstick(self, future: Future) -> None:
        with self._lock:
            self._late.discard(future)

    def late(self) -> list[Future]:
        with self._lock:
            return list(self._late)

    def close(self, wait_s: float = 0.0) -> bool:
        """Stop accepting calls; True once no call is running (within wait_s), so the client can be
        closed safely (closing a native client under a running call crashes the process)."""
        deadline = time.monotonic() + wait_s
        self._pool.shutdown(wait=False, cancel_futures=True)
        while True:
            with self._lock:
                if not self._late and self._running == 0:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


class BoundedClient:
    """What both backends share: a native client (`_store`) whose every call runs through `_calls`."""

    _store: Any
    _calls: BoundedCalls

    def _bounded(self, call: Callable[[], list[Status]], n: int) -> list[Status]:
        """`call` for n keys, as n TIMEOUT statuses past the bound and n FAILED if the client raised."""
        if n == 0:
            return []
        return self._calls.run(call, lambda: all_status(n, Status.TIMEOUT),
                               lambda _exc: all_status(n, Status.FAILED))

    def late_calls(self) -> list[Future]:
        return self._calls.late()

    def close(self) -> None:
        # Closing a native client under a running call crashes the process: leave it open then.
        if self._calls.close(wait_s=self._calls.timeout_s):
            self._store.close()


def all_status(n: int, status: Status) -> list[Status]:
    return [status] * n


def exist_statuses(codes: Sequence[int]) -> list[Status]:
    """A store's batch_is_exist codes (1 present, 0 absent, <0 error) as statuses; any error fails
    them all, since a partial answer cannot tell a miss from a fault."""
    if any(c < 0 for c in codes):
        return all_status(len(codes), Status.FAILED)
    return [Status.OK if c == 1 else Status.MISSING for c in codes]
