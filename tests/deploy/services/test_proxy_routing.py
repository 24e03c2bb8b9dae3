"""`kvpp proxy --kv-events`: the cache-aware choice of prefill against stub backends, each prefill's KV events
published by vLLM's own `ZmqEventPublisher` over real ZMQ: the holder of the longest prefix gets the prefill leg,
and every case the index cannot decide is routed by turn, counted by reason, and answered."""

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import time
import urllib.request

import pytest
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from prometheus_client import CollectorRegistry

from deploy.services.event_stream import EventMetrics, EventStream, run_streams
from deploy.services.ports import free_port
from deploy.services.prefix_index import PrefixIndex, iter_keys
from deploy.services.proxy import start_proxy
from deploy.services.routing import FULL_REPORT, PrefixRouting, tokenize_request
from tests.deploy.services.test_proxy import FAST, dead_url, metrics
from tests.helpers.stub_engine import REQUEST, Stub, stub_tokens, stubs_in_thread, with_proxy

BS = 4
PROMPT = REQUEST["prompt"] + " and more words"  # 24 characters: 6 full blocks of the stubs' tokens


def publishers(n):
    ports = [free_port() for _ in range(n)]
    pubs = [ZmqEventPublisher(0, endpoint=f"tcp://*:{p}") for p in ports]
    return pubs, PrefixRouting(tuple(f"tcp://127.0.0.1:{p}" for p in ports), event_timeout=2)


def stored(tokens):
    """The BlockStored vLLM sends for a prompt's full blocks (sha256 hashes of each prefix, as vLLM's: the proxy's keys
    do not use them)."""
    n = len(tokens) // BS
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=[hashlib.sha256(f"{tokens[:(i + 1) * BS]}".encode()).digest() for i in range(n)],
        parent_block_hash=None,
        token_ids=tokens[:n * BS], block_size=BS, lora_id=None, medium="GPU", lora_name=None)])


async def holds(proxy, url, publisher, tokens):
    """Publish `tokens` as cached on `url` until its index has them (a PUB drops what precedes a SUB's join)."""
    index = proxy.router.streams[url].index
    while len(index) < len(tokens) // BS:
        publisher.publish(stored(tokens))
        await asyncio.sleep(0.1)


async def complete(session, url, prompt=PROMPT, **extra):
    async with session.post(f"{url}/v1/completions", json={**REQUEST, "prompt": prompt, **extra}) as r:
        assert r.status == 200, await r.text()
        return r.headers.get("X-Kvpp-Prefill"), (await r.json())["got_kv_transfer_params"]["remote_engine_id"]


def run(prefills, decodes, go, n_pubs=None):
    pubs, routing = publishers(n_pubs or len(prefills))
    try:
        return asyncio.run(with_proxy(prefills, decodes, lambda s, u, p: go(s, u, p, pubs), FAST, routing=routing))
    finally:
        for pub in pubs:
            pub.shutdown()


@pytest.mark.unit
def test_what_is_tokenized():
    chat = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "t", "max_tokens": 3}
    assert tokenize_request("/v1/chat/completions", chat) == {"messages": chat["messages"], "chat_template": "t"}
    assert tokenize_request("/v1/completions", {"prompt": "a b", "add_special_tokens": False}) == \
        {"prompt": "a b", "add_special_tokens": False}
    assert tokenize_request("/v1/completions", {"prompt": ["a b"]}) == {"prompt": "a b"}
    assert tokenize_request("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]  # no round trip
    for batch in ({"prompt": ["a", "b"]}, {"prompt": [[1], [2]]}, {}, {"prompt": [True]}, {"prompt": [1, 2 ** 63]},
                  {"prompt": [-1]}):  # token ids the index's keys cannot hold are not routed by prefix
        assert tokenize_request("/v1/completions", batch) is None
    assert tokenize_request("/v1/chat/completions", {"prompt": "x"}) is None


@pytest.mark.integration
def test_the_prefill_holding_the_longest_prefix_gets_the_leg():
    """p1 holds the prompt's 6 blocks, p2 its first 2: every request goes to p1 where the rotation would have
    gone p0, p1, p2; a prompt only p2 holds more of goes to p2; the answer names the prefill it used."""
    ps, d = [Stub(f"p{i}") for i in range(3)], Stub("d0")

    async def go(session, url, proxy, pubs):
        tokens = stub_tokens(PROMPT)
        other = PROMPT[:8] + "Z" * 16
        await holds(proxy, ps[1].url, pubs[1], tokens)
        await holds(proxy, ps[2].url, pubs[2], stub_tokens(other))
        served = [await complete(session, url) for _ in range(3)]
        served.append(await complete(session, url, other))
        served.append(await complete(session, url, other[:10]))  # 2 full blocks: held by p1 and p2 alike
        return served, await metrics(session, url)

    served, m = run(ps, [d], go)
    assert served[:3] == [(ps[1].url, "p1")] * 3
    assert served[3] == (ps[2].url, "p2")
    assert served[4][1] in ("p1", "p2")  # a tie: the rotation's turn among the holders
    assert m[f'kvpp_proxy_prefix_hits_total{{backend="{ps[1].url}"}}'] >= 3
    assert m["kvpp_proxy_prefix_hit_blocks_count"] == 5 and m["kvpp_proxy_prefix_hit_blocks_sum"] == 6 * 4 + 2
    assert m[f'kvpp_proxy_kv_index_blocks{{backend="{ps[1].url}"}}'] == 6
    assert sum(v for k, v in m.items() if k.startswith("kvpp_proxy_prefix_fallbacks_total")) == 0


@pytest.mark.integration
def test_misses_and_no_index_go_by_turn():
    ps, d = [Stub(f"p{i}") for i in range(2)], Stub("d0")

    async def go(session, url, proxy, pubs):
        before = [await complete(session, url) for _ in range(2)]  # nothing indexed: no /tokenize either
        tokenized = [p.tokenized for p in ps]
        await holds(proxy, ps[0].url, pubs[0], stub_tokens("Q" * 8))
        after = [await complete(session, url) for _ in range(4)]  # p0 holds nothing of PROMPT
        return before, tokenized, after, await metrics(session, url)

    before, tokenized, after, m = run(ps, [d], go)
    assert [e for _, e in before] == ["p0", "p1"] and tokenized == [0, 0]
    assert [e for _, e in after] == ["p0", "p1", "p0", "p1"]
    assert m['kvpp_proxy_prefix_fallbacks_total{reason="no_index"}'] == 2
    assert m['kvpp_proxy_prefix_fallbacks_total{reason="miss"}'] == 4


@pytest.mark.integration
def test_a_holder_whose_queue_outweighs_its_prefix_is_passed_over():
    """The holder has all 6 blocks of the 24-token prompt: there it computes 1 token, elsewhere 24. With more than
    23 prompt tokens queued on it beyond the other's queue it is passed over; with fewer it gets the leg."""
    ps, d = [Stub(f"p{i}") for i in range(2)], Stub("d0")

    async def go(session, url, proxy, pubs):
        await holds(proxy, ps[1].url, pubs[1], stub_tokens(PROMPT))
        other, holder = proxy.prefill.backends
        holder.queued_tokens, other.queued_tokens = 30, 5  # as if legs were running: 31 against 29
        over = await complete(session, url)
        holder.queued_tokens = 27  # 28 against 29
        within = await complete(session, url)
        queued = (holder.queued_tokens, other.queued_tokens)
        holder.queued_tokens = other.queued_tokens = 0
        return over, within, queued, await metrics(session, url)

    over, within, queued, m = run(ps, [d], go)
    assert over[1] == "p0" and within[1] == "p1"
    assert queued == (27, 5)  # each leg took back what it added
    assert m['kvpp_proxy_prefix_fallbacks_total{reason="overloaded"}'] == 1


@pytest.mark.integration
def test_a_failed_tokenize_or_a_dead_holder_costs_the_hit_not_the_answer():
    ps, d = [Stub("p0", mode="no_tokenize"), Stub("p1")], Stub("d0")

    async def go(session, url, proxy, pubs):
        await holds(proxy, ps[1].url, pubs[1], stub_tokens(PROMPT))
        first = await complete(session, url)  # p0's turn: it is asked to tokenize, and fails
        second = await complete(session, url)  # p1's turn: it tokenizes, and holds the prompt
        return first, second, await metrics(session, url)

    first, second, m = run(ps, [d], go)
    assert first[1] == "p0" and second == (ps[1].url, "p1")
    assert m['kvpp_proxy_prefix_fallbacks_total{reason="tokenize"}'] == 1

    dead, alive = dead_url(), Stub("p1")

    async def gone(session, url, proxy, pubs):
        await holds(proxy, dead, pubs[0], stub_tokens(PROMPT))
        answer = await complete(session, url)  # the holder refuses the connection: out of rotation, index gone
        return answer, len(proxy.router.streams[dead].index), await metrics(session, url)

    answer, left, m = run([dead, alive], [Stub("d0")], gone)
    assert answer == (alive.url, "p1") and left == 0  # with no replay endpoint to check it against
    assert m[f'kvpp_proxy_kv_index_resets_total{{backend="{dead}",reason="down"}}'] == 1


@pytest.mark.unit
def test_kv_events_must_name_one_endpoint_per_prefill():
    from deploy.services.proxy import PDProxy

    with pytest.raises(ValueError, match="one per prefill"):
        PDProxy(["http://127.0.0.1:1", "http://127.0.0.1:2"], ["http://127.0.0.1:3"],
                routing=PrefixRouting(("tcp://127.0.0.1:5557",)))


@pytest.mark.integration
def test_the_prefill_leg_asks_for_a_full_report_of_its_cache_hits():
    """With the cache-aware choice on, a prefill leg asks vLLM to announce again the cached blocks it hits
    (`vllm_xargs.kv_cache_report_mode: full`), beside the client's own extra args; the decode leg is left as the
    client sent it."""
    p, d = Stub("p0"), Stub("d0")

    async def go(session, url, proxy, pubs):
        await complete(session, url, vllm_xargs={"mine": 1})
        return p.requests[-1]["body"], d.requests[-1]["body"]

    prefill, decode = run([p], [d], go)
    assert prefill["vllm_xargs"] == {"mine": 1, "kv_cache_report_mode": "full"}
    assert decode["vllm_xargs"] == {"mine": 1}


@pytest.mark.integration
def test_a_prompt_whose_first_block_no_instance_holds_is_not_tokenized_again():
    """A prompt tokenized once is known by its leading text: while no instance holds its first block, its next
    requests go by load without a /tokenize; once an instance holds it, it is tokenized and routed there."""
    ps, d = [Stub(f"p{i}") for i in range(2)], Stub("d0")

    async def go(session, url, proxy, pubs):
        await holds(proxy, ps[0].url, pubs[0], stub_tokens("Q" * 8))  # some first block, not PROMPT's
        first = [await complete(session, url) for _ in range(3)]
        tokenized = sum(p.tokenized for p in ps)
        await holds(proxy, ps[1].url, pubs[1], stub_tokens(PROMPT))
        later = [await complete(session, url) for _ in range(2)]
        return first, tokenized, later, sum(p.tokenized for p in ps), await metrics(session, url)

    first, tokenized, later, total, m = run(ps, [d], go)
    assert [e for _, e in first] == ["p0", "p1", "p0"] and tokenized == 1
    assert [e for _, e in later] == ["p1", "p1"] and total == 3
    assert m['kvpp_proxy_tokenizations_total{outcome="asked"}'] == 3
    assert m['kvpp_proxy_tokenizations_total{outcome="skipped"}'] == 2
    assert m['kvpp_proxy_prefix_fallbacks_total{reason="miss"}'] == 3


def _post_completion(url: str, prompt: str) -> str:
    """A completion through a proxy process; returns the prefill that computed its prompt."""
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps({**REQUEST, "prompt": prompt}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        return resp.headers["X-Kvpp-Prefill"]


@pytest.mark.integration
def test_a_restarted_proxy_sends_each_conversation_back_to_its_prefill(tmp_path):
    """Two conversations cached on different prefills (their events published before the proxy ever ran): a
    `kvpp proxy` process learns both from the prefills' replay endpoints before its first choice, and so does the
    one that replaces it after a SIGKILL. Every turn, before and after, lands on its conversation's prefill, where
    the rotation alone would send one of each pair elsewhere."""
    live, replay = [free_port(), free_port()], [free_port(), free_port()]
    pubs = [ZmqEventPublisher(0, endpoint=f"tcp://*:{p}", replay_endpoint=f"tcp://127.0.0.1:{r}")
            for p, r in zip(live, replay)]
    conversations = ["the first conversation, turn one", "another talk begins here, slowly"]
    try:
        with stubs_in_thread("p0", "p1", "d0") as (p0, p1, d0):
            for pub, text in zip(pubs[::-1], conversations):  # the first on p1, the second on p0
                pub.publish(stored(stub_tokens(text)))
                pub._event_queue.join()
            args = ["--kv-events", ",".join(f"tcp://127.0.0.1:{p}" for p in live),
                    "--kv-events-replay", ",".join(f"tcp://127.0.0.1:{r}" for r in replay)]
            served = []
            for run_ in range(2):
                proc, url = start_proxy([p0.url, p1.url], [d0.url], tmp_path / f"proxy{run_}.log", extra_args=args)
                try:
                    for turn in (" and a second turn", " then a third"):
                        served += [_post_completion(url, text + turn) for text in conversations]
                finally:
                    os.kill(proc.pid, signal.SIGKILL)  # a crash: nothing of its index is kept
                    proc.stop()
    finally:
        for pub in pubs:
            pub.shutdown()
    assert served == [p1.url, p0.url] * 4


def stream_of_index(endpoint):
    registry = CollectorRegistry()
    return EventStream("p0", endpoint, PrefixIndex(10_000), EventMetrics(registry), 5.0), registry


async def until_matched(stream, tokens, blocks, timeout=20.0):
    from tests.helpers.vllm_scheduler import BLOCK

    deadline = time.monotonic() + timeout
    while stream.index.matched_blocks(iter_keys(tokens, BLOCK)) < blocks:
        assert time.monotonic() < deadline, "the index did not learn the prefix in time"
        await asyncio.sleep(0.05)


def _scheduler_publishing(model: str, endpoint: str):
    """vLLM's own Scheduler over the tiny model's blocks, its prefix cache on and its KV events published on
    `endpoint` (the engine's publisher, as `--kv-events-config` makes it)."""
    from vllm.config.kv_events import KVEventsConfig

    from tests.helpers.vllm_scheduler import engine_config, scheduler

    config = engine_config(model, None)
    config.cache_config.enable_prefix_caching = True  # on CPU vLLM keeps it only on AMX_MLA; no kernel runs here
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
    return scheduler(config)


def _served(sched, req_id: str, prompt: list[int], report: dict | None = None) -> None:
    """A prefill leg on `sched`: the request is scheduled until it has its one token, then it finishes."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from tests.helpers.vllm_scheduler import BLOCK, step

    init_none_hash(sha256)
    sched.add_request(Request(req_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True, extra_args=report),
                              None, block_hasher=get_request_block_hasher(BLOCK, sha256)))
    while req_id in sched.requests:
        step(sched)


@pytest.mark.vllm
def test_a_full_report_lets_an_index_that_lost_everything_relearn_a_conversation_in_one_request(tiny_model):
    """vLLM's scheduler publishes a block once, when it is first cached: an index started after a conversation's
    first turn (a restarted proxy with no replay endpoint) learns nothing of its prefix from the second turn alone
    (the new blocks' parents are unknown: orphans). The proxy's prefill legs ask for a full report (FULL_REPORT):
    then the turn's cache hits are announced again, from the first block, and the whole conversation is indexed
    after that one request."""
    from tests.helpers.vllm_scheduler import BLOCK

    port = free_port()
    sched = _scheduler_publishing(tiny_model, f"tcp://*:{port}")
    first = list(range(1000, 1000 + 4 * BLOCK + 3))
    stream, registry = stream_of_index(f"tcp://127.0.0.1:{port}")

    async def go():
        _served(sched, "turn1", first)
        sched.kv_event_publisher._event_queue.join()  # published before anyone listens: lost
        task = asyncio.create_task(run_streams([stream]))
        try:
            second = []
            for attempt in range(40):  # a SUB misses what precedes its join: a new second turn until one is seen
                if stream.index.orphans:
                    break
                second = first + list(range(2000 + 100 * attempt, 2000 + 100 * attempt + 2 * BLOCK))
                _served(sched, f"turn2-incremental-{attempt}", second)
                await asyncio.sleep(0.5)
            assert stream.index.orphans, "the index never heard a second turn"
            learned_incremental = stream.index.matched_blocks(iter_keys(second, BLOCK))
            _served(sched, "turn2-full", second, {**FULL_REPORT})
            await until_matched(stream, second, len(second) // BLOCK)
            return second, learned_incremental
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    try:
        second, learned_incremental = asyncio.run(go())
    finally:
        sched.shutdown()
    assert learned_incremental == 0  # the second turn's own blocks wait for parents no event named
    assert stream.index.matched_blocks(iter_keys(second, BLOCK)) == len(second) // BLOCK == 6
    assert stream.index.orphans == 0
