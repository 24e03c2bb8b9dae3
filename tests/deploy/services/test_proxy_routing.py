"""`kvpp proxy --kv-events`: the cache-aware choice of prefill against stub backends, each prefill's KV events
published by vLLM's own `ZmqEventPublisher` over real ZMQ: the holder of the longest prefix gets the prefill leg,
and every case the index cannot decide is routed by turn, counted by reason, and answered."""

import asyncio
import time

import pytest
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from deploy.services.ports import free_port
from deploy.services.routing import PrefixRouting, tokenize_request
from tests.deploy.services.test_proxy import FAST, dead_url, metrics
from tests.helpers.stub_engine import REQUEST, Stub, stub_tokens, with_proxy

BS = 4
PROMPT = REQUEST["prompt"] + " and more words"  # 24 characters: 6 full blocks of the stubs' tokens


def publishers(n):
    ports = [free_port() for _ in range(n)]
    pubs = [ZmqEventPublisher(0, endpoint=f"tcp://*:{p}") for p in ports]
    return pubs, PrefixRouting(tuple(f"tcp://127.0.0.1:{p}" for p in ports), overload_margin=2, event_timeout=2)


def stored(tokens):
    """The BlockStored vLLM sends for a prompt's full blocks (its own hashes: the proxy's keys do not use them)."""
    n = len(tokens) // BS
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=[f"{tokens[:(i + 1) * BS]}".encode() for i in range(n)], parent_block_hash=None,
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
    for batch in ({"prompt": ["a", "b"]}, {"prompt": [[1], [2]]}, {}, {"prompt": [True]}):
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
def test_an_overloaded_holder_is_passed_over():
    """The holder has more prefill legs in flight than the least loaded instance plus the margin (2)."""
    ps, d = [Stub(f"p{i}") for i in range(2)], Stub("d0")

    async def go(session, url, proxy, pubs):
        await holds(proxy, ps[1].url, pubs[1], stub_tokens(PROMPT))
        holder = proxy.prefill.backends[1]
        holder.in_flight = 3  # as if three legs were running on it
        over = await complete(session, url)
        holder.in_flight = 2  # within the margin
        within = await complete(session, url)
        holder.in_flight = 0
        return over, within, await metrics(session, url)

    over, within, m = run(ps, [d], go)
    assert over[1] == "p0" and within[1] == "p1"
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
    assert answer == (alive.url, "p1") and left == 0
    assert m[f'kvpp_proxy_kv_index_resets_total{{backend="{dead}",reason="down"}}'] == 1


@pytest.mark.unit
def test_kv_events_must_name_one_endpoint_per_prefill():
    from deploy.services.proxy import PDProxy

    with pytest.raises(ValueError, match="one per prefill"):
        PDProxy(["http://127.0.0.1:1", "http://127.0.0.1:2"], ["http://127.0.0.1:3"],
                routing=PrefixRouting(("tcp://127.0.0.1:5557",)))
