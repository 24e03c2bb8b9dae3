"""What each prefill holds in its prefix cache, as the proxy learns it from vLLM's KV cache events.

A prefill started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`
publishes every block its scheduler adds to or evicts from the prefix cache over ZMQ PUB, as frames
(topic, 8-byte big-endian sequence number, msgpack `KVEventBatch`). The proxy subscribes to each prefill's
endpoint and keeps, per instance, the prefixes it holds, keyed by the proxy's own chained hash over the
blocks' token ids: vLLM's block hashes depend on its hash function and seed, which the proxy neither knows
nor needs. Each vLLM hash is mapped to the proxy's key per instance, so removals and parents resolve.

Losing track can only cost cache hits: a message that does not decode, a sequence gap, a connection that
dropped or went silent past the heartbeat timeout, or AllBlocksCleared empties that instance's index, which
fills again from the next events; the proxy then routes that instance's requests by load.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
from array import array
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Gauge

logger = logging.getLogger("kvpp.proxy")

Hash = bytes | int
"""vLLM's external block hash: sha256 bytes, or an int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES."""
ROOT = b""
"""The proxy's key of the empty prefix, parent of every first block."""
SEQ_BYTES = 8


# -- vLLM 0.32's wire format (vllm/distributed/kv_events.py), the fields the index reads -------------------
class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


class Refused(ValueError):
    """A message the proxy cannot apply; `kind` labels it on /metrics and in the log."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


def decode_message(frames: list[bytes]) -> tuple[int, KVEventBatch]:
    """(sequence number, batch) of one PUB message, every event checked for what the index relies on."""
    if len(frames) != 3:
        raise Refused("frames", f"{len(frames)} frames, not (topic, seq, payload)")
    _topic, seq, payload = frames
    if len(seq) != SEQ_BYTES:
        raise Refused("frames", f"a sequence frame of {len(seq)} bytes, not {SEQ_BYTES}")
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise Refused("decode", str(exc)) from None
    for event in batch.events:
        if isinstance(event, BlockStored) and (
                event.block_size <= 0 or len(event.token_ids) != len(event.block_hashes) * event.block_size):
            raise Refused("invalid", f"BlockStored of {len(event.block_hashes)} blocks of {event.block_size} "
                          f"tokens carries {len(event.token_ids)} token ids")
    return int.from_bytes(seq, "big", signed=True), batch


def block_key(parent: bytes, tokens) -> bytes:
    """The proxy's key of a block: its parent's key chained with its token ids."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


OWN_CACHE_MEDIA = (None, "GPU")
"""The media of an instance's own KV cache in vLLM's events ("GPU" on every device, CPU included). Blocks on other
media (an offload tier, a pool that every prefill reads, as the pool connector's events report) do not make one
instance the place to send a prompt, so they are not indexed."""


def prefix_keys(tokens: list[int], block_size: int) -> list[bytes]:
    """The keys of a prompt's full blocks, first to last."""
    keys, parent = [], ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start:start + block_size])
        keys.append(parent)
    return keys


class PrefixIndex:
    """The full blocks one instance holds, by the proxy's keys; at most `max_blocks`, the oldest stored
    forgotten first (a forgotten block only costs a hit)."""

    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks
        self.block_size: int | None = None
        self._keys: dict[tuple[str | None, Hash], bytes] = {}  # vLLM's (medium, hash) -> our key, oldest first
        self._held: collections.Counter[bytes] = collections.Counter()

    def __len__(self) -> int:
        return len(self._keys)

    def clear(self) -> None:
        self._keys.clear()
        self._held.clear()
        self.block_size = None

    def store(self, event: BlockStored) -> str | None:
        """Index the event's blocks; returns why they were skipped, if they were."""
        if event.lora_name is not None or event.lora_id is not None or event.group_idx not in (None, 0) \
                or any(k is not None for k in event.extra_keys or ()):
            return "unindexable"  # LoRA, salts, multimodal or a second KV group: token ids alone do not name it
        if event.medium not in OWN_CACHE_MEDIA:
            return "medium"
        if self.block_size not in (None, event.block_size):
            return "block_size"
        if event.parent_block_hash is None:
            parent = ROOT
        else:
            parent = self._keys.get((event.medium, event.parent_block_hash))
            if parent is None:
                return "unknown_parent"  # stored before the proxy listened, or since forgotten
        self.block_size = event.block_size
        size = event.block_size
        for i, vllm_hash in enumerate(event.block_hashes):
            parent = block_key(parent, event.token_ids[i * size:(i + 1) * size])
            self._forget((event.medium, vllm_hash))  # stored again: now the newest
            self._keys[(event.medium, vllm_hash)] = parent
            self._held[parent] += 1
        while len(self._keys) > self.max_blocks:
            self._forget(next(iter(self._keys)))
        return None

    def remove(self, event: BlockRemoved) -> None:
        for vllm_hash in event.block_hashes:
            self._forget((event.medium, vllm_hash))

    def _forget(self, name: tuple[str | None, Hash]) -> None:
        key = self._keys.pop(name, None)
        if key is not None:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]

    def matched_blocks(self, keys: list[bytes]) -> int:
        """How many of a prompt's first blocks (their keys, in order) this instance holds."""
        n = 0
        while n < len(keys) and keys[n] in self._held:
            n += 1
        return n


class EventMetrics:
    """The event streams' counters on the proxy's /metrics."""

    def __init__(self, registry: CollectorRegistry):
        self.batches = Counter("kvpp_proxy_kv_event_batches", "KV event batches applied to an instance's index.",
                               ["backend"], registry=registry)
        self.refused = Counter("kvpp_proxy_kv_event_refused", "KV event messages refused, by kind: frames (not "
                               "topic, seq, payload), decode (not vLLM's KVEventBatch), invalid (inconsistent).",
                               ["backend", "kind"], registry=registry)
        self.skipped = Counter("kvpp_proxy_kv_blocks_skipped", "Stored blocks not indexed: unindexable (LoRA, "
                               "salt, multimodal, second KV group), medium (not the instance's own cache: an offload tier or a "
                               "shared pool), unknown_parent, block_size (not the instance's).",
                               ["backend", "reason"], registry=registry)
        self.resets = Counter("kvpp_proxy_kv_index_resets", "An instance's index emptied of its blocks: gap (missed batches), "
                              "restart (sequence went back), refused (a message refused), disconnected (the stream "
                              "dropped or fell silent past the heartbeat timeout), cleared (AllBlocksCleared), "
                              "down (the instance left the rotation).", ["backend", "reason"], registry=registry)
        self.blocks = Gauge("kvpp_proxy_kv_index_blocks", "Full blocks an instance's index holds.", ["backend"],
                            registry=registry)


class EventStream:
    """One prefill's event stream: a ZMQ SUB socket on the proxy's event loop feeding that instance's index.
    ZMTP heartbeats make a peer that stopped answering a disconnect, which a socket monitor reports."""

    def __init__(self, backend: str, endpoint: str, index: PrefixIndex, metrics: EventMetrics, timeout: float):
        self.backend, self.endpoint, self.index = backend, endpoint, index
        self.metrics, self.timeout = metrics, timeout
        self._last_seq: int | None = None
        self._logged: set[str] = set()

    def reset(self, reason: str) -> None:
        """Forget what this instance holds (it only costs hits until new events arrive)."""
        if len(self.index):
            self.metrics.resets.labels(self.backend, reason).inc()
            logger.info("prefill %s: prefix index dropped (%s, %d blocks)", self.backend, reason, len(self.index))
        self.index.clear()
        self._last_seq = None
        self.metrics.blocks.labels(self.backend).set(0)

    def handle(self, frames: list[bytes]) -> None:
        """Apply one PUB message; anything it cannot apply empties the index, never raises."""
        try:
            seq, batch = decode_message(frames)
        except Refused as refused:
            self.metrics.refused.labels(self.backend, refused.kind).inc()
            if refused.kind not in self._logged:  # once per kind: a flood of garbage must not flood the log
                self._logged.add(refused.kind)
                logger.warning("prefill %s: refused a KV event message from %s (%s: %s); its prefix index is "
                               "dropped and routing falls back to load until new events arrive",
                               self.backend, self.endpoint, refused.kind, refused)
            self.reset("refused")
            return
        if self._last_seq is not None and seq != self._last_seq + 1:
            self.reset("gap" if seq > self._last_seq else "restart")
        self._last_seq = seq
        for event in batch.events:
            if isinstance(event, BlockStored):
                skipped = self.index.store(event)
                if skipped:
                    self.metrics.skipped.labels(self.backend, skipped).inc(len(event.block_hashes))
            elif isinstance(event, BlockRemoved):
                self.index.remove(event)
            else:
                self.reset("cleared")
                self._last_seq = seq
        self.metrics.batches.labels(self.backend).inc()
        self.metrics.blocks.labels(self.backend).set(len(self.index))

    async def run(self, context: zmq.asyncio.Context) -> None:
        """Receive until cancelled; the socket reconnects by itself after a drop."""
        sock = context.socket(zmq.SUB)
        interval_ms = max(100, int(self.timeout * 1000) // 3)
        sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.timeout * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL, 500)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await monitor.recv_multipart()
                    self.reset("disconnected")
                if sock in ready:
                    self.handle(await sock.recv_multipart())
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
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
            stream.reset("disconnected")
            await asyncio.sleep(1.0)
