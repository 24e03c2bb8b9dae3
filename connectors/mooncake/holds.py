"""Prefill-side bookkeeping of blocks kept for decode workers.

A hold ends when every decode worker sent its done-notice, or when its timeout passes (a decode
that died or never pulls must not pin prefill memory forever). Notices can arrive before the
scheduler's hold announcement reaches this worker; they are kept for one timeout, then dropped.
A notice for a hold that already expired is answered "not held", so the decode discards what it
read instead of decoding from blocks that may have been reused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Hold:
    deadline: float | None = None
    consumers: set[str] = field(default_factory=set)
    needed: int = 1
    first_seen: float = 0.0


class HoldTable:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()  # notices arrive on the side-channel thread
        self._holds: dict[str, _Hold] = {}
        self._expired: dict[str, float] = {}  # request id -> when its hold timed out
        self._noticed = threading.Event()

    def _get(self, request_id: str) -> _Hold:
        hold = self._holds.get(request_id)
        if hold is None:
            hold = self._holds[request_id] = _Hold(first_seen=self._clock())
        return hold

    def hold(self, request_id: str, seconds: float) -> None:
        with self._lock:
            self._get(request_id).deadline = self._clock() + seconds

    def release(self, request_id: str, consumer: str, num_consumers: int) -> bool:
        """Record a decode worker's done-notice; False if the blocks were already freed by timeout."""
        with self._lock:
            if request_id in self._expired:
                return False
            hold = self._get(request_id)
            hold.consumers.add(consumer)
            hold.needed = num_consumers
        self._noticed.set()
        return True

    def wait_for_notice(self, timeout: float) -> None:
        """Block until a done-notice arrives or `timeout` passes (instead of polling in a busy loop)."""
        self._noticed.wait(timeout)
        self._noticed.clear()

    def pop_finished(self) -> tuple[set[str], set[str]]:
        """(released, expired) request ids whose blocks may be freed now."""
        now = self._clock()
        released, expired = set(), set()
        with self._lock:
            for request_id, hold in list(self._holds.items()):
                if hold.deadline is None:
                    if now - hold.first_seen > self.timeout_s:
                        del self._holds[request_id]  # notice for a request this worker never held
                    continue
                if len(hold.consumers) >= hold.needed:
                    released.add(request_id)
                elif now >= hold.deadline:
                    expired.add(request_id)
                    self._expired[request_id] = now
                else:
                    continue
                del self._holds[request_id]
            for request_id, when in list(self._expired.items()):
                if now - when > self.timeout_s:
                    del self._expired[request_id]
        return released, expired

    def __len__(self) -> int:
        return sum(1 for hold in self._holds.values() if hold.deadline is not None)
