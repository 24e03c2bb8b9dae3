"""How long one store call may take: derived from what it moves and what recent calls achieved.

A pool miss costs only a recompute, so no call may wait long for a pool that does not answer. A call that
moves no data (an existence check, a removal) gets the floor. A call that moves bytes gets the floor plus
`slack` times what its bytes take at the rate recent successful data calls achieved, and never more than the
ceiling; until a data call has succeeded the rate is unknown and it gets the ceiling (also again after the pool
failed to answer: a rate measured before says nothing of the link after it, which may first have to reconnect:
about 1 s to a segment holder that stalled, measured here). Data calls are also cut
into pieces (`call_bytes`) that end well within the ceiling at that rate, so that a long prompt is bounded by
its progress, not by one deadline for all of its bytes.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

WINDOW = 32
"""Successful data calls the rate is measured over."""
FIRST_CALL_BYTES = 16 << 20
"""What one data call moves before any rate is known (16 MiB in the ceiling: 5.6 MB/s, any link meets it)."""


@dataclass(frozen=True)
class CallPolicy:
    """A store client's bounds and its backoff after a failure (`StoreSettings.call_policy`)."""

    floor_s: float
    ceiling_s: float
    slack: float = 4.0
    backoff_s: float = 1.0
    """How long the client stops calling the pool after a failure, doubled for each further failure..."""
    backoff_max_s: float = 30.0
    """...up to this; a pool that answered this long since its last failure starts again from `backoff_s`."""

    @classmethod
    def fixed(cls, timeout_s: float) -> "CallPolicy":
        """Every call bounded by `timeout_s` (tools and tests that choose their own bound)."""
        return cls(timeout_s, timeout_s)


class CallBounds:
    def __init__(self, policy: CallPolicy) -> None:
        self.floor_s, self.ceiling_s, self.slack = policy.floor_s, policy.ceiling_s, policy.slack
        self._lock = threading.Lock()
        self._recent: deque[tuple[int, float]] = deque(maxlen=WINDOW)

    def rate(self) -> float | None:
        """Bytes per second of the recent successful data calls taken together; None before the first."""
        with self._lock:
            moved, took = sum(b for b, _ in self._recent), sum(s for _, s in self._recent)
        return moved / took if took > 0 else None

    def timeout_s(self, nbytes: int) -> float:
        if nbytes <= 0:
            return self.floor_s
        rate = self.rate()
        if rate is None:
            return self.ceiling_s
        return min(self.ceiling_s, self.floor_s + self.slack * nbytes / rate)

    def call_bytes(self) -> int:
        """At most what one data call should move: at the measured rate it takes `slack` times less than the
        ceiling (before any rate is known, FIRST_CALL_BYTES)."""
        rate = self.rate()
        if rate is None:
            return FIRST_CALL_BYTES
        return max(1, int(rate * self.ceiling_s / self.slack))

    def forget(self) -> None:
        """The pool failed to answer: the rate is unknown again."""
        with self._lock:
            self._recent.clear()

    def record(self, nbytes: int, seconds: float) -> None:
        """A data call moved all of its `nbytes` in `seconds`."""
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self._recent.append((nbytes, seconds))
