"""Thin wrapper over the Mooncake TransferEngine for pulling KV blocks, bounded by progress.

Measured transport facts shape it (bench/pd_transfer.py and bench/pd_stall.py measure them): every
copy costs ~75 us, so contiguous block runs are coalesced; one huge copy is moved by too few engine
threads (a 300 MB read took 0.26 s as one entry, 0.13 s as 256 entries of ~1.2 MB), so merged runs
are cut into pieces of at most `max_entry_bytes`. Each piece is its own asynchronous read, and at
most one per Mooncake TCP lane of a peer is in flight (MC_TCP_LANES_PER_PEER), so no piece waits in
Mooncake's queue: a read Mooncake abandoned at its timeout still ran its queued pieces later, into
the same memory, once the peer woke. A pull whose pieces stop completing is given up at its
`StallWatch` bound. However a pull ends early (given up, a read failing, the binding raising), the
reads it has in flight may still write into their destinations: they leave in a `Drain`, and until it
ended (Mooncake ended each read, or its own bound on them expired: `MooncakeTransfer.engine_bound_s`)
the destinations must not be handed back. A lane stays counted as long as Mooncake says its read runs.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from connectors.common.hosts import join_host_port, mooncake_family
from connectors.common.mooncake_env import bound_progress, progress_timeout_s

from connectors.mooncake.affinity import run_unpinned
from connectors.mooncake.stall import StallWatch

DEFAULT_MAX_ENTRY_BYTES = 1 << 20
DEFAULT_LANES = 4  # Mooncake's TCP lanes per peer by default; MC_TCP_LANES_PER_PEER sets 1-16
MAX_LANES = 16
MIN_NAP_S, MAX_NAP_S = 50e-6, 250e-6
"""Polling pause while no read ended: doubles from the first to the second. A lane whose read ended
idles until the next poll, so the pause stays well under one 1 MiB read's time on a fast link
(bench/pd_transfer.py measures the pull against raw reads)."""
MAX_RETRIES = 3
"""Times a pull issues again the reads that failed at once. A prefill resumed after a stall still closes for a
moment the connections its peer dropped, and a read meeting one fails at once (a clean-clone run: 2 of 162
reads failed twice, right after a stall): so a failed read is issued again after a pause (RETRY_PAUSE_S, doubled
each time) as long as some read landed since the last retry. A peer whose reads all fail (dead, refusing) fails
the pull at its first retry."""
RETRY_PAUSE_S = 0.02
DRAIN_MARGIN_S = 1.0
"""Beyond Mooncake's TCP progress timeout, until a read it drops has ended: it counts the timeout in whole seconds
(a 2 s timeout dropped reads 2.00-2.15 s after the stall began, bench/results/pd_stall.json)."""


class TransferError(RuntimeError):
    """A pull failed (a transfer-engine call failed or raised); the caller turns it into a load failure, never a
    crash. `drain` holds the pull's reads still in flight (None: none), whose destinations the engine may
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
    """The reads a pull left in flight (given up, failed, or the binding raised): the engine may still write into
    their destinations until each has ended (completed or failed), or until the engine's own bound on them
    (`MooncakeTransfer.engine_bound_s`, from when the pull ended) expired. Reads whose state the binding could not
    say (a start or a status check that raised) count until that bound. Poll `ended()` from one thread."""

    def __init__(self, transfer: MooncakeTransfer, peer_session: str, batch_ids: list[int], unknown: int = 0) -> None:
        self._transfer = transfer
        self._peer = peer_session
        self._ids = batch_ids
        self._unknown = unknown
        self.deadline = transfer.clock() + transfer.engine_bound_s
        self.outlived = 0
        """Reads Mooncake still called in flight when its bound expired (0 unless `ended()` said so at the bound)."""

    def __len__(self) -> int:
        return len(self._ids) + self._unknown

    def ended(self) -> bool:
        """Whether no read of the pull can write any more: each ended, or the engine's bound expired. At the
        bound, the reads Mooncake still calls in flight keep their lanes until it says they ended (`outlived`);
        the lanes of reads it could not say anything about are given back."""
        self._ids = [i for i in self._ids if not self._transfer._ended(self._peer, i)]
        if not self:
            return True
        if self._transfer.clock() < self.deadline:
            return False
        self.outlived = len(self._ids)
        self._transfer._straggle(self._peer, self._ids)
        for _ in range(self._unknown):
            self._transfer._release(self._peer)
        self._ids, self._unknown = [], 0
        return True


class MooncakeTransfer:
    """One TransferEngine in P2P-handshake mode, with registered regions and reads bounded by progress.

    `progress_timeout_s` (a puller's stall bound) bounds Mooncake's TCP progress timeout for this
    process (connectors.common.mooncake_env). `other_bound_s` stands for Mooncake's bound on a read over
    a transport without that timeout (not tcp)."""

    def __init__(
        self,
        host: str,
        protocol: str = "tcp",
        device_name: str = "",
        progress_timeout_s: float | None = None,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
        clock: Callable[[], float] = time.monotonic,
        other_bound_s: float = 30.0,
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
        self.other_bound_s = other_bound_s
        self.clock = clock
        self.lanes = lanes_per_peer()
        self._in_flight: dict[str, int] = {}  # peer session -> reads in flight on it, at most `lanes`
        self._lock = threading.Lock()
        self._stragglers: dict[str, list[int]] = {}  # peer session -> reads that outlived a drain's bound
        self._straggler_lock = threading.Lock()
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

    @property
    def engine_bound_s(self) -> float:
        """How long after a pull ended Mooncake itself has ended every read the pull left in flight. Over tcp: its
        TCP progress timeout in force in this process (connectors.common.mooncake_env; the connector's stall bound
        rounded up unless the environment set another), which drops a read whose connection moves nothing for
        that long (each read has a lane of its own: none waits in Mooncake's queue), plus DRAIN_MARGIN_S. Over
        another transport, which has no such timeout: `other_bound_s`."""
        if self.protocol != "tcp":
            return self.other_bound_s
        return progress_timeout_s() + DRAIN_MARGIN_S

    # ---- reads in flight, at most one per lane of a peer ----------------------------------------
    def _take(self, peer: str) -> bool:
        if peer in self._stragglers:
            self._reap(peer)
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

    def _straggle(self, peer: str, batch_ids: list[int]) -> None:
        """Reads a drain left at the engine's bound while Mooncake still calls them in flight: their lanes stay
        taken until it says each ended (`_take` asks)."""
        if batch_ids:
            with self._straggler_lock:
                self._stragglers.setdefault(peer, []).extend(batch_ids)

    def _reap(self, peer: str) -> None:
        with self._straggler_lock:
            left = [i for i in self._stragglers.pop(peer, []) if not self._ended(peer, i)]
            if left:
                self._stragglers[peer] = left

    def _ended(self, peer: str, batch_id: int) -> bool:
        """Whether Mooncake ended the read (its lane given back); a status check that raises says nothing."""
        try:
            return self._status(peer, batch_id) in (1, -1)
        except Exception:  # the binding cannot say: the read may still run
            return False

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
        or whose prefill another pull found stalled, raises Stalled and starts no further read. Whatever ends
        the pull early, the binding raising included, raises a TransferError carrying the reads still in
        flight (`TransferError.drain`)."""
        pieces = deque(cut_entries(coalesce(descs), self.max_entry_bytes))
        count, total = len(pieces), sum(d.length for d in pieces)
        flight: dict[int, tuple[Desc, float]] = {}  # batch id -> (the read, when it started)
        pausing: list[Desc] = []  # failed reads waiting for their retry at `due`
        retried = rounds = landed = landed_at_retry = starting = 0
        nap, due = MIN_NAP_S, 0.0
        try:
            while pieces or flight or pausing:
                if watch is not None and watch.progress.stalled:
                    raise Stalled(f"another pull from the prefill at {peer_session} found it stalled; "
                                  f"{landed} of {count} reads done")
                if pausing and self.clock() >= due:
                    pieces.extendleft(reversed(pausing))
                    pausing = []
                while pieces and self._take(peer_session):
                    d = pieces.popleft()
                    starting = 1  # a start that raises leaves unknown whether the read runs: its lane stays taken
                    batch_id = self._engine.batch_transfer_async_read(peer_session, [d.local], [d.remote], [d.length])
                    starting = 0
                    if not batch_id:
                        self._release(peer_session)
                        raise TransferError(f"Mooncake could not start a read from {peer_session} "
                                            "(batch_transfer_async_read returned 0: the peer's transfer engine is "
                                            "unknown or unreachable)")
                    flight[batch_id] = (d, self.clock())
                done, failed = [], []
                for batch_id in list(flight):
                    rc = self._status(peer_session, batch_id)
                    if rc in (1, -1):
                        (done if rc == 1 else failed).append(flight.pop(batch_id))
                now = self.clock()
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
        except Exception as exc:
            drain = Drain(self, peer_session, list(flight), starting) if flight or starting else None
            if isinstance(exc, TransferError):
                exc.drain = drain
                raise
            raise TransferError(f"the Mooncake binding raised {type(exc).__name__} during a pull from {peer_session} "
                                f"({exc}); {landed} of {count} reads done", drain) from exc
        return Moved(total, count, retried)

    def close(self) -> None:
        if self._registered:
            self._engine.batch_unregister_memory([a for a, _ in self._registered])
            self._registered = []
