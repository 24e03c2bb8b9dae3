"""Prefill-side bookkeeping of blocks kept for decode workers: holds with leases.

A hold ends when every decode worker sent its done-notice, or when its lease lapses. A finished
request starts with an initial lease (`timeout_s`, for a decode that never claims it); each renewal
from a decode (`LeaseRenewal`, sent from the moment the decode knows the request, queued included)
sets the lease to `lease_s` from now. So the blocks of a request whose decode died are freed
`lease_s` after its last renewal, while a slow decode that keeps renewing keeps them.

Notices and renewals can arrive before the scheduler's hold announcement reaches this worker; they
are kept (at most `max_unknown`, oldest dropped first, each for one `timeout_s`) and applied when
the hold is announced. A notice or renewal for a hold that already lapsed is answered "not held",
so the decode discards what it read instead of decoding from blocks that may have been reused.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from connectors.mooncake.messages import (
    PROTOCOL_VERSION,
    DoneNotice,
    LeaseGrant,
    LeaseRenewal,
    Message,
    Released,
)

MAX_UNKNOWN = 4096


@dataclass
class _Hold:
    deadline: float
    """When the lease lapses (monotonic); +inf for an entry not announced yet."""
    consumers: set[str] = field(default_factory=set)
    needed: int = 1
    first_seen: float = 0.0


class HoldTable:
    def __init__(self, timeout_s: float, lease_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 max_unknown: int = MAX_UNKNOWN) -> None:
        self.timeout_s = timeout_s
        self.lease_s = timeout_s if lease_s is None else lease_s
        if self.lease_s > timeout_s:
            raise ValueError(f"lease {self.lease_s}s exceeds the initial lease {timeout_s}s")
        self._clock = clock
        self._max_unknown = max_unknown
        self._lock = threading.Lock()  # notices and renewals arrive on the side-channel thread
        self._holds: dict[str, _Hold] = {}
        self._unknown: OrderedDict[str, _Hold] = OrderedDict()  # seen before their announcement
        self._ended: OrderedDict[str, tuple[float, bool]] = OrderedDict()  # id -> (when, lapsed)
        self._noticed = threading.Event()

    def hold(self, request_id: str, seconds: float) -> None:
        now = self._clock()
        with self._lock:
            early = self._unknown.pop(request_id, None)
            hold = self._holds[request_id] = early or _Hold(deadline=0.0, first_seen=now)
            # An early renewal granted `lease_s` from its own arrival: never grant less than that.
            hold.deadline = now + (max(seconds, self.lease_s) if early else seconds)

    def _entry(self, request_id: str, now: float) -> _Hold:
        hold = self._holds.get(request_id) or self._unknown.get(request_id)
        if hold is None:
            hold = self._unknown[request_id] = _Hold(deadline=float("inf"), first_seen=now)
            while len(self._unknown) > self._max_unknown:
                self._unknown.popitem(last=False)
        return hold

    def release(self, request_id: str, consumer: str, num_consumers: int) -> bool:
        """Record a decode worker's done-notice; False if the blocks were already freed by lapse."""
        now = self._clock()
        with self._lock:
            ended = self._ended.get(request_id)
            if ended is not None:
                return not ended[1]
            hold = self._entry(request_id, now)
            hold.consumers.add(consumer)
            hold.needed = num_consumers
        self._noticed.set()
        return True

    def renew(self, request_ids: Iterable[str]) -> list[float]:
        """Extend each request's lease to `lease_s` from now; per id the seconds granted (0: the
        blocks are no longer held)."""
        now = self._clock()
        granted = []
        with self._lock:
            for request_id in request_ids:
                ended = self._ended.get(request_id)
                if ended is not None:
                    granted.append(0.0)
                    continue
                hold = self._holds.get(request_id)
                if hold is not None:
                    hold.deadline = now + self.lease_s
                else:
                    self._entry(request_id, now)  # announced later: hold() honours this lease
                granted.append(self.lease_s)
        return granted

    def wait_for_notice(self, timeout: float) -> None:
        """Block until a done-notice arrives or `timeout` passes (instead of polling in a busy loop)."""
        self._noticed.wait(timeout)
        self._noticed.clear()

    def pop_finished(self) -> tuple[set[str], set[str]]:
        """(released, lapsed) request ids whose blocks may be freed now."""
        now = self._clock()
        released, lapsed = set(), set()
        with self._lock:
            for request_id, hold in list(self._holds.items()):
                if len(hold.consumers) >= hold.needed:
                    released.add(request_id)
                elif now >= hold.deadline:
                    lapsed.add(request_id)
                else:
                    continue
                del self._holds[request_id]
                self._ended[request_id] = (now, request_id in lapsed)
            # Both tables are in arrival order: drop from the front what is older than one timeout.
            for table, age in ((self._unknown, lambda h: h.first_seen), (self._ended, lambda e: e[0])):
                while table and now - age(next(iter(table.values()))) > self.timeout_s:
                    table.popitem(last=False)
        return released, lapsed

    def answer(self, message: Message) -> Message | None:
        """The reply to a decode's done-notice or lease renewal; None for other messages."""
        if isinstance(message, DoneNotice):
            held = self.release(message.request_id, message.consumer, message.num_consumers)
            return Released(version=PROTOCOL_VERSION, request_id=message.request_id, held=held)
        if isinstance(message, LeaseRenewal):
            seconds = self.renew(claim.request_id for claim in message.claims)
            return LeaseGrant(version=PROTOCOL_VERSION, seconds=seconds)
        return None

    def __len__(self) -> int:
        return len(self._holds)
