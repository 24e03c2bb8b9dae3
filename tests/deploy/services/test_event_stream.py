"""The proxy's KV event subscriber fed by vLLM's own publisher (`ZmqEventPublisher`, its replay endpoint and its
event classes) over real ZMQ on free ports: what the index learns live, what it learns again from the replay
endpoint after a late start, a gap, a dropped connection, a restarted publisher and a replay past ZMQ's high-water
marks; and, with no replay endpoint, what a break empties."""

import asyncio
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, ZmqEventPublisher

from deploy.services.event_stream import SYNC_RETRY_S
from deploy.services.ports import free_port
from deploy.services.prefix_index import iter_keys
from tests.helpers.event_streams import (BS, CHAIN, TOKENS, batch, buffered, matched, published, publisher_with_replay,
                                         restarted, resets, run_then, running, sample, stored, stream_of, syncs,
                                         until)


# -- live ---------------------------------------------------------------------------------------------------
@pytest.mark.integration
def test_the_index_follows_vllms_publisher():
    port = free_port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")
    stream, registry = stream_of(f"tcp://127.0.0.1:{port}")

    async def go():
        async with running(stream):
            await published(publisher, registry, batch(AllBlocksCleared()), *CHAIN)
            await until(lambda: len(stream.index) == 3)
            assert matched(stream) == 3 and matched(stream, TOKENS[:7]) == 1  # full blocks only
            assert matched(stream, [1, *TOKENS[1:]]) == 0  # another first block: nothing of it is held
            publisher.publish(batch(BlockRemoved(block_hashes=[b"h2"], medium="GPU")))
            await until(lambda: len(stream.index) == 2)
            assert matched(stream) == 1  # block 3 is unreachable without block 2
            # Not indexed: a LoRA block; waiting, not guessed: a block whose parent the proxy never saw.
            publisher.publish(batch(stored([b"l1"], None, TOKENS[:4], extra_keys=[("lora-a",)]),
                                    stored([b"x2"], b"unknown", TOKENS[4:8])))
            await until(lambda: sample(registry, "kvpp_proxy_kv_index_orphans", backend="p0") == 1)
            assert sample(registry, "kvpp_proxy_kv_blocks_skipped_total", backend="p0", reason="unindexable") == 1
            assert len(stream.index) == 2
            publisher.publish(batch(AllBlocksCleared()))
            await until(lambda: len(stream.index) == 0)
            assert resets(registry, "cleared") == 1
            assert sample(registry, "kvpp_proxy_kv_index_blocks", backend="p0") == 0

    run_then(go, publisher.shutdown)


@pytest.mark.integration
def test_without_a_replay_endpoint_a_break_empties_the_index():
    """Garbage on the wire (wrong frames, a bad sequence frame, bytes that are no KVEventBatch, an event whose token
    ids do not fill its blocks) is refused and counted, never raised; a refused message, a sequence gap or a
    sequence going back (a restarted publisher) empties the index; a good message afterwards is applied."""
    encode = msgspec.msgpack.Encoder().encode
    pub = zmq.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    stream, registry = stream_of(f"tcp://127.0.0.1:{port}")

    def send(seq, *events, frames=None):
        pub.send_multipart(frames or [b"", seq.to_bytes(8, "big"), encode(batch(*events))])

    async def go():
        async with running(stream):
            refused = lambda kind: sample(registry, "kvpp_proxy_kv_event_refused_total", backend="p0", kind=kind)
            seq = 0
            while not len(stream.index):  # until the subscriber has joined
                send(seq, stored([b"h1"], None, TOKENS[:4]))
                seq += 1
                await asyncio.sleep(0.1)
            bad = [[b"only one"], [b"", b"\x00\x01", encode(batch())], [b"", seq.to_bytes(8, "big"), b"\xc1garbage"],
                   [b"", seq.to_bytes(8, "big"), encode({"ts": 1, "events": []})],
                   [b"", seq.to_bytes(8, "big"), encode([1.0, [{"type": "Nonsense"}]])],
                   [b"", seq.to_bytes(8, "big"), encode(batch(stored([b"h9"], None, TOKENS[:3])))],
                   [b"", (-5).to_bytes(8, "big", signed=True), encode(batch())]]
            for frames in bad:
                send(0, frames=frames)
            await until(lambda: refused("frames") == 3 and refused("decode") == 3 and refused("invalid") == 1)
            assert len(stream.index) == 0 and resets(registry, "refused") == 1  # emptied once: nothing to drop after
            send(seq, stored([b"h1"], None, TOKENS[:4]))
            send(seq + 1, stored([b"h2"], b"h1", TOKENS[4:8]))
            await until(lambda: len(stream.index) == 2)
            send(seq + 5, stored([b"h3"], b"h2", TOKENS[8:]))  # batches seq+2..seq+4 were lost
            await until(lambda: resets(registry, "gap") == 1)
            assert len(stream.index) == 0 and stream.index.orphans == 1  # h3's parent went with the index
            send(seq + 6, stored([b"h1", b"h2"], None, TOKENS[:8]))  # a full report of the prefix: h3 comes back
            await until(lambda: len(stream.index) == 3)
            assert matched(stream) == 3
            send(0, stored([b"h1"], None, TOKENS[:4]))  # the publisher restarted: its count began again
            await until(lambda: resets(registry, "restart") == 1)
            assert len(stream.index) == 1 and matched(stream) == 1

    run_then(go, lambda: pub.close(linger=0))


@pytest.mark.integration
def test_without_a_replay_endpoint_a_dead_publisher_empties_the_index_and_a_new_one_is_followed():
    port = free_port()
    first = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")
    stream, registry = stream_of(f"tcp://127.0.0.1:{port}", timeout=1.0)

    async def go():
        async with running(stream):
            await published(first, registry, CHAIN[0])
            await until(lambda: len(stream.index) == 2)
            first.shutdown()  # the engine died: its socket closed
            await until(lambda: resets(registry, "disconnected") == 1)
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
    """A publisher that stops answering (SIGSTOP: its socket stays open, nothing closes it) falls silent past the
    heartbeat timeout: with no replay endpoint its index is emptied, though no connection was closed."""
    port = free_port()
    payload = msgspec.msgpack.Encoder().encode(batch(stored([b"h1"], None, TOKENS[:4])))
    proc = subprocess.Popen([sys.executable, "-c", PUBLISH_FOREVER, f"tcp://127.0.0.1:{port}", payload.hex()])
    stream, registry = stream_of(f"tcp://127.0.0.1:{port}", timeout=1.0)

    async def go():
        async with running(stream):
            await until(lambda: len(stream.index) == 1)
            proc.send_signal(signal.SIGSTOP)
            await until(lambda: len(stream.index) == 0, timeout=30)
            assert resets(registry, "disconnected") == 1

    run_then(go, lambda: (proc.kill(), proc.wait()))


# -- with vLLM's replay endpoint ------------------------------------------------------------------------------
@pytest.mark.integration
def test_a_late_subscriber_rebuilds_the_index_from_the_replay_endpoint():
    """What the prefill cached before the proxy (re)started comes back before any new event: every batch the
    publisher still holds is replayed in order, removals included."""
    publisher, live, replay = publisher_with_replay()
    buffered(publisher, *CHAIN, batch(BlockRemoved(block_hashes=[b"h3"], medium="GPU")),
             batch(stored([b"k1"], None, [5] * BS)))
    stream, registry = stream_of(live, replay)

    async def go():
        async with running(stream):
            await until(lambda: syncs(registry, "rebuilt") == 1)
            assert len(stream.index) == 3 and matched(stream) == 2 and matched(stream, [5] * BS) == 1
            assert sample(registry, "kvpp_proxy_kv_event_replayed_batches_total", backend="p0") == 4
            publisher.publish(batch(stored([b"h3"], b"h2", TOKENS[8:])))  # live again, after the replay
            await until(lambda: matched(stream) == 3)

    run_then(go, publisher.shutdown)


@pytest.mark.integration
def test_a_gap_and_a_dropped_connection_continue_from_the_replay_without_a_reset():
    """Batches missed while the proxy was cut off (its stream stopped, the publisher went on) come back from the
    replay endpoint once it reconnects, after the publisher proved it still holds the last batch applied: nothing
    is emptied. A live gap is filled the same way."""
    publisher, live, replay = publisher_with_replay()
    buffered(publisher, CHAIN[0])
    stream, registry = stream_of(live, replay)

    async def go():
        async with running(stream):
            await until(lambda: len(stream.index) == 2)
        buffered(publisher, CHAIN[1], batch(BlockRemoved(block_hashes=[b"h2"], medium="GPU")))  # while cut off
        async with running(stream):
            await until(lambda: syncs(registry, "continued") >= 1 and len(stream.index) == 2)
            assert matched(stream) == 1
        # A live gap: block 2 comes back in a batch the stream misses, a later one is seen.
        buffered(publisher, batch(stored([b"h2"], b"h1", TOKENS[4:8])))
        frames = []
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(live)
        while not frames:
            publisher.publish(batch(stored([b"k1"], None, [5] * BS)))
            if sub.poll(100):
                frames = sub.recv_multipart()
        sub.close(linger=0)
        publisher._event_queue.join()
        stream.handle(frames)  # seq > last + 1: the batches between were missed
        assert stream.sync_due(time.monotonic()) and matched(stream) == 1
        assert await stream.sync(zmq.asyncio.Context.instance()) == "continued"
        assert matched(stream) == 3 and matched(stream, [5] * BS) == 1 and resets(registry, "gap") == 0

    run_then(go, publisher.shutdown)


@pytest.mark.integration
def test_a_restarted_publisher_is_told_apart_and_rebuilt():
    """The prefill restarted while the proxy was cut off: its new publisher on the same ports does not hold the
    last batch the index applied as it was, so the index is rebuilt from the new one's batches alone."""
    first, live, replay = publisher_with_replay()
    buffered(first, *CHAIN)
    stream, registry = stream_of(live, replay)

    async def go():
        async with running(stream):
            await until(lambda: len(stream.index) == 3)
        first.shutdown()
        second = restarted(live, replay)
        try:
            buffered(second, batch(stored([b"k1"], None, [5] * BS)), batch(stored([b"k2"], b"k1", [6] * BS)),
                     batch(stored([b"k3"], b"k2", [7] * BS)))  # as many batches: sequence 0-2 again
            async with running(stream):
                await until(lambda: syncs(registry, "rebuilt") == 2)
                assert matched(stream) == 0 and matched(stream, [5] * BS + [6] * BS + [7] * BS) == 3
                assert resets(registry, "restart") == 1
        finally:
            second.shutdown()

    asyncio.run(go())


@pytest.mark.integration
def test_a_replay_past_the_high_water_marks_arrives_whole():
    """A replay of more batches than ZMQ queues for one peer arrives with holes (the publisher's ROUTER drops past
    its high-water mark); the sync asks again from the last batch applied until it has them all."""
    publisher, live, replay = publisher_with_replay()
    n = 8000  # 5 replays here: vLLM's ROUTER dropped past its high-water mark
    buffered(publisher, *(batch(stored([b"b%d" % i], None if i == 0 else b"b%d" % (i - 1), [i] * BS)) for i in range(n)))
    stream, registry = stream_of(live, replay, max_blocks=2 * n)

    async def go():
        async with running(stream):
            await until(lambda: syncs(registry, "rebuilt") + syncs(registry, "failed") >= 1, timeout=120)
        assert syncs(registry, "rebuilt") == 1
        assert len(stream.index) == n
        assert stream.index.matched_blocks(iter_keys([t for i in range(n) for t in [i] * BS], BS)) == n

    run_then(go, publisher.shutdown)


@pytest.mark.integration
def test_a_dead_replay_endpoint_costs_the_sync_not_the_live_stream():
    """A replay endpoint that does not answer fails the sync (counted) after its timeout; the live stream is applied
    meanwhile and the sync is tried again later."""
    live_port = free_port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{live_port}")
    stream, registry = stream_of(f"tcp://127.0.0.1:{live_port}", f"tcp://127.0.0.1:{free_port()}", timeout=0.5)

    async def go():
        async with running(stream):
            await until(lambda: syncs(registry, "failed") >= 1)
            await published(publisher, registry, CHAIN[0])
            await until(lambda: len(stream.index) == 2)
        assert not stream.sync_due(time.monotonic())  # the retry waits

    run_then(go, publisher.shutdown)


@pytest.mark.integration
def test_an_instance_out_of_rotation_is_checked_not_emptied():
    """The proxy took the instance out of rotation (its HTTP failed): with a replay endpoint the index is kept if the
    publisher is the same one, and rebuilt if it restarted."""
    publisher, live, replay = publisher_with_replay()
    buffered(publisher, *CHAIN)
    stream, registry = stream_of(live, replay)

    async def go():
        context = zmq.asyncio.Context.instance()
        assert await stream.sync(context) == "rebuilt" and matched(stream) == 3
        stream.broke("down")
        assert stream.sync_due(time.monotonic()) and await stream.sync(context) == "continued"
        assert matched(stream) == 3 and resets(registry, "down") == 0
        publisher.shutdown()
        second = restarted(live, replay)
        try:
            buffered(second, batch(stored([b"k1"], None, [5] * BS)))
            stream.broke("down")
            assert await stream.sync(context) == "rebuilt"
            assert matched(stream) == 0 and matched(stream, [5] * BS) == 1
        finally:
            second.shutdown()

    asyncio.run(go())


REPLAYING_PUBLISHER = """
import sys, time
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher
pub = ZmqEventPublisher(0, endpoint=sys.argv[1], replay_endpoint=sys.argv[2])
i = 0
while True:
    pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=[b"b%d" % i], parent_block_hash=None if i == 0 else b"b%d" % (i - 1), token_ids=[i] * 4,
        block_size=4, lora_id=None, medium="GPU", lora_name=None)]))
    i += 1
    time.sleep(0.1)
"""


@pytest.mark.integration
def test_a_stalled_publisher_with_a_replay_endpoint_is_caught_up_not_emptied():
    """A publisher stopped past the heartbeat timeout (SIGSTOP) and then resumed: the index is kept while it is
    silent, and once it answers again the batches published around the stall come from its replay endpoint: the
    whole chain matches, with no reset."""
    live, replay = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-c", REPLAYING_PUBLISHER, f"tcp://*:{live}", f"tcp://127.0.0.1:{replay}"])
    stream, registry = stream_of(f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{replay}", timeout=1.0)
    chain = lambda n: [t for i in range(n) for t in [i] * BS]

    async def go():
        async with running(stream):
            await until(lambda: syncs(registry, "rebuilt") + syncs(registry, "continued") >= 1 and
                        len(stream.index) >= 5, timeout=60)
            proc.send_signal(signal.SIGSTOP)
            held, failed = len(stream.index), syncs(registry, "failed")
            before = sum(resets(registry, r) for r in ("gap", "disconnected", "restart"))  # a rebuild at start, if any
            await until(lambda: syncs(registry, "failed") > failed, timeout=30)  # silent past the timeout, no answer
            assert len(stream.index) == held
            proc.send_signal(signal.SIGCONT)
            await until(lambda: len(stream.index) >= held + 5, timeout=60)
            n = len(stream.index)
            assert stream.index.matched_blocks(iter_keys(chain(n), BS)) == n
            assert sum(resets(registry, r) for r in ("gap", "disconnected", "restart")) == before
            assert syncs(registry, "continued") >= 1

    run_then(go, lambda: (proc.kill(), proc.wait()))


@pytest.mark.integration
def test_garbage_asks_the_replay_endpoint_for_one_rebuild_per_retry_interval():
    """A refused message empties the index and asks for a rebuild, but a publisher that keeps sending garbage must not
    make the proxy replay its whole buffer again and again: the next rebuild waits SYNC_RETRY_S after the last sync,
    and the live batches that follow are applied meanwhile."""
    publisher, live, replay = publisher_with_replay()
    buffered(publisher, *CHAIN)
    stream, registry = stream_of(live, replay)

    async def go():
        assert await stream.sync(zmq.asyncio.Context.instance()) == "rebuilt" and len(stream.index) == 3
        stream.handle([b"garbage"])
        assert len(stream.index) == 0 and resets(registry, "refused") == 1
        now = time.monotonic()
        assert not stream.sync_due(now) and stream.sync_due(now + SYNC_RETRY_S)
        encode = msgspec.msgpack.Encoder().encode
        stream.handle([b"", (7).to_bytes(8, "big"), encode(CHAIN[0])])  # applied while the rebuild waits
        assert len(stream.index) == 2

    run_then(go, publisher.shutdown)
