"""A `kvpp proxy` process following prefills whose KV event publishers misbehave: vLLM's own `ZmqEventPublisher` sends
the odd batch (a token id outside 64 signed bits) and a corpus of odd events (tests/helpers/kv_event_corpus.py),
and the proxy keeps applying later batches until its index equals a fresh subscriber's; a replay endpoint in vLLM's
wire format that never ends its answer costs the proxy bounded memory while live batches still arrive."""

import asyncio
import hashlib
import json
import time
import urllib.request

import pytest
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from deploy.services.event_stream import FOLLOWED
from deploy.services.ports import free_port
from deploy.services.proxy import start_proxy
from tests.helpers.event_streams import BS, batch, buffered, stored, stream_of
from tests.helpers.kv_event_corpus import Corpus
from tests.helpers.pd_http import wait_for
from tests.helpers.raw_replay import RawReplay
from tests.helpers.stub_engine import REQUEST, stub_tokens, stubs_in_thread

LIVENESS_S = 60
"""Each wait below ends within seconds; a loaded 2-core host stays far inside this (a dead stream never would)."""
MEMORY_MB = 64
"""What the proxy may grow by while a replay never ends: its queues hold at most 1,000 messages of ~60 bytes here
(the unbounded queue this replaced grew by about 20 MB a second on this host)."""


def chain(text: str) -> KVEventBatch:
    """The BlockStored vLLM sends for a prompt's full blocks, as the stubs tokenize it (sha256 hashes, as vLLM's)."""
    tokens = stub_tokens(text)
    n = len(tokens) // BS
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=[hashlib.sha256(text[:(i + 1) * BS].encode()).digest() for i in range(n)], parent_block_hash=None,
        token_ids=tokens[:n * BS], block_size=BS, lora_id=None, medium="GPU", lora_name=None)])


def samples(url: str) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(url: str, name: str, **labels) -> float:
    return samples(url).get((name, frozenset(labels.items())), 0.0)


def prefill_of(url: str, prompt: str) -> str:
    """The prefill the proxy chose for a completion of `prompt`."""
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps({**REQUEST, "prompt": prompt}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.headers["X-Kvpp-Prefill"]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@pytest.mark.integration
def test_a_proxy_fed_the_odd_batch_and_a_corpus_keeps_applying_later_batches(tmp_path):
    """p0 publishes a good batch, the odd one, three good ones, 1,500 batches of a corpus (a third of their events
    odd, some slots not events at all) and a last conversation; p1 publishes nothing. The proxy refuses what its
    index cannot hold, never fails its stream, and ends with the index a subscriber starting afresh from p0's replay
    endpoint builds: every turn of the last conversation goes to p0 where the rotation would alternate."""
    live, replay = [free_port(), free_port()], [free_port(), free_port()]
    pubs = [ZmqEventPublisher(0, endpoint=f"tcp://*:{p}", replay_endpoint=f"tcp://127.0.0.1:{r}", buffer_steps=20_000)
            for p, r in zip(live, replay)]
    last = "the last conversation of the day, turn one"
    try:
        with stubs_in_thread("p0", "p1", "d0") as (p0, p1, d0):
            proc, url = start_proxy(
                [p0.url, p1.url], [d0.url], tmp_path / "proxy.log",
                extra_args=["--kv-events", ",".join(f"tcp://127.0.0.1:{p}" for p in live),
                            "--kv-events-replay", ",".join(f"tcp://127.0.0.1:{r}" for r in replay)])
            try:
                applied = lambda: sample(url, "kvpp_proxy_kv_event_batches_total", backend=p0.url)
                wait_for(lambda: sample(url, "kvpp_proxy_kv_index_syncs_total", backend=p0.url, outcome="rebuilt"),
                         LIVENESS_S, "the first sync")
                while not applied():  # a PUB drops what precedes a SUB's join
                    pubs[0].publish(chain("a first conversation, turn one"))
                    time.sleep(0.1)
                pubs[0].publish(batch(stored([b"o1"], None, [2 ** 63, 1, 2, 3])))
                for turn in ("turn two", "turn three", "turn four"):
                    pubs[0].publish(chain(f"a first conversation, {turn}"))
                for seed in (1, 2, 3):
                    corpus = Corpus(seed, ints=(2 ** 63, -1), garbage=(b"\xc1",), nested=([[1]], {"a": [None]}),
                                    odd=0.3)
                    for events in corpus.event_lists(500):
                        pubs[0].publish(KVEventBatch(ts=time.time(), events=events))
                buffered(pubs[0], chain(last))
                fresh, _ = stream_of(f"tcp://127.0.0.1:{live[0]}", f"tcp://127.0.0.1:{replay[0]}", max_blocks=1 << 18)
                assert asyncio.run(fresh.sync(zmq.asyncio.Context.instance())) == "rebuilt"
                assert fresh.index.holds_a_first_block
                wait_for(lambda: (sample(url, "kvpp_proxy_kv_index_blocks", backend=p0.url),
                                  sample(url, "kvpp_proxy_kv_index_orphans", backend=p0.url),
                                  sample(url, "kvpp_proxy_kv_index_trusted", backend=p0.url))
                         == (len(fresh.index), fresh.index.orphans, 1), LIVENESS_S, "the fresh subscriber's index")
                served = [prefill_of(url, last + turn) for turn in (" and two", " and three")]
                m = samples(url)
            finally:
                proc.stop()
    finally:
        for pub in pubs:
            pub.shutdown()
    assert served == [p0.url, p0.url]
    refused = {dict(labels)["kind"]: v for (name, labels), v in m.items()
               if name == "kvpp_proxy_kv_event_refused_total" and dict(labels)["backend"] == p0.url}
    assert refused["range"] >= 1 and refused["decode"] >= 1 and refused["invalid"] >= 1
    assert sum(v for (name, _), v in m.items() if name == "kvpp_proxy_kv_event_stream_failures_total") == 0
    assert m[("kvpp_proxy_kv_event_task_restarts_total", frozenset())] == 0


@pytest.mark.integration
def test_a_replay_that_never_ends_costs_a_proxy_bounded_memory_and_live_batches_still_arrive(tmp_path):
    """The replay endpoint answers with the hundred batches p0 published, over and over, never its end marker, as
    fast as it can: the proxy abandons each round past its limit (100,000 batches), grows by less than MEMORY_MB
    over two rounds, applies p0's live batches meanwhile, and says on /health that p0's index is not trusted."""
    port = free_port()
    publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}")
    history = [batch(stored([b"r%d" % i], None if i == 0 else b"r%d" % (i - 1), [i] * BS)) for i in range(100)]
    buffered(publisher, *history)  # sequence numbers 0-99, before the proxy listens
    try:
        with RawReplay(history, mode="endless") as endless, stubs_in_thread("p0", "d0") as (p0, d0):
            proc, url = start_proxy([p0.url], [d0.url], tmp_path / "proxy.log",
                                    extra_args=["--kv-events", f"tcp://127.0.0.1:{port}",
                                                "--kv-events-replay", endless.endpoint])
            try:
                start, peak = rss_mb(proc.pid), 0.0
                deadline = time.monotonic() + LIVENESS_S
                while sample(url, "kvpp_proxy_kv_replay_abandoned_total", backend=p0.url, limit="batches") < 2:
                    peak = max(peak, rss_mb(proc.pid))
                    assert peak - start < MEMORY_MB, f"the proxy grew from {start:.0f} to {peak:.0f} MB"
                    assert time.monotonic() < deadline, "no replay round abandoned in time"
                    publisher.publish(batch(stored([b"k1"], None, [5] * BS)))
                    time.sleep(0.2)
                m = samples(url)
                health = json.loads(urllib.request.urlopen(f"{url}/health?backends=1", timeout=10).read())
            finally:
                proc.stop()
    finally:
        publisher.shutdown()
    key = lambda name: (name, frozenset({"backend": p0.url}.items()))
    live = m[key("kvpp_proxy_kv_event_batches_total")] - m[key("kvpp_proxy_kv_event_replayed_batches_total")]
    assert live >= 1 and endless.asked >= 2
    assert m[key("kvpp_proxy_kv_index_trusted")] == 0
    assert "replay abandoned: more than 100000 batches" in health["kv_indexes"][p0.url] != FOLLOWED
