"""One prefill's KV event stream followed into its prefix index, and brought back after every hiccup.

The proxy subscribes (ZMQ SUB) to each prefill's publisher and applies the batches in sequence order. What it
knows must survive its own restart and every break in the stream, so with the prefill's replay endpoint
(vLLM's `replay_endpoint`, a buffer of its last batches) the stream is synced:
- at start, and after the index had to be emptied, it is rebuilt from every batch the buffer still holds;
- after a gap in the sequence, a dropped or silent connection (ZMTP heartbeats unanswered) or its reconnection,
  it continues from the last batch it applied, once the publisher proves it is the same stream: the buffer
  still holds that batch, byte for byte. Otherwise the publisher restarted or the buffer moved past it, and
  the index is rebuilt.
From a break until a sync succeeds the index is not trusted: routing leaves it out (the prefill is chosen by
load), while the live batches still go into it. A sync runs beside the live socket, within limits
(deploy/services/event_replay.py); what arrives live meanwhile is applied after it. Without a replay endpoint
a break empties the index and the stream goes on from the next batch. Either way blocks whose parents went
missing wait as orphans until a full report (the proxy asks for one on every prefill leg) announces the prefix
again. Losing track only costs cache hits, never an answer.

No message and no failure stops a stream for good, nor touches another: each runs on a ZMQ context of its own,
and whatever it raises (a socket error, a defect in handling a message) is counted, logged, empties its index
and subscribes it again after a backoff.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge
from zmq.utils.monitor import parse_monitor_message

from deploy.services.event_replay import LIMITS, ReplayAbandoned, ReplayLimits, replay
from deploy.services.kv_events import (MAX_MESSAGE_BYTES, REFUSED_KINDS, AllBlocksCleared, BlockRemoved,
                                       BlockStored, KVEventBatch, Refused, decode_message)
from deploy.services.prefix_index import PrefixIndex

logger = logging.getLogger("kvpp.proxy")

MAX_SYNC_ROUNDS = 64
"""Replay requests one sync may make: a replay larger than the sockets' high-water marks arrives with holes (ZMQ
drops past them), and each round resumes after the last batch applied."""
IDLE_CHECK_S = 0.5
"""How often an idle stream looks whether a sync is due (asked for from outside, or a retry) or ended."""
SYNC_RETRY_S = 10.0
"""After a failed sync (the replay endpoint did not answer in full), the next one is tried this much later."""
LIVE_HWM = 1000
"""Live messages ZMQ queues for the proxy (the SUB's RCVHWM, ZMQ's default); past it they are dropped: a gap."""
PENDING_MAX = LIVE_HWM
"""Live messages kept while a sync runs, to apply after it; past it they are dropped: a gap, synced next."""
RESUBSCRIBE_S = (0.5, 30.0)
"""A failed stream subscribes again after the first delay, doubled after each failure up to the second; a stream
that applied a batch or synced since its last failure starts again from the first."""
RESET_REASONS = ("gap", "restart", "refused", "disconnected", "cleared", "down", "failed")
SYNC_OUTCOMES = ("continued", "rebuilt", "failed")
FAILURE_CAUSES = ("zmq", "error")
"""What stopped a stream: a ZMQ socket error, or any other exception (a defect, logged with its traceback)."""
FOLLOWED = "followed"


class EventMetrics:
    """The event streams' counters on the proxy's /metrics."""

    def __init__(self, registry: CollectorRegistry):
        self.batches = Counter("kvpp_proxy_kv_event_batches", "KV event batches applied to an instance's index, "
                               "live or replayed.", ["backend"], registry=registry)
        self.replayed = Counter("kvpp_proxy_kv_event_replayed_batches", "Of those, batches read from the "
                                "instance's replay endpoint.", ["backend"], registry=registry)
        self.refused = Counter("kvpp_proxy_kv_event_refused", "KV event messages refused whole (frames, size, "
                               "decode) and stored events left out of their batch (size, invalid, range), by kind: "
                               "frames (not topic, seq, payload), size (past a bound), decode (not vLLM's "
                               "KVEventBatch), invalid (token ids that do not fill the blocks), range (token ids "
                               "or hashes the index cannot hold).", ["backend", "kind"], registry=registry)
        self.skipped = Counter("kvpp_proxy_kv_blocks_skipped", "Stored blocks not indexed: unindexable (LoRA, "
                               "salt, multimodal, second KV group), medium (not the instance's own cache: an offload "
                               "tier or a shared pool), block_size (not the instance's).",
                               ["backend", "reason"], registry=registry)
        self.resets = Counter("kvpp_proxy_kv_index_resets", "An instance's index emptied of its blocks: gap (missed "
                              "batches the replay could not bring back), restart (the publisher started again), "
                              "refused (a message refused), disconnected (the stream dropped or fell silent past the "
                              "heartbeat timeout, with no replay endpoint), cleared (AllBlocksCleared), down (the "
                              "instance left the rotation, with no replay endpoint), failed (the stream failed).",
                              ["backend", "reason"], registry=registry)
        self.syncs = Counter("kvpp_proxy_kv_index_syncs", "Syncs from an instance's replay endpoint, by outcome: "
                             "continued (the stream went on where it broke), rebuilt (from every batch the "
                             "publisher still held), failed (no full answer, or a round abandoned).",
                             ["backend", "outcome"], registry=registry)
        self.abandoned = Counter("kvpp_proxy_kv_replay_abandoned", "Replay rounds abandoned past a limit: batches, "
                                 "bytes or seconds.", ["backend", "limit"], registry=registry)
        self.failures = Counter("kvpp_proxy_kv_event_stream_failures", "An instance's event stream failed and was "
                                "subscribed again, by cause: zmq (a socket error), error (any other exception).",
                                ["backend", "cause"], registry=registry)
        self.restarts = Counter("kvpp_proxy_kv_event_task_restarts", "The task running every event stream ended "
                                "and was started again.", registry=registry)
        self.up = Gauge("kvpp_proxy_kv_event_stream_up", "1 while an instance's event stream is subscribed and "
                        "connected to its publisher.", ["backend"], registry=registry)
        self.trusted = Gauge("kvpp_proxy_kv_index_trusted", "1 while routing reads an instance's index: 0 from a "
                             "break until a sync from its replay endpoint succeeds.", ["backend"], registry=registry)
        self.blocks = Gauge("kvpp_proxy_kv_index_blocks", "Full blocks an instance's index holds.", ["backend"],
                            registry=registry)
        self.orphans = Gauge("kvpp_proxy_kv_index_orphans", "Blocks of an instance waiting for their parent to be "
                             "announced (stored before the proxy listened, or during a break).", ["backend"],
                             registry=registry)


def digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."


class _Broken(Exception):
    """A replay that does not continue the stream the index was built from; the reason labels the reset."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class EventStream:
    """One prefill's event stream on the proxy's event loop, feeding that instance's index."""

    def __init__(self, backend: str, endpoint: str, index: PrefixIndex, metrics: EventMetrics, timeout: float,
                 replay_endpoint: str | None = None, replay_limits: ReplayLimits = ReplayLimits()):
        self.backend, self.endpoint, self.replay_endpoint = backend, endpoint, replay_endpoint
        self.index, self.metrics, self.timeout, self.replay_limits = index, metrics, timeout, replay_limits
        self._last_seq: int | None = None
        """The last batch applied to the index (None: the index starts afresh at the next batch)."""
        self._last_digest = b""
        self._last_live: int | None = None
        """The last live batch seen: live numbers only grow while the publisher lives (across a disconnection
        too: a publisher that restarted behind the same address counts again from 0)."""
        self._synced = False
        """The index holds every batch the publisher still has up to `_last_seq` (or saw its whole stream)."""
        self._replay_failing = False
        """The last sync got no full answer: until one does, a gap empties the index as with no replay endpoint."""
        self._sync_at: float | None = 0.0 if replay_endpoint is not None else None
        """When (time.monotonic()) the stream next syncs from the replay endpoint; None: not asked."""
        self._synced_at = -SYNC_RETRY_S
        """When the last sync ended: a refused message asks for a rebuild no sooner than SYNC_RETRY_S after it."""
        self._syncing = False
        self._pending: list[tuple[int, bytes, KVEventBatch, list[Refused]]] = []
        """Live batches that arrived while a sync ran or was due, to follow once it ends."""
        self._breaks = 0
        """Breaks seen so far: one during a sync leaves the index untrusted after it, and syncs again."""
        self._started: asyncio.Event | None = None
        self._logged: set[str] = set()
        self.progress = 0
        """Batches applied and syncs that succeeded: a stream that made some since its last failure has recovered."""
        self.trusted = replay_endpoint is None
        """Routing reads the index: with a replay endpoint, from a sync that succeeded to the next break."""
        self.up = False
        """The stream is subscribed and connected to its publisher."""
        self._down_why = "not subscribed yet"
        self._untrusted_why = f"not synced from {replay_endpoint} yet"
        for reason in RESET_REASONS:
            metrics.resets.labels(backend, reason)
        for outcome in SYNC_OUTCOMES:
            metrics.syncs.labels(backend, outcome)
        for kind in REFUSED_KINDS:
            metrics.refused.labels(backend, kind)
        for limit in LIMITS:
            metrics.abandoned.labels(backend, limit)
        for cause in FAILURE_CAUSES:
            metrics.failures.labels(backend, cause)
        metrics.up.labels(backend).set(0)
        metrics.trusted.labels(backend).set(int(self.trusted))

    def health(self) -> str:
        """FOLLOWED while the stream is connected to its publisher and its index trusted, else why not."""
        why = [w for w, ok in ((self._down_why, self.up), (self._untrusted_why, self.trusted)) if not ok]
        return "; ".join(why) or FOLLOWED

    def reset(self, reason: str) -> None:
        """Forget what this instance holds."""
        if len(self.index) or self.index.orphans:
            self.metrics.resets.labels(self.backend, reason).inc()
            logger.info("prefill %s: prefix index dropped (%s, %d blocks)", self.backend, reason, len(self.index))
        self.index.clear()
        self._last_seq, self._last_digest, self._synced = None, b"", False
        self._gauges()

    def broke(self, reason: str) -> None:
        """The stream may have missed batches (a gap, a dropped connection, the instance out of rotation, a failure):
        with a replay endpoint the index is not trusted until a sync finds out what (one running now does not
        count), without one the index is emptied."""
        if self.replay_endpoint is None:
            self.reset(reason)
            return
        self._breaks += 1
        self._distrust(f"{reason}: not synced from {self.replay_endpoint} since")
        self._resync()

    # -- applying live batches --------------------------------------------------------------------------
    def handle(self, frames: list[bytes]) -> None:
        """One live PUB message: applied if it follows the last batch applied, kept for after the sync when one runs
        or is due. A message or event the index cannot hold is refused and counted, not raised; anything raised is a
        defect, which the stream's loop counts and recovers from."""
        try:
            seq, batch, refused = decode_message(frames)
        except Refused as whole:
            self._refused(whole)
            return
        restarted = self._last_live is not None and seq <= self._last_live
        self._last_live = seq
        if restarted:  # its count began again: its cache is new
            if self._syncing:
                self.broke("restart")  # the sync running cannot tell; the next one will
            else:
                self.reset("restart")
                self._resync()
        if self._syncing or self.sync_due(time.monotonic()):
            self._defer(seq, frames[2], batch, refused)
            return
        self._follow(seq, frames[2], batch, refused)

    def _follow(self, seq: int, payload: bytes, batch: KVEventBatch, refused: list[Refused]) -> None:
        if self._last_seq is not None:
            if seq <= self._last_seq:
                return  # a replay applied it already
            if seq > self._last_seq + 1:
                if self._synced and self.replay_endpoint is not None and not self._replay_failing:
                    self.broke("gap")
                    self._defer(seq, payload, batch, refused)
                    return
                self.reset("gap")
        self._apply(seq, payload, batch, refused)

    def _defer(self, seq: int, payload: bytes, batch: KVEventBatch, refused: list[Refused]) -> None:
        if len(self._pending) < PENDING_MAX:
            self._pending.append((seq, payload, batch, refused))

    def _drain(self) -> None:
        """Follow the live batches kept while a sync ran (those it replayed are skipped)."""
        pending, self._pending = self._pending, []
        for item in pending:
            if self.sync_due(time.monotonic()):
                self._defer(*item)
            else:
                self._follow(*item)

    def _count(self, refused: Refused) -> None:
        """Count and log (once per kind: a flood of garbage must not flood the log) a message or event refused."""
        self.metrics.refused.labels(self.backend, refused.kind).inc()
        if refused.kind not in self._logged:
            self._logged.add(refused.kind)
            logger.warning("prefill %s: refused a KV event message or event from %s (%s: %s); further ones of "
                           "this kind are only counted", self.backend, self.endpoint, refused.kind, refused)

    def _refused(self, refused: Refused) -> None:
        """A live message that is not a batch: the index has lost a batch, and is emptied (and rebuilt from the
        replay endpoint, no sooner than SYNC_RETRY_S after the last sync: garbage must not make a stream of
        replays). While a sync runs it is only counted: the replay, or the gap after it, brings that batch back."""
        self._count(refused)
        if not self._syncing:
            self.reset("refused")
            self._resync(not_before=self._synced_at + SYNC_RETRY_S)

    def _resync(self, not_before: float = 0.0) -> None:
        """With a replay endpoint, sync from it before the next live batch (or, `not_before` a later moment, from
        then on; until then live batches are applied as they come)."""
        if self.replay_endpoint is not None:
            self._sync_at = min(self._sync_at if self._sync_at is not None else not_before, not_before)

    def _apply(self, seq: int, payload: bytes, batch: KVEventBatch, refused: list[Refused]) -> None:
        for problem in refused:
            self._count(problem)
        if self._last_seq is None and seq == 0:
            self._synced = True  # the publisher's whole stream, from its first batch
        for event in batch.events:
            if isinstance(event, BlockStored):
                skipped = self.index.store(event)
                if skipped == "block_size" and self.index.fixed_block_size is not None:
                    self._count(Refused("block_size", f"a BlockStored of {event.block_size}-token blocks, where the "
                                                      f"prefills' block size is {self.index.fixed_block_size}"))
                elif skipped:
                    self.metrics.skipped.labels(self.backend, skipped).inc(len(event.block_hashes))
            elif isinstance(event, BlockRemoved):
                self.index.remove(event)
            elif isinstance(event, AllBlocksCleared):
                self.reset("cleared")
                self._synced = True  # an empty cache: nothing older to learn
        self._last_seq, self._last_digest = seq, digest(payload)
        self.progress += 1
        self.metrics.batches.labels(self.backend).inc()
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.blocks.labels(self.backend).set(len(self.index))
        self.metrics.orphans.labels(self.backend).set(self.index.orphans)

    def _distrust(self, why: str) -> None:
        self.trusted, self._untrusted_why = False, why
        self.metrics.trusted.labels(self.backend).set(0)

    def _connected(self, up: bool, why: str = "") -> None:
        self.up = up
        if not up:
            self._down_why = why
        self.metrics.up.labels(self.backend).set(int(up))

    # -- syncing from the replay endpoint ---------------------------------------------------------------
    async def started(self) -> None:
        """Return once the stream's first sync has ended (at once without a replay endpoint): a proxy that just
        started knows then what the instance held before."""
        if self.replay_endpoint is None:
            return
        if self._started is None:
            self._started = asyncio.Event()
        await self._started.wait()

    def sync_due(self, now: float) -> bool:
        return self._sync_at is not None and now >= self._sync_at

    async def sync(self, context: zmq.asyncio.Context) -> str:
        """Bring the index up to the publisher's last batch from its replay endpoint: continue from the last batch
        applied when the publisher still holds it unchanged, else rebuild from everything it holds; then follow the
        live batches that arrived meanwhile. Returns the outcome; the index is trusted after it only if it
        succeeded and nothing broke the stream meanwhile. A failed sync leaves the index untrusted, following the
        live stream, and is tried again a while later."""
        self._syncing, breaks = True, self._breaks
        try:
            outcome = await self._sync(context)
        finally:
            self._syncing = False
            self._synced_at = time.monotonic()
            if self._started is None:
                self._started = asyncio.Event()
            self._started.set()
        if outcome != "failed" and breaks == self._breaks:
            self.trusted = True
            self.metrics.trusted.labels(self.backend).set(1)
        self._drain()
        return outcome

    async def _sync(self, context: zmq.asyncio.Context) -> str:
        self._sync_at = None
        if not self._synced:
            self.reset("gap")
        outcome = "continued" if self._last_seq is not None else "rebuilt"
        try:
            for _ in range(MAX_SYNC_ROUNDS):
                before = self._last_seq
                try:
                    if await self._replay_round(context):
                        break
                except _Broken as broken:
                    self.reset(broken.reason)
                    outcome = "rebuilt"
                    continue
                if self._last_seq == before:
                    raise TimeoutError("replays with holes and no progress")
            else:
                raise TimeoutError(f"still holes after {MAX_SYNC_ROUNDS} replays")
        except ReplayAbandoned as abandoned:
            self.metrics.abandoned.labels(self.backend, abandoned.limit).inc()
            return self._sync_failed(f"replay abandoned: {abandoned}")
        except (TimeoutError, zmq.ZMQError) as exc:
            return self._sync_failed(str(exc) or f"no answer within {self.timeout:g} s")
        self._synced, self._replay_failing = True, False
        self._last_live = self._last_seq  # the publisher's count now (a restarted one's may be below the old)
        self.progress += 1
        self.metrics.syncs.labels(self.backend, outcome).inc()
        logger.info("prefill %s: prefix index %s from its replay endpoint (%d blocks, last batch %s)", self.backend,
                    "caught up" if outcome == "continued" else "rebuilt", len(self.index), self._last_seq)
        return outcome

    def _sync_failed(self, why: str) -> str:
        self.metrics.syncs.labels(self.backend, "failed").inc()
        logger.warning("prefill %s: no full replay from %s (%s); its index is left out of routing until a sync "
                       "succeeds, follows the live stream and syncs again in %.0f s", self.backend,
                       self.replay_endpoint, why, SYNC_RETRY_S)
        self._replay_failing = True
        self._distrust(f"sync from {self.replay_endpoint} failed: {why}")
        self._resync(not_before=time.monotonic() + SYNC_RETRY_S)  # or sooner, if a break asked for one meanwhile
        return "failed"

    async def _replay_round(self, context: zmq.asyncio.Context) -> bool:
        """Ask for the batches from the last one applied on (every batch held, when starting afresh) and apply those
        that follow it; True when the replay ended with no hole. Raises _Broken when the publisher no longer holds
        the last batch applied as it was applied."""
        verified = self._last_seq is None
        complete = True
        start = 0 if self._last_seq is None else self._last_seq
        async for frames in replay(context, self.replay_endpoint, start, self.timeout, self.replay_limits):
            if frames is None:  # it fell silent before its end marker: the end was dropped
                complete = False
                break
            try:
                seq, batch, refused = decode_message(frames)
            except Refused as whole:
                self._count(whole)
                self.reset("refused")  # the index starts afresh at the next batch
                verified = True
                continue
            if not verified:
                if seq != self._last_seq or digest(frames[2]) != self._last_digest:
                    raise _Broken("restart" if seq == self._last_seq else "gap")
                verified = True
            elif self._last_seq is None or seq == self._last_seq + 1:
                self._apply(seq, frames[2], batch, refused)
                self.metrics.replayed.labels(self.backend).inc()
            elif seq > self._last_seq:
                complete = False  # a hole: the rest of this replay is drained, then asked for again
        if not verified:  # the buffer holds nothing from the last batch applied on
            raise _Broken("gap")
        return complete

    # -- the socket loop --------------------------------------------------------------------------------
    async def run(self, context: zmq.asyncio.Context) -> None:
        """Receive until cancelled; the socket reconnects by itself after a drop, and a sync follows. A sync runs as
        a task beside this loop, which goes on reading the live socket (keeping what arrives for after it) and
        the connection's events; what the sync raises, this raises."""
        sock = context.socket(zmq.SUB)
        interval_ms = max(100, int(self.timeout * 1000) // 3)
        sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.timeout * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL, 500)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, LIVE_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        self._connected(False, f"connecting to {self.endpoint}")
        syncing: asyncio.Task | None = None
        try:
            while True:
                if syncing is None and self.sync_due(time.monotonic()):
                    syncing = asyncio.create_task(self.sync(context))
                ready = dict(await poller.poll(timeout=IDLE_CHECK_S * 1000))
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        self._connected(False, f"disconnected from {self.endpoint}, reconnecting")
                        self.broke("disconnected")
                    elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        self._connected(True)
                        self._resync()  # what was missed while the connection was down?
                if sock in ready:
                    self.handle(await sock.recv_multipart())
                if syncing is not None and syncing.done():
                    done, syncing = syncing, None
                    done.result()
        finally:
            if syncing is not None:
                syncing.cancel()
                await asyncio.gather(syncing, return_exceptions=True)
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            self._connected(False, "not subscribed")

    def failed(self, exc: Exception, delay: float) -> None:
        """The stream's loop raised `exc`: counted, logged, and the stream subscribes again after `delay`."""
        cause = "zmq" if isinstance(exc, zmq.ZMQError) else "error"
        self.metrics.failures.labels(self.backend, cause).inc()
        logger.error("prefill %s: KV event stream %s failed (%s); its index is dropped and it subscribes again in "
                     "%g s", self.backend, self.endpoint, _short(exc), delay, exc_info=cause == "error")
        self.interrupted(f"stream failed ({_short(exc)}), subscribing again in {delay:g} s")

    def interrupted(self, why: str) -> None:
        """The stream stopped (failed, or the task running it ended) and will start again: whatever it was doing
        may be half done, so the index starts afresh (rebuilt by a sync, with a replay endpoint)."""
        self._pending.clear()
        self._syncing = False
        self.reset("failed")
        self.broke("failed")
        self._connected(False, why)


async def run_streams(streams: list[EventStream]) -> None:
    """Every stream until cancelled, each on a ZMQ context of its own: one that fails is counted, logged and
    subscribed again after a backoff, and never closes another's sockets."""
    async with asyncio.TaskGroup() as group:
        for stream in streams:
            group.create_task(_keep_running(stream))


async def _keep_running(stream: EventStream) -> None:
    delay = RESUBSCRIBE_S[0]
    while True:
        context = zmq.asyncio.Context()
        progress = stream.progress
        try:
            await stream.run(context)
        except Exception as exc:  # a failure costs this stream's hits for a while, never the proxy or the others
            if stream.progress != progress:
                delay = RESUBSCRIBE_S[0]
            stream.failed(exc, delay)
        finally:
            context.destroy(linger=0)
        await asyncio.sleep(delay)
        delay = min(2 * delay, RESUBSCRIBE_S[1])
