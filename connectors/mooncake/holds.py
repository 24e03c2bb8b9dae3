"""Prefill-side bookkeeping of blocks kept for decode workers: holds with leases and tokens.

A hold ends when every decode worker sent its done-notice, or when its lease lapses. A finished
request starts with an initial lease (`timeout_s`, for a decode that never claims it); each renewal
from a decode (`LeaseRenewal`, sent from the moment the decode knows the request, queued included)
sets the lease to `lease_s` from now. So the blocks of a request whose decode died are freed
`lease_s` after its last renewal, while a slow decode that keeps renewing keeps them.

Every hold has the token the prefill issued in kv_transfer_params: a notice or renewal counts only
with that token (compared in constant time), so no other peer can free or keep the blocks.
Notices and renewals can arrive before the scheduler's hold announcement reaches this worker; they
are kept (at most `max_unknown` requests, oldest dropped first, each for one `timeout_s`) and
checked against the token when the hold is announced. Only messages whose token this engine issued
within one `timeout_s` (connectors/mooncake/tokens.py) are kept that way: anyone else's is refused
at once, so strangers cannot push real early notices out of the table; a genuine token older than that
is answered "expired" (its hold is over and forgotten), so a decode that came too late is told so. Until
the scheduler's key arrives (the first step) no token can have been issued, and none is believed. An
ended hold is remembered as long (and as many): a late or replayed notice for it is answered from that
record and never starts a new entry.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from connectors.mooncake import tokens

MAX_UNKNOWN = 4096
MAX_EARLY_TOKENS = 4
"""Distinct tokens kept per not-yet-announced request (the right one plus a few forgeries)."""

Verdict = Literal["ok", "unknown", "expired", "unauthorized"]


@dataclass
class _Early:
    """Notices and renewals that came before the hold announcement, unchecked."""

    first_seen: float
    notices: dict[str, tuple[str, int]] = field(default_factory=dict)
    """consumer -> (token, num_consumers)"""
    renewed: set[str] = field(default_factory=set)
    """tokens that renewed the lease"""


@dataclass
class _Hold:
    token: str
    deadline: float
    """When the lease lapses (monotonic)."""
    consumers: set[str] = field(default_factory=set)
    needed: int = 1


@dataclass
class _Ended:
    when: float
    lapsed: bool
    token: str
    consumers: set[str]


class HoldTable:
    def __init__(self, timeout_s: float, lease_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 max_unknown: int = MAX_UNKNOWN, key: bytes | None = None) -> None:
        self.timeout_s = timeout_s
        self.lease_s = timeout_s if lease_s is None else lease_s
        if self.lease_s > timeout_s:
            raise ValueError(f"lease {self.lease_s}s exceeds the initial lease {timeout_s}s")
        self._clock = clock
        self._max_unknown = max_unknown
        self._lock = threading.Lock()  # notices and renewals arrive on the side-channel thread
        self._holds: dict[str, _Hold] = {}
        self._unknown: OrderedDict[str, _Early] = OrderedDict()  # in arrival order
        self._ended: OrderedDict[str, _Ended] = OrderedDict()  # in ending order
        self._noticed = threading.Event()
        self.key = key
        """The key this engine's tokens are issued under (set from the scheduler's step metadata)."""

    def hold(self, request_id: str, seconds: float, token: str) -> int:
        """Keep a request's blocks for `seconds` (the scheduler's announcement); returns how many early
        notices and renewals carried a wrong token (dropped)."""
        now = self._clock()
        with self._lock:
            self._ended.pop(request_id, None)
            early = self._unknown.pop(request_id, None) or _Early(now)
            hold = self._holds[request_id] = _Hold(token, now + seconds)
            dropped = 0
            for claimed in early.renewed:
                if hmac.compare_digest(claimed, token):
                    # An early renewal granted `lease_s` from its own arrival: never grant less.
                    hold.deadline = now + max(seconds, self.lease_s)
                else:
                    dropped += 1
            for consumer, (claimed, needed) in early.notices.items():
                if hmac.compare_digest(claimed, token):
                    hold.consumers.add(consumer)
                    hold.needed = needed
                else:
                    dropped += 1
            return dropped

    def _verdict(self, request_id: str, token: str) -> Verdict:
        record = self._holds.get(request_id) or self._ended.get(request_id)
        if record is None:
            age = None if self.key is None else tokens.issued_age(self.key, request_id, token)
            if age is None:
                return "unauthorized"
            # A genuine token older than one timeout names a hold that is over and forgotten.
            return "unknown" if age <= self.timeout_s else "expired"
        if not hmac.compare_digest(record.token, token):
            return "unauthorized"
        return "expired" if isinstance(record, _Ended) else "ok"

    def _early(self, request_id: str, now: float) -> _Early:
        early = self._unknown.get(request_id)
        if early is None:
            early = self._unknown[request_id] = _Early(now)
            while len(self._unknown) > self._max_unknown:
                self._unknown.popitem(last=False)
        return early

    def authorize(self, request_id: str, token: str) -> Verdict:
        """Whether `token` is the live hold's token ("unknown": not announced yet, but the token is one
        this engine issued lately; "expired": over)."""
        with self._lock:
            return self._verdict(request_id, token)

    def release(self, request_id: str, consumer: str, num_consumers: int, token: str) -> Verdict:
        """Record a decode worker's done-notice. "expired": the blocks were freed before this consumer
        said done (lease lapsed); "unknown": kept until the hold arrives with the token to check."""
        now = self._clock()
        with self._lock:
            verdict = self._verdict(request_id, token)
            if verdict == "ok":
                hold = self._holds[request_id]
                hold.consumers.add(consumer)
                hold.needed = num_consumers
            elif verdict == "unknown":
                early = self._early(request_id, now)
                if consumer in early.notices or len(early.notices) < MAX_EARLY_TOKENS:
                    early.notices[consumer] = (token, num_consumers)
            elif verdict == "expired":
                ended = self._ended.get(request_id)  # None: forgotten, the token says it is over
                # A repeated notice of a consumer counted before the release keeps its answer.
                return "ok" if ended and not ended.lapsed and consumer in ended.consumers else "expired"
            else:
                return verdict
        self._noticed.set()
        return verdict

    def renew(self, claims: Iterable[tuple[str, str]]) -> list[tuple[float, Verdict]]:
        """Extend each (request id, token)'s lease to `lease_s` from now; per claim the seconds granted
        (0: not held any more, or a wrong token) and the verdict."""
        now = self._clock()
        out = []
        with self._lock:
            for request_id, token in claims:
                verdict = self._verdict(request_id, token)
                if verdict == "ok":
                    self._holds[request_id].deadline = now + self.lease_s
                elif verdict == "unknown":  # announced later: hold() checks the token, honours the lease
                    early = self._early(request_id, now)
                    if len(early.renewed) < MAX_EARLY_TOKENS:
                        early.renewed.add(token)
                out.append((self.lease_s if verdict in ("ok", "unknown") else 0.0, verdict))
        return out

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
                self._ended[request_id] = _Ended(now, request_id in lapsed, hold.token, hold.consumers)
            while len(self._ended) > self._max_unknown:
                self._ended.popitem(last=False)
            # Both tables are in arrival order: drop from the front what is older than one timeout.
            for table, age in ((self._unknown, lambda e: e.first_seen), (self._ended, lambda e: e.when)):
                while table and now - age(next(iter(table.values()))) > self.timeout_s:
                    table.popitem(last=False)
        return released, lapsed

    def __len__(self) -> int:
        return len(self._holds)
