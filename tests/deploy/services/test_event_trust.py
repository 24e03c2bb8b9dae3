"""No stale window: an index that may have missed batches is not used for routing until a sync from the replay
endpoint succeeds; a break (the instance leaving the rotation) during a sync wins over that sync's outcome; a
publisher restarted behind the same address is told apart after a disconnection even when no sync can succeed; and
a replay round past its limits is abandoned, counted, and leaves the index untrusted while the live stream goes on.
vLLM's own `ZmqEventPublisher`, or a replay endpoint in its wire format (tests/helpers/raw_replay.py), over real ZMQ."""

import asyncio
import time

import msgspec
import pytest
import zmq.asyncio
from prometheus_client import CollectorRegistry
from vllm.distributed.kv_events import ZmqEventPublisher

from deploy.services.event_replay import ReplayLimits
from deploy.services.ports import free_port
from deploy.services.prefix_index import Prompt
from deploy.services.proxy import Backend
from deploy.services.routing import PrefixRouter, PrefixRouting
from tests.helpers.event_streams import (BS, CHAIN, TOKENS, applied, batch, buffered, matched, publisher_with_replay,
                                         restarted, run_then, running, sample, stored, stream_of, syncs, until)
from tests.helpers.raw_replay import RawReplay

encode = msgspec.msgpack.Encoder().encode


def live_frames(seq, b):
    """A live message as vLLM's publisher sends it."""
    return [b"", seq.to_bytes(8, "big"), encode(b)]


def trusted(registry, backend="p0"):
    return sample(registry, "kvpp_proxy_kv_index_trusted", backend=backend)


@pytest.mark.integration
def test_an_index_whose_sync_failed_attracts_no_prompt_until_a_sync_succeeds():
    """p0 holds the prompt and wins over the rotation's turn (p1); its publisher dies with its replay endpoint, the
    sync after the disconnection fails: p0's index, which may have missed removals, no longer decides (p1's turn,
    counted as a miss), until p0's restarted publisher answers a sync."""
    publisher, live, replay = publisher_with_replay()
    buffered(publisher, *CHAIN)
    p0, p1 = Backend("prefill", "http://p0"), Backend("prefill", "http://p1")
    dead = f"tcp://127.0.0.1:{free_port()}"
    registry = CollectorRegistry()
    router = PrefixRouter([p0, p1], PrefixRouting((live, dead), (replay, dead), event_timeout=0.5), registry)
    stream = router.streams[p0.url]

    def chosen(tokens=TOKENS):
        return router.choose([p1, p0], Prompt(tokens), len(tokens))[0].backend.url

    async def go():
        context = zmq.asyncio.Context.instance()
        assert await stream.sync(context) == "rebuilt"
        assert chosen() == p0.url and trusted(registry, p0.url) == 1
        publisher.shutdown()
        stream.broke("disconnected")
        assert await stream.sync(context) == "failed"
        assert matched(stream) == 3  # kept (a publisher that comes back may continue it), not used
        assert chosen() == p1.url and trusted(registry, p0.url) == 0
        assert sample(registry, "kvpp_proxy_prefix_fallbacks_total", reason="miss") == 1
        assert "failed" in stream.health()
        second = restarted(live, replay)
        try:
            buffered(second, batch(stored([b"k1"], None, [5] * BS)))
            assert await stream.sync(context) == "rebuilt"
        finally:
            second.shutdown()
        assert chosen([5] * BS + [6]) == p0.url and chosen() == p1.url and trusted(registry, p0.url) == 1

    asyncio.run(go())


@pytest.mark.integration
def test_the_instance_leaving_the_rotation_during_a_sync_wins_over_its_outcome():
    """A sync held in flight (its replay endpoint answers once released); the proxy takes the instance out of the
    rotation meanwhile: the sync's result does not make the index trusted, and another sync is due at once."""
    with RawReplay([batch(stored([b"h1"], None, TOKENS[:4]))]) as slow:
        stream, registry = stream_of(f"tcp://127.0.0.1:{free_port()}", slow.endpoint)

        async def go():
            syncing = asyncio.create_task(stream.sync(zmq.asyncio.Context.instance()))
            await until(lambda: slow.asked == 1)
            stream.broke("down")  # what PrefixRouter.forget does
            slow.release()
            assert await syncing == "rebuilt" and matched(stream) == 1
            assert stream.sync_due(time.monotonic()) and not stream.trusted and trusted(registry) == 0
            assert await stream.sync(zmq.asyncio.Context.instance()) == "continued"
            assert stream.trusted and trusted(registry) == 1

        asyncio.run(go())


@pytest.mark.integration
def test_a_restart_is_told_apart_after_a_disconnection_when_no_sync_succeeds():
    """Batches 0-2 applied from one publisher; the connection drops and the replay endpoint no longer answers (the
    prefill died). A new publisher counts from 0 again: its batches are applied to an emptied index, not dropped
    as already applied."""
    stream, registry = stream_of(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", timeout=0.3)

    async def go():
        context = zmq.asyncio.Context.instance()
        assert await stream.sync(context) == "failed"  # at start: the live batches are applied meanwhile
        for seq, b in enumerate((*CHAIN, batch(stored([b"h4"], None, [9] * BS)))):
            stream.handle(live_frames(seq, b))
        assert matched(stream) == 3 and applied(registry) == 3
        stream.broke("disconnected")
        assert await stream.sync(context) == "failed"
        stream.handle(live_frames(0, batch(stored([b"k1"], None, [5] * BS))))  # the new publisher's first
        assert await stream.sync(context) == "failed"
        stream.handle(live_frames(1, batch(stored([b"k2"], b"k1", [6] * BS))))
        assert matched(stream, [5] * BS + [6] * BS) == 2 and matched(stream) == 0
        assert sample(registry, "kvpp_proxy_kv_index_resets_total", backend="p0", reason="restart") == 1

    asyncio.run(go())


@pytest.mark.integration
@pytest.mark.parametrize("limits, limit", [(ReplayLimits(batches=5_000), "batches"),
                                           (ReplayLimits(batches=1 << 40, bytes=1 << 20), "bytes"),
                                           (ReplayLimits(batches=1 << 40, bytes=1 << 40, seconds=2.0), "seconds")])
def test_a_replay_that_never_ends_is_abandoned_and_the_live_stream_goes_on(limits, limit):
    """A publisher's replay endpoint sends the hundred batches it published over and over, never its end marker:
    each round is abandoned past its limit (counted by limit), the sync fails (and is tried again), and the index,
    untrusted, follows the publisher's live batches meanwhile."""
    port = free_port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")
    chain = [batch(stored([b"r%d" % i], None if i == 0 else b"r%d" % (i - 1), [i] * BS)) for i in range(100)]
    buffered(publisher, *chain)  # sequence numbers 0-99, before anyone listens
    with RawReplay(chain, mode="endless") as endless:
        stream, registry = stream_of(f"tcp://127.0.0.1:{port}", endless.endpoint, limits=limits)

        async def go():
            async with running(stream):
                await until(lambda: syncs(registry, "failed") >= 1, timeout=60)
                while not matched(stream, [5] * BS):
                    publisher.publish(batch(stored([b"k1"], None, [5] * BS)))
                    await asyncio.sleep(0.1)
                abandoned = sample(registry, "kvpp_proxy_kv_replay_abandoned_total", backend="p0", limit=limit)
                assert abandoned >= 1 and abandoned == syncs(registry, "failed")
                assert f"sync from {endless.endpoint} failed: replay abandoned" in stream.health()
                assert trusted(registry) == 0 and syncs(registry, "rebuilt") == syncs(registry, "continued") == 0

        run_then(go, publisher.shutdown)
