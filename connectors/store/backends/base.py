"""The contract every pool backend meets: normalised per-object status codes and bounded calls.

Store clients signal failure in library-specific ways (negative codes, byte counts, b''), and a dead or
stalled master or segment holder can stall a call, natively for as long as the stall (measured: a get and a put
in flight when the master and segment holder stopped returned only when they resumed, 12 s later, past every
bound Mooncake's client sets). The connector must turn all of that into a cache miss within a short, known
time, so every backend call goes through `BoundedClient._bounded`: bounded by what it moves
(connectors.store.backends.bounds), refused at once while the client's circuit breaker is open after the pool
failed to answer (connectors.store.backends.backoff; a prober of its own asks the pool again), and its result
normalised to one `Status` per key. A call past its bound runs on natively: `settled` tells its caller when it
can no longer touch the buffers it was given.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol

from connectors.store.backends.backoff import PoolBackoff, Ticket
from connectors.store.backends.bounds import CallBounds, CallPolicy

Settled = Callable[[], None]
PROBE_KEY = "kvpp/pool-probe"
"""The key the breaker's prober asks about: no object has it, so an answering pool says MISSING."""


class Status(enum.IntEnum):
    OK = 0
    MISSING = 1
    """The object is not in the pool (never stored, evicted, or lost with a master restart)."""
    WRONG_SIZE = 2
    """The object exists but its size differs from the layout's: refused, never loaded partially."""
    FAILED = 3
    """The backend reported an error (store down, no space, ...)."""
    TIMEOUT = 4
    """The call did not return within its bound; what it does when it returns is ignored."""
    REFUSED = 5
    """Not asked: the pool failed to answer a recent call and the client's breaker is open (or, for a put or get,
    no staging slot was free: every one is held by a call still running past its bound)."""
    OVER_BUDGET = 6
    """Not asked: the request's pool budget could not cover the call's bound."""

    @property
    def answered(self) -> bool:
        """The pool said what it holds of this object (OK, MISSING or WRONG_SIZE); anything else proves nothing."""
        return self <= Status.WRONG_SIZE


class BackendError(RuntimeError):
    """A backend cannot be set up; the message names the setting to fix."""


class Backend(Protocol):
    """One pool client. `ptrs[i]`/`sizes[i]` list the pieces (one per layer) of object `keys[i]`."""

    name: str

    def register(self, ptr: int, size: int) -> None:
        """Register a memory region for zero-copy transfers; raises BackendError."""

    def exists(self, keys: Sequence[str]) -> list[Status]:
        """OK or MISSING per key; FAILED, TIMEOUT or REFUSED for all keys when the store cannot answer."""

    def put(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
            settled: Settled | None = None) -> list[Status]:
        """Write the objects from `ptrs`; `settled()` runs once the store call can no longer read them (at once,
        unless the call runs on past its bound: then when it returns)."""

    def get(self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]],
            settled: Settled | None = None) -> list[Status]:
        """Read the objects into `ptrs`; `settled()` as for `put`, once the call can no longer write them."""

    def remove(self, keys: Sequence[str]) -> list[Status]:
        ...

    def call_bytes(self) -> int:
        """At most what one put or get should move, so that it ends well within its bound (CallBounds)."""

    def bound_s(self, nbytes: int) -> float:
        """The bound of a call moving `nbytes` (CallBounds)."""

    def breaker_opens(self) -> int:
        """Times the client's breaker opened: it stopped calling the pool after a call the pool did not answer."""

    def close(self) -> None:
        ...


class BoundedCalls:
    """Runs blocking client calls with a deadline from `CallBounds`.

    A call that misses its deadline keeps running in its thread (C++ calls cannot be cancelled) and is
    listed by `late()` until it returns; while `max_stuck` such calls are outstanding the backend is
    treated as stalled and new calls fail at once instead of piling up threads. Its threads serve the
    late calls and one call each of the client's callers (a worker's lookups, loads and saves, the prober).
    """

    def __init__(self, bounds: CallBounds, max_stuck: int = 2) -> None:
        self.bounds = bounds
        self._max_stuck = max_stuck
        self._pool = ThreadPoolExecutor(max_workers=max_stuck + 4, thread_name_prefix="kvpp-pool-call")
        self._lock = threading.Lock()
        self._late: set[Future] = set()
        self._running = 0

    def run(self, fn: Callable[[], list[Status]], n: int, nbytes: int = 0,
            settled: Settled | None = None) -> list[Status]:
        """`fn`'s n statuses; n TIMEOUT past the bound for `nbytes` (at once, without calling, while `max_stuck`
        calls are late); n FAILED if the client raised or answered for another number of keys than asked.
        `settled()` runs once `fn` can no longer run: before this returns, or when a late call returns."""
        with self._lock:
            if len(self._late) >= self._max_stuck:
                _settle(settled)
                return all_status(n, Status.TIMEOUT)
        try:
            future = self._pool.submit(self._timed, fn)
        except RuntimeError:  # closed
            _settle(settled)
            return all_status(n, Status.FAILED)
        try:
            status, seconds = future.result(timeout=self.bounds.timeout_s(nbytes))
        except FutureTimeout:
            if future.cancel():  # it never started: nothing runs late
                _settle(settled)
                return all_status(n, Status.TIMEOUT)
            with self._lock:
                self._late.add(future)
            future.add_done_callback(self._unstick)
            if settled is not None:
                future.add_done_callback(lambda _: settled())
            return all_status(n, Status.TIMEOUT)
        except Exception:  # the client library raised: a failure, not a crash
            _settle(settled)
            return all_status(n, Status.FAILED)
        _settle(settled)
        if len(status) != n:  # an answer about other keys than the ones asked says nothing about them
            return all_status(n, Status.FAILED)
        if nbytes and all(s is Status.OK for s in status):
            self.bounds.record(nbytes, seconds)
        return status

    def _timed(self, fn: Callable[[], list[Status]]) -> tuple[list[Status], float]:
        with self._lock:
            self._running += 1
        try:
            start = time.perf_counter()
            return fn(), time.perf_counter() - start
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
    """What both backends share: a native client (`_store`) whose every call is bounded (`_calls`) and refused at
    once while its breaker is open after the pool failed to answer (`_backoff`), and the breaker's prober: a
    background thread that asks the pool again once a backoff period passed, so no request's call is the probe."""

    _store: Any

    def _guard(self, policy: CallPolicy, prober: bool = True) -> None:
        """Bound the client's calls by `policy`; `prober`: start the breaker's prober (tests probe by hand)."""
        self._calls = BoundedCalls(CallBounds(policy))
        self._backoff = PoolBackoff(policy.backoff_s, policy.backoff_max_s)
        self._wake = threading.Event()
        self._closing = False
        if prober:
            threading.Thread(target=self._probe_when_due, name="kvpp-pool-probe", daemon=True).start()

    def exists(self, keys: Sequence[str]) -> list[Status]:
        return self._bounded(lambda: self._exists(keys), keys)

    def _exists(self, keys: Sequence[str]) -> list[Status]:
        return exist_statuses(self._store.batch_is_exist(list(keys)))

    def _bounded(self, call: Callable[[], list[Status]], keys: Sequence[str], nbytes: int = 0,
                 settled: Settled | None = None) -> list[Status]:
        """`call` for `keys`, moving `nbytes`: its statuses, TIMEOUT past its bound, REFUSED while the breaker is
        open; `settled` as in `BoundedCalls.run` (at once when nothing was called)."""
        ticket = self._backoff.admit() if keys else None
        if ticket is None:
            _settle(settled)
            return all_status(len(keys), Status.REFUSED)
        status = self._calls.run(call, len(keys), nbytes, settled)
        self._judge(ticket, status, moves_data=nbytes > 0)
        return status

    def _probe_when_due(self) -> None:
        """The prober's thread: while the breaker is open, `probe_if_due` once each backoff period has passed."""
        while True:
            self._wake.wait(self._backoff.retry_in() if self._backoff.is_open else None)
            if self._closing:
                return
            self._wake.clear()
            self.probe_if_due()

    def probe_if_due(self) -> bool:
        """If the breaker is open and its backoff period passed: one existence check of PROBE_KEY, bounded like a
        lookup's, whose outcome closes the breaker or lengthens the backoff. Whether it asked."""
        ticket = self._backoff.probe()
        if ticket is None:
            return False
        self._judge(ticket, self._calls.run(lambda: self._exists([PROBE_KEY]), 1), moves_data=False)
        return True

    def _judge(self, ticket: Ticket, status: list[Status], moves_data: bool) -> None:
        """The pool did not answer a call that outlived its bound, nor a call moving no data that failed (the
        master could not be reached). A put's or get's FAILED is an answer about its objects (no space, a
        lease, a transfer error), which says nothing of the pool's other objects."""
        if Status.TIMEOUT in status:
            why = "a store call outlived its bound, or too many still run late"
        elif not moves_data and Status.FAILED in status:
            why = "the store could not answer a call that moves no data"
        else:
            self._backoff.answered(ticket)
            return
        self._backoff.failed(ticket, why)
        self._calls.bounds.forget()
        self._wake.set()  # the prober counts the new period from now

    def call_bytes(self) -> int:
        return self._calls.bounds.call_bytes()

    def bound_s(self, nbytes: int) -> float:
        return self._calls.bounds.timeout_s(nbytes)

    def breaker_opens(self) -> int:
        return self._backoff.opens

    def close(self) -> None:
        self._closing = True
        self._wake.set()
        # Closing a native client under a running call crashes the process: leave it open then.
        if self._calls.close(wait_s=self._calls.bounds.ceiling_s):
            self._store.close()


def all_status(n: int, status: Status) -> list[Status]:
    return [status] * n


def _settle(settled: Settled | None) -> None:
    if settled is not None:
        settled()


def exist_statuses(codes: Sequence[int]) -> list[Status]:
    """A store's batch_is_exist codes (1 present, 0 absent, <0 error) as statuses; any error fails
    them all, since a partial answer cannot tell a miss from a fault."""
    if any(c < 0 for c in codes):
        return all_status(len(codes), Status.FAILED)
    return [Status.OK if c == 1 else Status.MISSING for c in codes]
