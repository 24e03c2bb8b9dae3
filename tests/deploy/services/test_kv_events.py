"""The proxy's KV event subscriber fed by vLLM's own publisher (`ZmqEventPublisher` and its event classes) over
real ZMQ on free ports: what the index learns, what it refuses (malformed frames, sequence gaps), a dead publisher."""

import asyncio
import contextlib
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry
from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                        ZmqEventPublisher)

from deploy.services.kv_events import BlockStored as Stored
from deploy.services.kv_events import EventMetrics, EventStream, PrefixIndex, prefix_keys, run_streams
from deploy.services.ports import free_port

BS = 4
TOKENS = list(range(100, 112))  # three full blocks of BS


def stored(hashes, parent, tokens, **extra):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, lora_id=None,
                       medium="GPU", lora_name=None, **extra)


def batch(*events):
    return KVEventBatch(ts=time.time(), events=list(events))


def sample(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


async def until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def subscribed(endpoint, timeout=5.0, max_blocks=1000):
    registry = CollectorRegistry()
    stream = EventStream("p0", endpoint, PrefixIndex(max_blocks), EventMetrics(registry), timeout)
    task = asyncio.create_task(run_streams([stream]))
    try:
        yield stream, registry
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def published(publisher, registry, *batches):
    """Publish until the subscriber has applied the first (a PUB drops what it sends before a SUB joined),
    then the rest in order."""
    applied = lambda: sample(registry, "kvpp_proxy_kv_event_batches_total", backend="p0")
    start = applied()
    while applied() == start:
        publisher.publish(batches[0])
        await asyncio.sleep(0.1)
    for b in batches[1:]:
        publisher.publish(b)


def matched(stream, tokens=TOKENS):
    return stream.index.matched_blocks(prefix_keys(tokens, BS))


@pytest.mark.integration
def test_the_index_follows_vllms_publisher():
    port = free_port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")

    async def go():
        async with subscribed(f"tcp://127.0.0.1:{port}") as (stream, registry):
            # Blocks 1-2 in one event, block 3 a child of block 2 in the next (how vLLM sends a longer prompt).
            await published(publisher, registry, batch(AllBlocksCleared()),
                            batch(stored([b"h1", b"h2"], None, TOKENS[:8])), batch(stored([b"h3"], b"h2", TOKENS[8:])))
            await until(lambda: len(stream.index) == 3)
            assert matched(stream) == 3 and matched(stream, TOKENS[:7]) == 1  # full blocks only
            assert matched(stream, [1, *TOKENS[1:]]) == 0  # another first block: nothing of it is held
            publisher.publish(batch(BlockRemoved(block_hashes=[b"h2"], medium="GPU")))
            await until(lambda: len(stream.index) == 2)
            assert matched(stream) == 1  # block 3 is unreachable without block 2
            # Skipped, not guessed: a LoRA block, and a block whose parent the proxy never saw.
            publisher.publish(batch(stored([b"l1"], None, TOKENS[:4], extra_keys=[("lora-a",)]),
                                    stored([b"x2"], b"unknown", TOKENS[4:8])))
            await until(lambda: sample(registry, "kvpp_proxy_kv_blocks_skipped_total", backend="p0",
                                       reason="unknown_parent") == 1)
            assert sample(registry, "kvpp_proxy_kv_blocks_skipped_total", backend="p0", reason="unindexable") == 1
            assert len(stream.index) == 2
            publisher.publish(batch(AllBlocksCleared()))
            await until(lambda: len(stream.index) == 0)
            assert sample(registry, "kvpp_proxy_kv_index_resets_total", backend="p0", reason="cleared") == 1
            assert sample(registry, "kvpp_proxy_kv_index_blocks", backend="p0") == 0

    try:
        asyncio.run(go())
    finally:
        publisher.shutdown()


@pytest.mark.integration
def test_malformed_messages_and_gaps_empty_the_index_and_are_counted():
    """Garbage on the wire (wrong frames, a bad sequence frame, bytes that are no KVEventBatch, an event whose
    token ids do not fill its blocks) is refused and counted, never raised; a sequence gap or a sequence going
    back (a restarted publisher) empties the index; a good message afterwards is applied as usual."""
    encode = msgspec.msgpack.Encoder().encode
    context = zmq.Context.instance()
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")

    def send(seq, *events, frames=None):
        pub.send_multipart(frames or [b"", seq.to_bytes(8, "big"), encode(batch(*events))])

    async def go():
        async with subscribed(f"tcp://127.0.0.1:{port}") as (stream, registry):
            refused = lambda kind: sample(registry, "kvpp_proxy_kv_event_refused_total", backend="p0", kind=kind)
            resets = lambda reason: sample(registry, "kvpp_proxy_kv_index_resets_total", backend="p0", reason=reason)
            seq = 0
            while not len(stream.index):  # until the subscriber has joined
                send(seq, stored([b"h1"], None, TOKENS[:4]))
                seq += 1
                await asyncio.sleep(0.1)
            bad = [[b"only one"], [b"", b"\x00\x01", encode(batch())], [b"", seq.to_bytes(8, "big"), b"\xc1garbage"],
                   [b"", seq.to_bytes(8, "big"), encode({"ts": 1, "events": []})],
                   [b"", seq.to_bytes(8, "big"), encode([1.0, [{"type": "Nonsense"}]])],
                   [b"", seq.to_bytes(8, "big"), encode(batch(stored([b"h9"], None, TOKENS[:3])))]]
            for frames in bad:
                send(0, frames=frames)
            await until(lambda: refused("frames") == 2 and refused("decode") == 3 and refused("invalid") == 1)
            assert len(stream.index) == 0 and resets("refused") == 1  # emptied once: nothing to drop after
            send(seq, stored([b"h1"], None, TOKENS[:4]))
            send(seq + 1, stored([b"h2"], b"h1", TOKENS[4:8]))
            await until(lambda: len(stream.index) == 2)
            send(seq + 5, stored([b"h3"], b"h2", TOKENS[8:]))  # batches seq+2..seq+4 were lost
            await until(lambda: resets("gap") == 1)
            assert len(stream.index) == 0  # and h3's parent is gone with it: skipped
            send(seq + 6, stored([b"h1"], None, TOKENS[:4]))
            await until(lambda: len(stream.index) == 1)
            send(0, stored([b"h1"], None, TOKENS[:4]))  # the publisher restarted: its count began again
            await until(lambda: resets("restart") == 1)
            assert len(stream.index) == 1 and matched(stream) == 1

    try:
        asyncio.run(go())
    finally:
        pub.close(linger=0)


@pytest.mark.integration
def test_a_dead_publisher_empties_the_index_and_a_new_one_is_followed():
    port = free_port()
    first = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")

    async def go():
        async with subscribed(f"tcp://127.0.0.1:{port}", timeout=1.0) as (stream, registry):
            await published(first, registry, batch(stored([b"h1", b"h2"], None, TOKENS[:8])))
            await until(lambda: len(stream.index) == 2)
            first.shutdown()  # the engine died: its socket closed
            await until(lambda: sample(registry, "kvpp_proxy_kv_index_resets_total", backend="p0",
                                       reason="disconnected") == 1)
            assert len(stream.index) == 0
            second = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")  # the engine restarted on the same port
            try:
                await published(second, registry, batch(stored([b"h1"], None, TOKENS[:4])))
                await until(lambda: len(stream.index) == 1)
            finally:
                second.shutdown()

    asyncio.run(go())


PUBLISH_FOREVER = """
import sys, time, zmq
pub = zmq.Context().socket(zmq.PUB)
pub.bind(sys.argv[1])
payload, seq = bytes.fromhex(sys.argv[2]), 0
while True:
    pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
    seq += 1
    time.sleep(0.1)
"""


@pytest.mark.integration
def test_a_stalled_publisher_is_dropped_after_the_heartbeat_timeout():
    """A publisher that stops answering (SIGSTOP: its socket stays open, nothing closes it) falls silent past
    the heartbeat timeout: its index is emptied, though no connection was closed."""
    port = free_port()
    payload = msgspec.msgpack.Encoder().encode(batch(stored([b"h1"], None, TOKENS[:4])))
    proc = subprocess.Popen([sys.executable, "-c", PUBLISH_FOREVER, f"tcp://127.0.0.1:{port}", payload.hex()])

    async def go():
        async with subscribed(f"tcp://127.0.0.1:{port}", timeout=1.0) as (stream, registry):
            await until(lambda: len(stream.index) == 1)
            proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            await until(lambda: len(stream.index) == 0, timeout=20)
            assert sample(registry, "kvpp_proxy_kv_index_resets_total", backend="p0", reason="disconnected") == 1
            return time.monotonic() - stopped

    try:
        print(f"a stalled publisher's index dropped {asyncio.run(go()):.1f} s after it stopped (timeout 1 s)")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.unit
def test_the_index_is_bounded_oldest_first():
    index = PrefixIndex(max_blocks=2)
    assert index.store(Stored([b"a1", b"a2"], None, TOKENS[:8], BS)) is None
    assert index.matched_blocks(prefix_keys(TOKENS, BS)) == 2
    assert index.store(Stored([b"b1"], None, [7] * BS, BS)) is None  # a1 goes: the oldest
    assert len(index) == 2 and index.matched_blocks(prefix_keys(TOKENS, BS)) == 0
    assert index.matched_blocks(prefix_keys([7] * BS, BS)) == 1
    assert index.store(Stored([b"c1"], None, [1] * 8, 8)) == "block_size"


@pytest.mark.unit
def test_blocks_off_the_instances_own_cache_are_not_indexed():
    """A pool's or an offload tier's blocks (any medium but vLLM's own "GPU") are reachable from every prefill that
    reads them: they make no instance the place for a prompt."""
    index = PrefixIndex(max_blocks=8)
    assert index.store(Stored([b"p1"], None, TOKENS[:BS], BS, medium="STORAGE")) == "medium"
    assert index.store(Stored([b"c1"], None, TOKENS[:BS], BS, medium="CPU")) == "medium"
    assert len(index) == 0
    assert index.store(Stored([b"g1"], None, TOKENS[:BS], BS, medium="GPU")) is None
    assert index.matched_blocks(prefix_keys(TOKENS, BS)) == 1
