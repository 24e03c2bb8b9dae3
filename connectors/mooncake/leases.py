"""Decode side of the prefill's leases: renew every request this decode will pull, from its arrival
(queued included) until its pull ended, batched per prefill worker (NIXL-style heartbeat).

A renewal keeps the request's blocks for the prefill's `lease_s` from when the prefill reads it;
renewing every third of that tolerates two lost heartbeats, and a decode that dies stops renewing,
so its blocks are freed `lease_s` later instead of after a long fixed timeout.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from vllm.logger import init_logger

from connectors.mooncake.affinity import unpin_current_thread
from connectors.mooncake.channel import Calls, ChannelError
from connectors.mooncake.curve import CurveKeys, client_setup
from connectors.mooncake.messages import MAX_CLAIMS, PROTOCOL_VERSION, LeaseClaim, LeaseGrant, LeaseRenewal, PrefillHandle
from connectors.mooncake.puller import prefill_ports

logger = init_logger(f"vllm.{__name__}")

DEFAULT_LEASE_S = 5.0  # a prefill that does not advertise its lease (older release) gets this
TICK_S = 0.2


def renew_interval(handle: PrefillHandle) -> float:
    return (handle.remote_lease_s or DEFAULT_LEASE_S) / 3


class LeaseKeeper:
    def __init__(self, timeout_s: float, curve: CurveKeys | None = None) -> None:
        self.timeout_s = timeout_s
        self.curve = curve
        self._lock = threading.Lock()
        self._claims: dict[str, tuple[PrefillHandle, float]] = {}  # request id -> (handle, next due)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing: set[tuple[str, int]] = set()  # prefill workers whose last renewal failed

    def add(self, request_id: str, handle: PrefillHandle) -> None:
        with self._lock:
            self._claims[request_id] = (handle, 0.0)  # due at the next tick, queued or not
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvpp-mooncake-leases", daemon=True)
                self._thread.start()

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._claims.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._claims

    def renew_due(self) -> None:
        """One heartbeat: renew every claim that is due, one message per prefill worker."""
        now = time.monotonic()
        # (prefill worker, its CURVE key) -> [(our request id, its handle)]
        batches: dict[tuple[str, int, str | None], list[tuple[str, PrefillHandle]]] = defaultdict(list)
        # A dead prefill must not hold up the next round (and the leases on live prefills with it).
        timeout = self.timeout_s
        with self._lock:
            for request_id, (handle, due) in list(self._claims.items()):
                if due > now:
                    continue
                try:
                    ports = prefill_ports(handle)
                except ValueError as exc:  # one handle we cannot renew must not cost the others theirs
                    logger.error("request %s: lease not renewed: %s", request_id, exc)
                    del self._claims[request_id]
                    continue
                timeout = min(timeout, renew_interval(handle))
                self._claims[request_id] = (handle, now + renew_interval(handle))
                for _, _, port in ports:
                    batches[(handle.remote_host, port, handle.remote_curve_key)].append((request_id, handle))
        if not batches:
            return
        sent = []
        for (*target, key), ids in batches.items():
            target = tuple(target)
            for start in range(0, len(ids), MAX_CLAIMS):
                chunk = ids[start:start + MAX_CLAIMS]
                renewal = LeaseRenewal(version=PROTOCOL_VERSION, claims=[
                    LeaseClaim(request_id=handle.remote_request_id, token=handle.remote_token) for _, handle in chunk])
                try:
                    calls = Calls([target], renewal, timeout, LeaseGrant, client_setup(self.curve, key))
                except ChannelError as exc:  # this worker only: the other batches still go out
                    calls = exc
                sent.append((target, chunk, calls))
        for target, chunk, calls in sent:
            (grant,) = (calls,) if isinstance(calls, ChannelError) else calls.results()
            if isinstance(grant, ChannelError):
                if target not in self._failing:  # once per outage, not every heartbeat
                    self._failing.add(target)
                    logger.warning("lease renewal of %d requests on prefill worker %s:%d failed: %s",
                                   len(chunk), *target, grant)
                continue
            self._failing.discard(target)
            host, port = target
            freed = [rid for (rid, _), seconds in zip(chunk, grant.seconds) if seconds <= 0]
            if freed:
                # The prefill freed them already (lease lapsed): their pulls will fail and vLLM's
                # kv_load_failure_policy decides; stop renewing.
                logger.warning("prefill worker %s:%d no longer holds the blocks of %s", host, port, freed)
                for rid in freed:
                    self.drop(rid)

    def _run(self) -> None:
        unpin_current_thread()
        while not self._stop.wait(TICK_S):
            try:
                self.renew_due()
            except Exception:  # the heartbeat must outlive one bad round
                logger.exception("lease renewal round failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
