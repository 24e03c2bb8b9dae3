"""A store client's circuit breaker: it stops calling a pool that did not answer, and asks it again in the background.

A lookup runs on vLLM's scheduler and calls to a pool that stopped answering would queue behind one another, so
without this a dead or stalled master or segment holder would cost every request a bound, and later requests
several. After a call the pool did not answer (past its bound, or a master that could not be reached), the
breaker opens: every call is refused at once (a lookup is a miss, a load a recompute, a save skipped). Once a
backoff period has passed, the client's own prober asks the pool (an existence check of a key no object has,
which holds nothing and belongs to no request: `probe`); if the pool answers, the breaker closes and calls go
through again.

It cannot flap forever: each failure that follows the last one within `backoff_max_s` of calls going through
again doubles the period (up to `backoff_max_s`), so a pool that answers the probe but fails the next call (a
stopped segment holder behind a live master) costs a request's call at most once per `backoff_max_s`; only a
pool that answered for `backoff_max_s` since its last failure starts again from `backoff_s`. Outcomes of calls
admitted before the pool was last found failing are ignored: calls in flight when it died do not lengthen the
period, and one that happens to succeed late does not close the breaker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# Plain logging under "vllm." (not vllm.logger.init_logger): store clients also run in tools and tests
# outside vLLM; inside a vLLM process its handlers print these.
logger = logging.getLogger(f"vllm.{__name__}")


@dataclass(frozen=True)
class Ticket:
    """Leave to make one call."""

    generation: int
    """Which period of the pool's state the call was admitted in; outcomes of an older period are ignored."""
    probe: bool
    """The prober's call that asks the pool again after a backoff: its outcome closes the breaker or lengthens the
    backoff."""


class PoolBackoff:
    def __init__(self, backoff_s: float, backoff_max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._base, self._max, self._clock = backoff_s, backoff_max_s, clock
        self._lock = threading.Lock()
        self._generation = 0
        self._open_until: float | None = None
        """None: calls go through. Else the time before which every call is refused."""
        self._probing = False
        self._level = 0
        """Failures in a row (the next period is backoff_s * 2**level)."""
        self._through_since = -float("inf")
        """When calls last started to go through (after the last failure)."""
        self._refused = 0
        self.opens = 0
        """Times the breaker opened (cumulative)."""

    def admit(self) -> Ticket | None:
        """A ticket for one call, or None: refuse it (the breaker is open: the pool failed recently)."""
        with self._lock:
            if self._open_until is None:
                return Ticket(self._generation, probe=False)
            self._refused += 1
            return None

    def probe(self) -> Ticket | None:
        """The prober's ticket once the backoff period passed (one probe at a time), else None."""
        with self._lock:
            if self._open_until is None or self._probing or self._clock() < self._open_until:
                return None
            self._probing = True
            return Ticket(self._generation, probe=True)

    def answered(self, ticket: Ticket) -> None:
        """The pool answered the call of `ticket`."""
        with self._lock:
            if not ticket.probe or ticket.generation != self._generation:
                return
            self._open_until, self._probing, self._through_since = None, False, self._clock()
            refused, self._refused = self._refused, 0
        logger.info("the KV pool answers again; calls go through (%d refused while it backed off)", refused)

    def failed(self, ticket: Ticket, why: str) -> None:
        """The pool did not answer the call of `ticket` (`why`: for the log)."""
        with self._lock:
            if ticket.generation != self._generation:
                return  # admitted before the pool was found failing: already counted
            now = self._clock()
            if not ticket.probe and now - self._through_since >= self._max:
                self._level = 0  # it answered for backoff_max_s: a new failure, not the same one
            period = min(self._base * 2 ** self._level, self._max)
            self._level += 1
            self._generation += 1
            self.opens += int(self._open_until is None)
            self._open_until, self._probing = now + period, False
        logger.warning("the KV pool did not answer (%s); its lookups, loads and saves fail at once for %.1f s, "
                       "then an existence check in the background asks it again", why, period)

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open_until is not None

    def retry_in(self) -> float:
        """Seconds until the prober asks the pool again (0: calls go through, or a probe may ask now)."""
        with self._lock:
            return 0.0 if self._open_until is None else max(0.0, self._open_until - self._clock())
