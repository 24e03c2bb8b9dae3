"""Prefill-side bookkeeping of blocks kept for decode workers.

A hold ends when every decode worker sent its done-notice, or when its timeout passes (a decode
that died or never pulls must not pin prefill memory forever). Notices can arrive before the
scheduler's hold announcement reaches this worker; they are kept for one timeout, then dropped.
A notice for a hold that already expired is answered "not held", so the decode discards what it
read instead of decoding from blocks that may have been reused.

Every hold has the token the prefill issued in kv_transfer_params: a notice counts only with that
token (an early notice is checked when the hold arrives), so no other peer can free the blocks.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Verdict = Literal["ok", "unknown", "expired", "unauthorized"]


@dataclass
class _Hold:
    deadline: float | None = None
    token: str = ""
    consumers: set[str] = field(default_factory=set)
    needed: int = 1
    first_seen: float = 0.0
    early: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Notices that came before the hold: consumer -> (token, num_consumers), checked by hold()."""


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

    def hold(self, request_id: str, seconds: float, token: str) -> int:
        """Keep a request's blocks; returns how many early notices carried a wrong token (dropped)."""
        with self._lock:
            hold = self._get(request_id)
            hold.deadline, hold.token = self._clock() + seconds, token
            early, hold.early = hold.early, {}
            dropped = 0
            for consumer, (claimed, needed) in early.items():
                if hmac.compare_digest(claimed, token):
                    hold.consumers.add(consumer)
                    hold.needed = needed
                else:
                    dropped += 1
            return dropped

    def authorize(self, request_id: str, token: str) -> Verdict:
        """Whether `token` is the live hold's token ("unknown": no hold announced yet, or over)."""
        with self._lock:
            return self._verdict(request_id, token)

    def _verdict(self, request_id: str, token: str) -> Verdict:
        if request_id in self._expired:
            return "expired"
        hold = self._holds.get(request_id)
        if hold is None or hold.deadline is None:
            return "unknown"
        return "ok" if hmac.compare_digest(hold.token, token) else "unauthorized"

    def release(self, request_id: str, consumer: str, num_consumers: int, token: str) -> Verdict:
        """Record a decode worker's done-notice. "expired": the blocks were already freed by timeout;
        "unknown": kept until the hold arrives with the token to check it against."""
        with self._lock:
            verdict = self._verdict(request_id, token)
            if verdict == "ok":
                hold = self._holds[request_id]
                hold.consumers.add(consumer)
                hold.needed = num_consumers
            elif verdict == "unknown":
                self._get(request_id).early[consumer] = (token, num_consumers)
            else:
                return verdict
        self._noticed.set()
        return verdict

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
