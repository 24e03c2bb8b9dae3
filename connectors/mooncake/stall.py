"""When a decode gives a pull up: no progress from its prefill within a bound that grows with the
bytes the pull has in flight and shrinks with the link this decode has measured.

Progress is per prefill: a read from it landed (any pull's). A pull's clock
starts at the later of its submission and its prefill's last progress, so a pull queued behind
others on a stalled prefill is given up as soon as it gets its turn, not one bound later, while a
pull queued behind healthy ones keeps waiting as long as they move. Once a pull from a prefill was
given up, the next ones start no read on it before it answers again (their lease renewal), so they
leave nothing in flight for Mooncake to end.
"""

from __future__ import annotations

import math
import threading

INITIAL_RATE = 50e6
"""Bytes per second assumed before this decode measured a pull: below a 1 GbE link's line rate."""
SLACK = 4.0
"""A pull's in-flight bytes count at a quarter of the measured rate (a loaded host moves them slower)."""
EWMA_WEIGHT = 0.2
"""Weight of the newest successful pull in the measured rate."""


class LinkRate:
    """Throughput of this decode's successful pulls (an EWMA, bytes per second), INITIAL_RATE before
    the first."""

    def __init__(self, initial: float = INITIAL_RATE) -> None:
        self.bytes_per_s = initial
        self._measured = False
        self._lock = threading.Lock()

    def record(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            self.bytes_per_s = rate if not self._measured else (1 - EWMA_WEIGHT) * self.bytes_per_s + EWMA_WEIGHT * rate
            self._measured = True


class PrefillProgress:
    """When one prefill last showed progress (time.monotonic): a read from it landed, or it answered a
    lease renewal after being found stalled; and whether a pull from it was given up since: then every
    pull from it stops starting reads, and the next ones start none until it answers their renewal."""

    def __init__(self) -> None:
        self.last = -math.inf
        self.stalled = False

    def saw(self, now: float) -> None:
        self.last = max(self.last, now)  # a float store: atomic under the GIL, and only ever raised
        self.stalled = False

    def gave_up(self) -> None:
        self.stalled = True


class StallWatch:
    """One pull's give-up rule: it is given up once `deadline()` passes, i.e. when neither it nor any
    other pull from its prefill made progress for `bound_s` (plus its in-flight bytes' time at the
    slackened link rate) since it was submitted or since that prefill last progressed."""

    def __init__(self, bound_s: float, rate: LinkRate, progress: PrefillProgress, since: float) -> None:
        if bound_s <= 0:
            raise ValueError(f"the stall bound must be positive, got {bound_s}")
        self.bound_s = bound_s
        self.rate = rate
        self.progress = progress
        self.since = since

    def deadline(self, in_flight_bytes: int = 0) -> float:
        return (max(self.since, self.progress.last) + self.bound_s
                + SLACK * in_flight_bytes / self.rate.bytes_per_s)

    def expired(self, now: float, in_flight_bytes: int = 0) -> bool:
        return now >= self.deadline(in_flight_bytes)

    def progressed(self, now: float) -> None:
        self.progress.saw(now)
