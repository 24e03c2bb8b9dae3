"""Thin wrapper over the Mooncake TransferEngine for pulling KV blocks, bounded by progress.

Measured transport facts shape it (bench/pd_transfer.py and bench/pd_stall.py measure them): every
copy costs ~75 us, so contiguous block runs are coalesced; one huge copy is moved by too few engine
threads (a 300 MB read took 0.26 s as one entry, 0.13 s as 256 entries of ~1.2 MB), so merged runs
are cut into pieces of at most `max_entry_bytes`. Each piece is its own asynchronous read, and at
most one per Mooncake TCP lane of a peer is in flight (MC_TCP_LANES_PER_PEER), so no piece waits in
Mooncake's queue: a read Mooncake abandoned at its timeout still ran its queued pieces later, into
the same memory, once the peer woke. A pull whose pieces stop completing is given up at its
`StallWatch` bound; the pieces still in flight then end within Mooncake's TCP progress timeout
(MC_TCP_PROGRESS_TIMEOUT_SEC, set from the same bound), and until they have ended (`Drain`) their
destinations must not be handed back.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from connectors.common.hosts import join_host_port, mooncake_family
from connectors.common.mooncake_env import bound_progress

from connectors.mooncake.affinity import run_unpinned
from connectors.mooncake.stall import StallWatch

DEFAULT_MAX_ENTRY_BYTES = 1 << 20
DEFAULT_LANES = 4  # Mooncake's TCP lanes per peer by default; MC_TCP_LANES_PER_PEER sets 1-16
MAX_LANES = 16
MIN_NAP_S, MAX_NAP_S = 50e-6, 250e-6
MAX_RETRIES = 3
"""Times a pull issues again the reads that failed at once. A prefill resumed after a stall still closes for a
moment the connections its peer dropped, and a read meeting one fails at once (a clean-clone run: 2 of 162
reads failed twice, right after a stall): so a failed read is issued again after a pause (RETRY_PAUSE_S, doubled
each time) as long as some read landed since the last retry. A peer whose reads all fail (dead, refusing) fails
the pull at its first retry."""
RETRY_PAUSE_S = 0.02
"""Polling pause while no read ended: doubles from the first to the second. A lane whose read ended
idles until the next poll, so the pause stays well under one 1 MiB read's time on a fast link
(bench/pd_transfer.py measures the pull against raw reads)."""


class TransferError(RuntimeError):
    """A transfer-engine call failed; the caller turns it into a load failure, never a crash.
    `drain` holds the pull's reads still in flight (None: none), whose destinations the engine may
    still write into."""

    def __init__(self, message: str, drain: Drain | None = None) -> None:
        super().__init__(message)
        self.drain = drain


class Stalled(TransferError):
    """The pull made no progress within its bound and was given up."""


class Desc(NamedTuple):
    """One contiguous copy: `length` bytes from the peer's `remote` address to local `local`."""

    local: int
    remote: int
    length: int


class Moved(NamedTuple):
    nbytes: int
    entries: int
    """Reads issued after coalescing and cutting."""
    retried: int
    """Reads that failed at once and were issued again (once per pull)."""


def lanes_per_peer(env: Mapping[str, str] = os.environ) -> int:
    """Mooncake's TCP lanes per peer as it reads them (an unparsable value falls back to its default)."""
    try:
        lanes = int(env.get("MC_TCP_LANES_PER_PEER", DEFAULT_LANES))
    except ValueError:
        return DEFAULT_LANES
    return min(max(lanes, 1), MAX_LANES)


def coalesce(descs: Iterable[Desc]) -> list[Desc]:
    """Merge runs of copies adjacent on both sides into single copies, keeping order."""
    merged: list[Desc] = []
    for d in descs:
        if d.length <= 0:
            raise ValueError(f"transfer length must be positive, got {d.length}")
        if merged:
            last = merged[-1]
            if last.local + last.length == d.local and last.remote + last.length == d.remote:
                merged[-1] = Desc(last.local, last.remote, last.length + d.length)
                continue
        merged.append(d)
    return merged


def cut_entries(descs: Iterable[Desc], max_bytes: int) -> list[Desc]:
    """Cut copies longer than `max_bytes` into consecutive pieces (the engine parallelises over
    entries, not within one)."""
    if max_bytes < 1:
        raise ValueError(f"entry limit must be >= 1 byte, got {max_bytes}")
    out = []
    for d in descs:
        for offset in range(0, d.length, max_bytes):
            out.append(Desc(d.local + offset, d.remote + offset, min(max_bytes, d.length - offset)))
    return out


def _import_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(
            "MooncakeConnectorV2 needs the Mooncake transfer engine: pip install "
            "mooncake-transfer-engine-non-cuda (CPU/tcp hosts) or mooncake-transfer-engine (CUDA); "
            f"import failed: {exc}"
        ) from exc
    return TransferEngine


class Drain:
    """The reads of a given-up pull still in flight: the engine may still write into their
    destinations until each has ended (completed or failed). Poll `ended()` from one thread."""

    def __init__(self, transfer: MooncakeTransfer, peer_session: str, batch_ids: list[int]) -> None:
        self._transfer = transfer
        self._peer = peer_session
        self._ids = batch_ids

    def __len__(self) -> int:
        return len(self._ids)

    def ended(self) -> bool:
        self._ids = [i for i in self._ids if self._transfer._status(self._peer, i) not in (1, -1)]
        return not self._ids

    def abandon(self) -> None:
        """Stop watching the reads left (they keep their engine batches): frees their lanes for new reads."""
        for _ in self._ids:
            self._transfer._release(self._peer)
        self._ids = []


class MooncakeTransfer:
    """One TransferEngine in P2P-handshake mode, with registered regions and reads bounded by progress.

    `progress_timeout_s` (a puller's stall bound) bounds Mooncake's TCP progress timeout for this
    process (connectors.common.mooncake_env)."""

    def __init__(
        self,
        host: str,
        protocol: str = "tcp",
        device_name: str = "",
        progress_timeout_s: float | None = None,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if progress_timeout_s is not None:
            bound_progress(progress_timeout_s)
        try:
            mooncake_family(host, os.environ)
        except ValueError as exc:
            raise TransferError(str(exc)) from None
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        self.host = host
        self.protocol = protocol
        self.max_entry_bytes = max_entry_bytes
        self._clock = clock
        self.lanes = lanes_per_peer()
        self._in_flight: dict[str, int] = {}  # peer session -> reads in flight on it, at most `lanes`
        self._lock = threading.Lock()
        self._engine = _import_engine()()
        # The engine starts its I/O threads here; they inherit this thread's CPU mask.
        rc = run_unpinned(lambda: self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name))
        if rc != 0:
            raise TransferError(
                f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}, "
                f"{device_name!r}) returned {rc}; check kv_connector_extra_config.protocol "
                "('tcp' works everywhere, 'rdma' needs an RDMA device) and VLLM_HOST_IP"
            )
        self._registered: list[tuple[int, int]] = []

    @property
    def rpc_port(self) -> int:
        return int(self._engine.get_rpc_port())

    @property
    def session(self) -> str:
        return join_host_port(self.host, self.rpc_port)

    def register(self, regions: list[tuple[int, int]]) -> None:
        """Register (address, length) regions so peers may read them."""
        if not regions:
            return
        addrs = [a for a, _ in regions]
        lens = [n for _, n in regions]
        rc = self._engine.batch_register_memory(addrs, lens)
        if rc != 0:
            raise TransferError(f"Mooncake batch_register_memory of {len(regions)} regions returned {rc}")
        self._registered.extend(regions)

    # ---- reads in flight, at most one per lane of a peer ----------------------------------------
    def _take(self, peer: str) -> bool:
        with self._lock:
            if self._in_flight.get(peer, 0) >= self.lanes:
                return False
            self._in_flight[peer] = self._in_flight.get(peer, 0) + 1
            return True

    def _release(self, peer: str) -> None:
        with self._lock:
            left = self._in_flight[peer] - 1
            if left:
                self._in_flight[peer] = left
            else:
                del self._in_flight[peer]

    def _submit(self, peer: str, d: Desc) -> int:
        """Start one read on a lane `_take` reserved; its engine batch id."""
        batch_id = self._engine.batch_transfer_async_read(peer, [d.local], [d.remote], [d.length])
        if not batch_id:
            self._release(peer)
            raise TransferError(f"Mooncake could not start a read from {peer} (batch_transfer_async_read "
                                "returned 0: the peer's transfer engine is unknown or unreachable)")
        return batch_id

    def _status(self, peer: str, batch_id: int) -> int:
        """1 completed, -1 failed (both final: the engine freed the batch, which is never asked again),
        0 (or -2, timed out) still in flight."""
        rc = self._engine.transfer_check_status(batch_id)
        if rc in (1, -1):
            self._release(peer)
        return rc

    def read(self, peer_session: str, descs: Iterable[Desc], watch: StallWatch | None = None) -> Moved:
        """Pull every copy from the peer. Reads that fail at once (within half the stall bound of their
        start: a refused or reset connection) are issued again after a pause, Mooncake opening a fresh
        connection for them, while the peer lands other reads between (MAX_RETRIES); a pull that `watch`
        finds stalled, whose reads Mooncake dropped for making no progress (they failed later than that),
        or whose prefill another pull found stalled, raises Stalled and starts no further read. Every error
        carries the reads still in flight (`TransferError.drain`)."""
        pieces = deque(cut_entries(coalesce(descs), self.max_entry_bytes))
        count, total = len(pieces), sum(d.length for d in pieces)
        flight: dict[int, tuple[Desc, float]] = {}  # batch id -> (the read, when it started)
        pausing: list[Desc] = []  # failed reads waiting for their retry at `due`
        retried = rounds = landed = landed_at_retry = 0
        nap, due = MIN_NAP_S, 0.0
        try:
            while pieces or flight or pausing:
                if watch is not None and watch.progress.stalled:
                    raise Stalled(f"another pull from the prefill at {peer_session} found it stalled; "
                                  f"{landed} of {count} reads done")
                if pausing and self._clock() >= due:
                    pieces.extendleft(reversed(pausing))
                    pausing = []
                while pieces and self._take(peer_session):
                    d = pieces.popleft()
                    flight[self._submit(peer_session, d)] = (d, self._clock())
                done, failed = [], []
                for batch_id in list(flight):
                    rc = self._status(peer_session, batch_id)
                    if rc in (1, -1):
                        (done if rc == 1 else failed).append(flight.pop(batch_id))
                now = self._clock()
                landed += len(done)
                if done and watch is not None:
                    watch.progressed(now)
                in_flight = sum(d.length for d, _ in flight.values())
                dropped = watch is not None and any(now - started >= watch.bound_s / 2 for _, started in failed)
                if dropped or (watch is not None and watch.expired(now, in_flight)):
                    raise Stalled(f"no read from {peer_session} landed within the pull's stall bound "
                                  f"({watch.bound_s:g} s plus {in_flight} bytes in flight at the measured rate)"
                                  + (f", {len(failed)} dropped by Mooncake for no progress" if dropped else "")
                                  + f"; {landed} of {count} reads done")
                if failed and rounds and (landed == landed_at_retry or rounds >= MAX_RETRIES):
                    raise TransferError(f"{len(failed)} reads from {peer_session} failed again after a retry "
                                        f"(retry {rounds} of at most {MAX_RETRIES}, {retried} reads reissued; "
                                        f"{landed} of {count} reads done)")
                if failed:
                    rounds, retried, landed_at_retry = rounds + 1, retried + len(failed), landed
                    pausing += [d for d, _ in failed]
                    due = now + RETRY_PAUSE_S * 2 ** (rounds - 1)
                if done or failed:
                    nap = MIN_NAP_S
                else:
                    time.sleep(nap)
                    nap = min(2 * nap, MAX_NAP_S)
        except TransferError as exc:
            exc.drain = Drain(self, peer_session, list(flight)) if flight else None
            raise
        return Moved(total, count, retried)

    def close(self) -> None:
        if self._registered:
            self._engine.batch_unregister_memory([a for a, _ in self._registered])
            self._registered = []
