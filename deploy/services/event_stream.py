"""One prefill's KV event stream followed into its prefix index, and brought back after every hiccup.

The proxy subscribes (ZMQ SUB) to each prefill's publisher and applies the batches in sequence order. What it
knows must survive its own restart and every break in the stream, so with the prefill's replay endpoint
(vLLM's `replay_endpoint`, a buffer of its last batches) the stream is synced:
- at start, and after the index had to be emptied, it is rebuilt from every batch the buffer still holds;
- after a gap in the sequence, a dropped or silent connection (ZMTP heartbeats unanswered) or its reconnection,
  it continues from the last batch it applied, once the publisher proves it is the same stream: the buffer
  still holds that batch, byte for byte. Otherwise the publisher restarted or the buffer moved past it, and
  the index is rebuilt.
Without a replay endpoint a break empties the index and the stream goes on from the next batch. Either way
blocks whose parents went missing wait as orphans until a full report (the proxy asks for one on every prefill
leg) announces the prefix again. Losing track only costs cache hits, never an answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge
from zmq.utils.monitor import parse_monitor_message

from deploy.services.kv_events import (END_OF_REPLAY, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                       Refused, decode_message)
from deploy.services.prefix_index import PrefixIndex

logger = logging.getLogger("kvpp.proxy")

MAX_SYNC_ROUNDS = 64
"""Replay requests one sync may make: a replay larger than the sockets' high-water marks arrives with holes (ZMQ
drops past them), and each round resumes after the last batch applied."""
IDLE_CHECK_S = 0.5
"""How often an idle stream looks whether a sync is due (asked for from outside, or a retry)."""
SYNC_RETRY_S = 10.0
"""After a failed sync (the replay endpoint did not answer in full), the next one is tried this much later."""
REPLAY_SILENCE_S = 1.0
"""A replay that sent batches and then nothing for this long has ended (ZMQ dropped its end marker with
batches past the high-water mark)."""
RESET_REASONS = ("gap", "restart", "refused", "disconnected", "cleared", "down")
SYNC_OUTCOMES = ("continued", "rebuilt", "failed")


class EventMetrics:
    """The event streams' counters on the proxy's /metrics."""

    def __init__(self, registry: CollectorRegistry):
        self.batches = Counter("kvpp_proxy_kv_event_batches", "KV event batches applied to an instance's index, "
                               "live or replayed.", ["backend"], registry=registry)
        self.replayed = Counter("kvpp_proxy_kv_event_replayed_batches", "Of those, batches read from the "
                                "instance's replay endpoint.", ["backend"], registry=registry)
        self.refused = Counter("kvpp_proxy_kv_event_refused", "KV event messages refused, by kind: frames (not "
                               "topic, seq, payload), decode (not vLLM's KVEventBatch), invalid (inconsistent).",
                               ["backend", "kind"], registry=registry)
        self.skipped = Counter("kvpp_proxy_kv_blocks_skipped", "Stored blocks not indexed: unindexable (LoRA, "
                               "salt, multimodal, second KV group), medium (not the instance's own cache: an offload "
                               "tier or a shared pool), block_size (not the instance's).",
                               ["backend", "reason"], registry=registry)
        self.resets = Counter("kvpp_proxy_kv_index_resets", "An instance's index emptied of its blocks: gap (missed "
                              "batches the replay could not bring back), restart (the publisher started again), "
                              "refused (a message refused), disconnected (the stream dropped or fell silent past the "
                              "heartbeat timeout, with no replay endpoint), cleared (AllBlocksCleared), down (the "
                              "instance left the rotation).", ["backend", "reason"], registry=registry)
        self.syncs = Counter("kvpp_proxy_kv_index_syncs", "Syncs from an instance's replay endpoint, by outcome: "
                             "continued (the stream went on where it broke), rebuilt (from every batch the "
                             "publisher still held), failed (no full answer).", ["backend", "outcome"],
                             registry=registry)
        self.blocks = Gauge("kvpp_proxy_kv_index_blocks", "Full blocks an instance's index holds.", ["backend"],
                            registry=registry)
        self.orphans = Gauge("kvpp_proxy_kv_index_orphans", "Blocks of an instance waiting for their parent to be "
                             "announced (stored before the proxy listened, or during a break).", ["backend"],
                             registry=registry)


def digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class _Broken(Exception):
    """A replay that does not continue the stream the index was built from; the reason labels the reset."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class EventStream:
    """One prefill's event stream on the proxy's event loop, feeding that instance's index."""

    def __init__(self, backend: str, endpoint: str, index: PrefixIndex, metrics: EventMetrics, timeout: float,
                 replay_endpoint: str | None = None):
        self.backend, self.endpoint, self.replay_endpoint = backend, endpoint, replay_endpoint
        self.index, self.metrics, self.timeout = index, metrics, timeout
        self._last_seq: int | None = None
        """The last batch applied to the index (None: the index starts afresh at the next batch)."""
        self._last_digest = b""
        self._last_live: int | None = None
        """The last live batch seen: live numbers only grow while the publisher lives."""
        self._synced = False
        """The index holds every batch the publisher still has up to `_last_seq` (or saw its whole stream)."""
        self._replay_failing = False
        """The last sync got no full answer: until one does, a gap empties the index as with no replay endpoint."""
        self._sync_at: float | None = 0.0 if replay_endpoint is not None else None
        """When (the event loop's clock) the stream next syncs from the replay endpoint; None: not asked."""
        self._started: asyncio.Event | None = None
        self._logged: set[str] = set()
        for reason in RESET_REASONS:
            metrics.resets.labels(backend, reason)
        for outcome in SYNC_OUTCOMES:
            metrics.syncs.labels(backend, outcome)

    def reset(self, reason: str) -> None:
        """Forget what this instance holds."""
        if len(self.index) or self.index.orphans:
            self.metrics.resets.labels(self.backend, reason).inc()
            logger.info("prefill %s: prefix index dropped (%s, %d blocks)", self.backend, reason, len(self.index))
        self.index.clear()
        self._last_seq, self._last_digest, self._synced = None, b"", False
        self._gauges()

    def broke(self, reason: str) -> None:
        """The stream may have missed batches (a gap, a dropped connection, the instance out of rotation): with a
        replay endpoint the next sync finds out what, without one the index is emptied."""
        if self.replay_endpoint is None:
            self.reset(reason)
        self._resync()
        if reason in ("disconnected", "down"):
            self._last_live = None  # a new publisher may be behind the same address

    # -- applying live batches --------------------------------------------------------------------------
    def handle(self, frames: list[bytes]) -> None:
        """One live PUB message: applied if it follows the last batch applied; never raises."""
        try:
            seq, batch = decode_message(frames)
            if seq < 0:
                raise Refused("frames", f"sequence number {seq}")
        except Refused as refused:
            self._refused(refused)
            return
        if self._last_live is not None and seq <= self._last_live:
            self.reset("restart")  # its count began again: its cache is new
            self._resync()
        self._last_live = seq
        if self._sync_at == 0.0:
            return  # the sync about to run replays this batch too
        if self._last_seq is not None:
            if seq <= self._last_seq:
                return  # a replay applied it already
            if seq > self._last_seq + 1:
                if self._synced and self.replay_endpoint is not None and not self._replay_failing:
                    self.broke("gap")
                    return
                self.reset("gap")
        self._apply(seq, frames[2], batch)

    def _refused(self, refused: Refused) -> None:
        """Count and log (once per kind: a flood of garbage must not flood the log) a message that cannot be
        applied; the index has lost a batch."""
        self.metrics.refused.labels(self.backend, refused.kind).inc()
        if refused.kind not in self._logged:
            self._logged.add(refused.kind)
            logger.warning("prefill %s: refused a KV event message from %s (%s: %s); its prefix index is "
                           "dropped", self.backend, self.endpoint, refused.kind, refused)
        self.reset("refused")
        self._resync()

    def _resync(self) -> None:
        """With a replay endpoint, rebuild the index from it before the next live batch."""
        if self.replay_endpoint is not None:
            self._sync_at = 0.0

    def _apply(self, seq: int, payload: bytes, batch: KVEventBatch) -> None:
        if self._last_seq is None and seq == 0:
            self._synced = True  # the publisher's whole stream, from its first batch
        for event in batch.events:
            if isinstance(event, BlockStored):
                skipped = self.index.store(event)
                if skipped:
                    self.metrics.skipped.labels(self.backend, skipped).inc(len(event.block_hashes))
            elif isinstance(event, BlockRemoved):
                self.index.remove(event)
            elif isinstance(event, AllBlocksCleared):
                self.reset("cleared")
                self._synced = True  # an empty cache: nothing older to learn
        self._last_seq, self._last_digest = seq, digest(payload)
        self.metrics.batches.labels(self.backend).inc()
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.blocks.labels(self.backend).set(len(self.index))
        self.metrics.orphans.labels(self.backend).set(self.index.orphans)

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
        applied when the publisher still holds it unchanged, else rebuild from everything it holds. Returns the
        outcome; a failed sync keeps what the index knows and is tried again a while later."""
        try:
            return await self._sync(context)
        finally:
            if self._started is None:
                self._started = asyncio.Event()
            self._started.set()

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
                    raise asyncio.TimeoutError("replays with holes and no progress")
            else:
                raise asyncio.TimeoutError(f"still holes after {MAX_SYNC_ROUNDS} replays")
        except (asyncio.TimeoutError, zmq.ZMQError) as exc:
            self.metrics.syncs.labels(self.backend, "failed").inc()
            logger.warning("prefill %s: no full replay from %s (%s); the index keeps what it learned, follows the live "
                           "stream and syncs again in %.0f s", self.backend, self.replay_endpoint,
                           str(exc) or f"no answer within {self.timeout:g} s", SYNC_RETRY_S)
            self._replay_failing = True
            self._sync_at = asyncio.get_running_loop().time() + SYNC_RETRY_S
            return "failed"
        self._synced, self._sync_at, self._replay_failing = True, None, False
        self.metrics.syncs.labels(self.backend, outcome).inc()
        logger.info("prefill %s: prefix index %s from its replay endpoint (%d blocks, last batch %s)", self.backend,
                    "caught up" if outcome == "continued" else "rebuilt", len(self.index), self._last_seq)
        return outcome

    async def _replay_round(self, context: zmq.asyncio.Context) -> bool:
        """Ask for the batches from the last one applied on (every batch held, when starting afresh) and apply those
        that follow it; True when the replay ended with no hole. Raises _Broken when the publisher no longer holds
        the last batch applied as it was applied."""
        verified = self._last_seq is None
        complete = True
        start = 0 if self._last_seq is None else self._last_seq
        async for frames in _replay(context, self.replay_endpoint, start, self.timeout):
            if frames is None:  # it fell silent before its end marker: the end was dropped
                complete = False
                break
            try:
                seq, batch = decode_message(frames)
            except Refused as refused:
                self._refused(refused)  # the index starts afresh at the next batch
                verified = True
                continue
            if not verified:
                if seq != self._last_seq or digest(frames[2]) != self._last_digest:
                    raise _Broken("restart" if seq == self._last_seq else "gap")
                verified = True
            elif self._last_seq is None or seq == self._last_seq + 1:
                self._apply(seq, frames[2], batch)
                self.metrics.replayed.labels(self.backend).inc()
            elif seq > self._last_seq:
                complete = False  # a hole: the rest of this replay is drained, then asked for again
        if not verified:  # the buffer holds nothing from the last batch applied on
            raise _Broken("gap")
        return complete

    # -- the socket loop --------------------------------------------------------------------------------
    async def run(self, context: zmq.asyncio.Context) -> None:
        """Receive until cancelled; the socket reconnects by itself after a drop, and a sync follows."""
        sock = context.socket(zmq.SUB)
        interval_ms = max(100, int(self.timeout * 1000) // 3)
        sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.timeout * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL, 500)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        loop = asyncio.get_running_loop()
        try:
            while True:
                if self.sync_due(loop.time()):
                    await self.sync(context)
                ready = dict(await poller.poll(timeout=IDLE_CHECK_S * 1000))
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
                    if event == zmq.EVENT_DISCONNECTED:
                        self.broke("disconnected")
                    elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self.replay_endpoint is not None:
                        self._sync_at = 0.0  # what was missed while the connection was down?
                if sock in ready:
                    self.handle(await sock.recv_multipart())
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)


async def _replay(context: zmq.asyncio.Context, endpoint: str, start: int,
                  timeout: float) -> AsyncIterator[list[bytes] | None]:
    """The messages (topic, seq, payload) a publisher's replay endpoint sends for the batches from `start` on,
    until its end marker, or None once some came and then nothing for REPLAY_SILENCE_S (ZMQ dropped the rest);
    asyncio.TimeoutError when nothing comes within `timeout`."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)  # what the publisher sends must not be dropped on this side
    sock.connect(endpoint)
    end = END_OF_REPLAY.to_bytes(8, "big", signed=True)
    wait = timeout
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            if not await sock.poll(wait * 1000):
                if wait == timeout:
                    raise asyncio.TimeoutError()
                yield None
                return
            frames = await sock.recv_multipart()
            frames = frames[1:] if frames[:1] == [b""] else frames  # a wrong shape is refused by the caller
            if len(frames) == 3 and frames[1] == end:
                return
            wait = min(timeout, REPLAY_SILENCE_S)
            yield frames
    finally:
        sock.close(linger=0)


async def run_streams(streams: list[EventStream]) -> None:
    """Every stream on one ZMQ context until cancelled; a stream that fails is logged and started again."""
    context = zmq.asyncio.Context()
    try:
        await asyncio.gather(*(_keep_running(s, context) for s in streams))
    finally:
        context.destroy(linger=0)


async def _keep_running(stream: EventStream, context: zmq.asyncio.Context) -> None:
    while True:
        try:
            await stream.run(context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a ZMQ error must cost hits, never the proxy
            logger.warning("prefill %s: KV event stream %s failed (%s); subscribing again", stream.backend,
                           stream.endpoint, exc)
            stream.forget("disconnected")
            await asyncio.sleep(1.0)
