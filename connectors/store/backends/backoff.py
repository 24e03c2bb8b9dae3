"""A store client stops calling a pool that did not answer, and asks it again later.

A lookup runs on vLLM's scheduler, so without this a dead or stalled master would cost every new request the
lookup's bound. After a call the pool did not answer (past its bound, or a master that could not be reached),
every call is refused at once for a backoff period. Then one call may ask (the probe: an existence check,
which holds no blocks); if the pool answers, calls go through again.

It cannot flap forever: each failure that follows the last one within `backoff_max_s` of calls going through
again doubles the period (up to `backoff_max_s`), so a pool that keeps failing is asked at most once per
`backoff_max_s`; only a pool that answered for `backoff_max_s` since its last failure starts again from
`backoff_s`. Outcomes of calls admitted before the pool was last found failing are ignored: calls in flight
when it died do not lengthen the period, and one that happens to succeed late does not end it.
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
    """The call that asks the pool again after a backoff: its outcome ends the backoff or lengthens it."""


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

    def admit(self) -> Ticket | None:
        """A ticket for one call, or None: refuse it (the pool failed recently)."""
        with self._lock:
            if self._open_until is None:
                return Ticket(self._generation, probe=False)
            if self._probing or self._clock() < self._open_until:
                self._refused += 1
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
            self._open_until, self._probing = now + period, False
        logger.warning("the KV pool did not answer (%s); its lookups, loads and saves fail at once for %.1f s, "
                       "then one existence check asks it again", why, period)

    def retry_in(self) -> float:
        """Seconds until the pool is asked again (0: calls go through, or a probe may ask now)."""
        with self._lock:
            return 0.0 if self._open_until is None else max(0.0, self._open_until - self._clock())
