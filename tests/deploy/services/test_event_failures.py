"""A KV event stream that cannot be killed by its input or by its own recovery: vLLM's own `ZmqEventPublisher` sends
the odd message (a token id outside 64 signed bits, valid msgpack), and later batches are applied; a defect in
handling one stream's message costs that stream a resubscription (counted, its index rebuilt from the replay
endpoint), never another stream; the backoff between resubscriptions grows and starts again after a success; and
the proxy starts its event task again should it end, saying on /health which prefill's index is not followed."""

import asyncio

import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry
from vllm.distributed.kv_events import BlockRemoved, ZmqEventPublisher

from deploy.services import event_stream, proxy
from deploy.services.event_stream import FOLLOWED, EventMetrics, _keep_running
from deploy.services.ports import free_port
from deploy.services.routing import PrefixRouting
from tests.helpers.event_streams import (BS, CHAIN, applied, batch, buffered, matched, published,
                                         publisher_with_replay, resets, run_then, running, same_index, sample, stored,
                                         stream_of, syncs, until)
from tests.helpers.stub_engine import Stub, with_proxy

ODD = batch(stored([b"o1"], None, [2 ** 63, 1, 2, 3]))
"""A BlockStored whose first token id does not fit in 64 signed bits: vLLM's encoder sends it as a uint64."""
LAST = batch(stored([b"k1"], None, [5] * BS))


def failures(registry, cause, backend="p0"):
    return sample(registry, "kvpp_proxy_kv_event_stream_failures_total", backend=backend, cause=cause)


@pytest.mark.integration
def test_the_odd_batch_is_refused_and_the_index_equals_a_fresh_subscribers():
    """A good batch, the odd one, three good ones: the odd event is refused (counted), nothing is raised or reset,
    every later batch is applied, and the index equals that of a subscriber that starts afresh from the replay
    endpoint after the last good batch."""
    publisher, live, replay = publisher_with_replay()
    stream, registry = stream_of(live, replay)

    async def go():
        async with running(stream):
            await until(lambda: syncs(registry, "rebuilt") == 1)  # nothing published yet
            await published(publisher, registry, CHAIN[0], ODD, CHAIN[1],
                            batch(BlockRemoved(block_hashes=[b"h1"], medium="GPU")), LAST)
            await until(lambda: matched(stream, [5] * BS) == 1)
        publisher._event_queue.join()
        assert sample(registry, "kvpp_proxy_kv_event_refused_total", backend="p0", kind="range") == 1
        assert failures(registry, "error") == failures(registry, "zmq") == 0
        assert sum(resets(registry, r) for r in event_stream.RESET_REASONS) == 0
        assert matched(stream) == 0 and len(stream.index) == 3  # h2-h3 wait for h1, announced anew
        fresh, _ = stream_of(live, replay)
        assert await fresh.sync(zmq.asyncio.Context.instance()) == "rebuilt"
        assert same_index(stream.index, fresh.index)

    run_then(go, publisher.shutdown)


@pytest.mark.integration
def test_a_defect_in_one_stream_costs_that_stream_a_resubscription_and_never_another():
    """p0's index raises once while storing (a defect the decode could not foresee): p0's stream is counted failed,
    its index dropped and rebuilt from its replay endpoint (the batch it failed on included) after the first
    backoff; p1's stream, running beside it, applies every batch throughout."""
    pub0, live0, replay0 = publisher_with_replay()
    port1 = free_port()
    pub1 = ZmqEventPublisher(0, endpoint=f"tcp://*:{port1}")
    registry = CollectorRegistry()
    metrics = EventMetrics(registry)
    s0, _ = stream_of(live0, replay0, backend="p0", metrics=metrics)
    s1, _ = stream_of(f"tcp://127.0.0.1:{port1}", backend="p1", metrics=metrics)
    store = s0.index.store
    calls = []

    def store_failing_once(event):
        calls.append(event)
        if len(calls) == 2:
            raise RuntimeError("a defect in handling")
        return store(event)

    s0.index.store = store_failing_once

    async def go():
        async with running(s0, s1):
            await published(pub1, registry, batch(stored([b"x1"], None, [7] * BS)), backend="p1")
            await published(pub0, registry, CHAIN[0], CHAIN[1])
            await until(lambda: failures(registry, "error") == 1)
            rebuilt = syncs(registry, "rebuilt")
            pub1.publish(batch(stored([b"x2"], b"x1", [8] * BS)))  # while p0 waits to subscribe again
            await until(lambda: matched(s1, [7] * BS + [8] * BS) == 2)
            await until(lambda: syncs(registry, "rebuilt") > rebuilt and s0.health() == FOLLOWED)
            assert matched(s0) == 3 and resets(registry, "failed") == 1
            pub1.publish(batch(stored([b"x3"], b"x2", [9] * BS)))
            await until(lambda: matched(s1, [7] * BS + [8] * BS + [9] * BS) == 3)
        assert failures(registry, "error", "p1") == 0

    run_then(go, lambda: (pub0.shutdown(), pub1.shutdown()))


@pytest.mark.unit
def test_the_resubscription_backoff_grows_to_its_bound_and_starts_again_after_a_success(monkeypatch):
    """A stream whose loop fails at once, again and again, waits 0.01, 0.02, 0.04, 0.04 s (the bound) before each
    new subscription; one that applied a batch before failing waits the first delay again."""
    monkeypatch.setattr(event_stream, "RESUBSCRIBE_S", (0.01, 0.04))
    stream, registry = stream_of(f"tcp://127.0.0.1:{free_port()}")
    delays = []
    failed = stream.failed

    async def run(context):
        if len(delays) == 6:
            raise asyncio.CancelledError()  # the proxy stopping
        if len(delays) == 4:
            stream.progress += 1  # this run applied a batch before it failed
        raise zmq.ZMQError(zmq.ETERM)

    def record(exc, delay):
        delays.append(delay)
        failed(exc, delay)

    monkeypatch.setattr(stream, "run", run)
    monkeypatch.setattr(stream, "failed", record)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_keep_running(stream))
    assert delays == [0.01, 0.02, 0.04, 0.04, 0.01, 0.02]
    assert failures(registry, "zmq") == 6
    assert stream.health().startswith("stream failed (ZMQError")


@pytest.mark.integration
def test_the_proxy_starts_its_event_task_again_when_it_ends(monkeypatch):
    """The task running the streams fails (here: the first time it starts): the proxy counts it, starts it again,
    and the index then follows its publisher; /health?backends=1 says each prefill's index is followed."""
    starts = []
    real = proxy.run_streams

    async def failing_first(streams):
        starts.append(len(streams))
        if len(starts) == 1:
            raise RuntimeError("the task died")
        await real(streams)

    monkeypatch.setattr(proxy, "run_streams", failing_first)
    port = free_port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")
    p0, d0 = Stub("p0"), Stub("d0")

    async def go(session, url, pd):
        stream = pd.router.streams[p0.url]
        await until(lambda: len(starts) == 2)
        while not len(stream.index):  # a PUB drops what precedes a SUB's join
            publisher.publish(batch(stored([b"h1"], None, [1] * BS)))
            await asyncio.sleep(0.1)
        async with session.get(f"{url}/health?backends=1") as r:
            health = await r.json()
        return health, sample(pd.registry, "kvpp_proxy_kv_event_task_restarts_total")

    try:
        health, restarts = asyncio.run(with_proxy([p0], [d0], go, routing=PrefixRouting((f"tcp://127.0.0.1:{port}",))))
    finally:
        publisher.shutdown()
    assert restarts == 1
    assert health["kv_indexes"] == {p0.url: FOLLOWED}


@pytest.mark.integration
def test_health_names_the_prefill_whose_index_is_not_followed():
    """A prefill whose replay endpoint does not answer: its index is not trusted (the gauge says 0, /health says the
    sync failed) while the other's is followed."""
    pub, live, replay = publisher_with_replay()
    buffered(pub, CHAIN[0])
    dead = f"tcp://127.0.0.1:{free_port()}"
    p0, p1, d0 = Stub("p0"), Stub("p1"), Stub("d0")
    routing = PrefixRouting((live, dead), (replay, dead), event_timeout=0.5)

    async def go(session, url, pd):
        await until(lambda: syncs(pd.registry, "rebuilt", p0.url) == 1 and syncs(pd.registry, "failed", p1.url) >= 1)
        await until(lambda: pd.router.streams[p0.url].up)
        async with session.get(f"{url}/health?backends=1") as r:
            health = await r.json()
        gauges = [sample(pd.registry, "kvpp_proxy_kv_index_trusted", backend=b.url) for b in (p0, p1)]
        return health, gauges, applied(pd.registry, p0.url)

    try:
        health, gauges, batches = asyncio.run(with_proxy([p0, p1], [d0], go, routing=routing))
    finally:
        pub.shutdown()
    assert health["kv_indexes"][p0.url] == FOLLOWED and batches == 1
    assert f"sync from {dead} failed" in health["kv_indexes"][p1.url]
    assert gauges == [1, 0]
