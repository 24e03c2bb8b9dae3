"""The proxy's KV event streams under test: vLLM's own `ZmqEventPublisher` on free ports (with its replay endpoint),
a stream of one prefill's index subscribed to it, the batches vLLM sends, and waits on what the stream counts."""

from __future__ import annotations

import asyncio
import contextlib
import time

import zmq
from prometheus_client import CollectorRegistry
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from deploy.services.event_replay import ReplayLimits
from deploy.services.event_stream import EventMetrics, EventStream, run_streams
from deploy.services.ports import free_port
from deploy.services.prefix_index import PrefixIndex, iter_keys

BS = 4
TOKENS = list(range(100, 112))  # three full blocks of BS


def run_then(go, cleanup) -> None:
    """Run a test's coroutine, then `cleanup` whatever happened: no publisher outlives its test."""
    try:
        asyncio.run(go())
    finally:
        cleanup()


def stored(hashes, parent, tokens, **extra):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, lora_id=None,
                       medium="GPU", lora_name=None, **extra)


def batch(*events):
    return KVEventBatch(ts=time.time(), events=list(events))


CHAIN = (batch(stored([b"h1", b"h2"], None, TOKENS[:8])), batch(stored([b"h3"], b"h2", TOKENS[8:])))
"""Blocks 1-2 in one event, block 3 a child of block 2 in the next (how vLLM sends a longer prompt)."""


def sample(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


def resets(registry, reason, backend="p0"):
    return sample(registry, "kvpp_proxy_kv_index_resets_total", backend=backend, reason=reason)


def syncs(registry, outcome, backend="p0"):
    return sample(registry, "kvpp_proxy_kv_index_syncs_total", backend=backend, outcome=outcome)


def applied(registry, backend="p0"):
    return sample(registry, "kvpp_proxy_kv_event_batches_total", backend=backend)


async def until(condition, timeout=20.0):
    """Liveness: what the streams do here takes well under a second; a loaded host stays far inside `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def stream_of(endpoint, replay=None, timeout=5.0, max_blocks=1000, backend="p0", metrics=None,
              limits=ReplayLimits()):
    """A stream and its registry (or, given `metrics` shared with other streams, None)."""
    registry = None if metrics else CollectorRegistry()
    return EventStream(backend, endpoint, PrefixIndex(max_blocks), metrics or EventMetrics(registry), timeout, replay,
                       limits), registry


@contextlib.asynccontextmanager
async def running(*streams):
    task = asyncio.create_task(run_streams(list(streams)))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def published(publisher, registry, *batches, backend="p0"):
    """Publish until the subscriber has applied the first (a PUB drops what it sends before a SUB joined),
    then the rest in order."""
    start = applied(registry, backend)
    while applied(registry, backend) == start:
        publisher.publish(batches[0])
        await asyncio.sleep(0.1)
    for b in batches[1:]:
        publisher.publish(b)


def buffered(publisher, *batches):
    """Publish `batches` and wait until the publisher holds them for replay."""
    for b in batches:
        publisher.publish(b)
    publisher._event_queue.join()  # its thread marks a batch done once it is sent and buffered


def matched(stream, tokens=TOKENS):
    return stream.index.matched_blocks(iter_keys(tokens, BS))


def publisher_with_replay():
    live, replay = free_port(), free_port()
    return (ZmqEventPublisher(0, endpoint=f"tcp://*:{live}", replay_endpoint=f"tcp://127.0.0.1:{replay}"),
            f"tcp://127.0.0.1:{live}", f"tcp://127.0.0.1:{replay}")


def restarted(live, replay):
    """A new publisher on a dead one's ports (ZMQ closes the old listeners asynchronously: retried briefly)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return ZmqEventPublisher(0, endpoint=live.replace("127.0.0.1", "*"), replay_endpoint=replay)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def same_index(a: PrefixIndex, b: PrefixIndex) -> bool:
    """Two indexes hold the same keys (each on its own holders), orphans and block size."""
    return (a.block_size, len(a), a.orphans, sorted(a.holders.by_key)) == \
        (b.block_size, len(b), b.orphans, sorted(b.holders.by_key))
