"""`kvpp proxy --kv-events` against real engines: two prefills (TP2, vLLM's prefix cache on, `--kv-events-config`
publishing, with its replay endpoint) and one decode, P/D over MooncakeConnectorV2. Several conversations of several
turns: every turn after the first lands on the prefill that served the conversation's earlier turns, where the
rotation alone would have sent some elsewhere, and those prefills' own prefix-cache counters show the hits; every
answer agrees with the decode's own greedy answer. So do the turns after the proxy is killed and replaced
mid-conversation, and after an event gap. A proxy whose event stream for one prefill is garbage, then dead, answers
the same conversations correctly, by load.

Two kinds of engine run it (KINDS). The tiny GQA model on vLLM's CPU attention kernel (fp32), whose prefix cache is on
every x86 host, runs everywhere: two KVPP-off prefills and a decode of the same TP (a decode reads each KV head from
the prefill rank holding it). The tiny MLA model needs AMX: the reference kernel (CPU_MLA) has vLLM's prefix cache off
for MLA, so there would be nothing to route to; on AMX_MLA (bf16) two KVPP prefills (staging) feed a TP1 decode.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass

import pytest
import zmq

from deploy.harness.demo import answer_agreement, completion_answer
from deploy.harness.engines import engine_metrics, metric_total
from deploy.deployment.launch import kv_events_flags
from deploy.harness.tiny_model import sample_prompt
from deploy.services.ports import free_port, free_port_range
from deploy.services.processes import AMX, GQA, CpuEngine, ManagedProcess, start_servers
from deploy.services.proxy import start_proxy
from kvpp_core.cpu_backends import host_has_amx
from testbed.pd_servers import pd_server
from tests.helpers.event_relay import EventRelay
from tests.helpers.pd_http import post, wait_for

pytestmark = pytest.mark.engine

CONVERSATIONS = 3  # interleaved over 2 prefills: the rotation alone would move every other later turn
TURNS = 3
FIRST_WORDS, TURN_WORDS = 300, 140  # the tiny tokenizer: one token per word; blocks of 128 (AMX) or 32 (GQA) tokens
ANSWER = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 2}


@dataclass(frozen=True)
class Kind:
    """What a stack runs: the model (a session fixture's name), the engine, the prefills' further instance keys, and
    the decode's TP and cores."""

    model: str
    engine: CpuEngine
    prefill: dict
    decode_cores: tuple[int, ...]


KINDS = {
    "gqa": Kind("tiny_gqa_model", GQA, {}, (0, 1)),
    "amx-mla": Kind("tiny_model", AMX, {"enable_kvpp": True, "additional_config": {"kvpp_staging_buffers": 2}}, (1,)),
}


def _prefill(name: str, model: str, tmp, kind: Kind):
    """A prefill publishing its KV cache events and replaying them on free ports (the instance's kv_events, rendered
    as a deployment's)."""
    return pd_server(name, model, tmp, tp=2, cores=[0, 1], role="kv_producer", kv_port=free_port_range(3),
                     server={"engine": kind.engine, **kind.prefill, "kv_events": True, "kv_events_port": free_port(),
                             "kv_events_replay_port": free_port()})


@pytest.fixture(scope="module", params=["gqa", pytest.param("amx-mla", marks=pytest.mark.skipif(
    not host_has_amx(), reason="vLLM's prefix cache is on for MLA only on AMX_MLA, which needs a CPU with AMX tiles "
    "(amx_tile in /proc/cpuinfo); this host has none"))])
def stack(request, tmp_path_factory):
    kind = KINDS[request.param]
    model = request.getfixturevalue(kind.model)
    tmp = tmp_path_factory.mktemp(f"routing-{request.param}")
    started: list[ManagedProcess] = []
    try:
        prefills = [_prefill(f"prefill{i}", model, tmp, kind) for i in range(2)]
        decode = pd_server("decode", model, tmp, tp=len(kind.decode_cores), cores=list(kind.decode_cores),
                           role="kv_consumer", kv_port=free_port_range(2), server={"engine": kind.engine})
        start_servers((*prefills, decode), started, timeout=600)
        proxy, url = start_proxy([p.url for p in prefills], [decode.url], tmp / "proxy.log",
                                 extra_args=kv_events_flags([p.kv_events for p in prefills]))
        started.append(proxy)
        yield {"prefills": prefills, "decode": decode, "proxy": url, "model": model, "tmp": tmp,
               "engine": kind.engine}
    finally:
        for proc in reversed(started):
            proc.stop()


def _complete(url: str, model: str, prompt: str) -> tuple[dict, str | None]:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(
        {"model": model, "prompt": prompt, **ANSWER}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read()), resp.headers.get("X-Kvpp-Prefill")


class Conversations:
    """CONVERSATIONS conversations, advanced turn by turn through a proxy; each turn's prompt is the last one, its
    answer and new words. `served[c]` is the (prefill used, prompt tokens) of each of conversation c's turns, every
    answer checked against the decode serving the same prompt alone."""

    def __init__(self, stack, seed: int):
        self.stack, self.seed = stack, seed
        self.prompts = [sample_prompt(FIRST_WORDS, seed=seed + c) for c in range(CONVERSATIONS)]
        self.served: list[list[tuple[str | None, int]]] = [[] for _ in range(CONVERSATIONS)]

    def turn(self, proxy_url: str) -> None:
        model, decode = self.stack["model"], self.stack["decode"].url
        for c in range(CONVERSATIONS):
            turn = len(self.served[c])
            got, prefill = _complete(proxy_url, model, self.prompts[c])
            reference = completion_answer(post(f"{decode}/v1/completions",
                                               {"model": model, "prompt": self.prompts[c], **ANSWER}))
            agreement = answer_agreement(completion_answer(got), reference, self.stack["engine"])
            assert agreement["matches_reference"], f"conversation {c} turn {turn}: {agreement}"
            self.served[c].append((prefill, got["usage"]["prompt_tokens"]))
            self.prompts[c] += got["choices"][0]["text"] + " " + sample_prompt(TURN_WORDS,
                                                                                seed=self.seed + 100 * turn + c)


def _converse(stack, proxy_url: str, seed: int) -> list[list[tuple[str | None, int]]]:
    """CONVERSATIONS conversations of TURNS turns, interleaved turn by turn (Conversations.served)."""
    conversations = Conversations(stack, seed)
    for _ in range(TURNS):
        conversations.turn(proxy_url)
    return conversations.served


def _proxy_metrics(url: str) -> str:
    return urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()


def _prefix_hits(prefills) -> float:
    return sum(metric_total(engine_metrics(p.url), "vllm:prefix_cache_hits_total") for p in prefills)


def test_turns_land_where_their_prefix_is(stack):
    prefills = stack["prefills"]
    hits_before = _prefix_hits(prefills)
    served = _converse(stack, stack["proxy"], seed=10)
    urls = [p.url for p in prefills]
    firsts = [turns[0][0] for turns in served]
    assert set(firsts) == set(urls), f"the first turns went by turn over both prefills: {firsts}"
    for c, turns in enumerate(served):
        assert [p for p, _ in turns] == [firsts[c]] * TURNS, f"conversation {c} moved: {turns}"
    # The rotation alone: request i to prefill i % 2 (turn-major order): every other later turn lands elsewhere.
    rotation = [urls[(turn * CONVERSATIONS + c) % 2] for turn in range(1, TURNS) for c in range(CONVERSATIONS)]
    chosen = [served[c][turn][0] for turn in range(1, TURNS) for c in range(CONVERSATIONS)]
    assert sum(r != s for r, s in zip(rotation, chosen)) >= CONVERSATIONS
    m = _proxy_metrics(stack["proxy"])
    assert metric_total(m, "kvpp_proxy_prefix_hits_total") == CONVERSATIONS * (TURNS - 1)
    # Each later turn finds at least the full blocks of the previous turn's prompt in its prefill's cache.
    block = stack["engine"].block_size
    expected = sum(turns[t - 1][1] // block * block for turns in served for t in range(1, TURNS))
    # Engine counters reach /metrics with the next stats interval.
    wait_for(lambda: _prefix_hits(prefills) - hits_before >= expected, 30,
             f"the prefills' prefix-cache hits of at least the {expected} tokens of the previous prompts' full blocks")
    hits = _prefix_hits(prefills) - hits_before
    print(f"cache-aware routing: first turns on {[urls.index(f) for f in firsts]}, later turns all on theirs "
          f"({sum(r != s for r, s in zip(rotation, chosen))} of {len(chosen)} where the rotation would have moved "
          f"them); the prefills' prefix-cache hits {hits:.0f} tokens, at least {expected} expected; "
          f"prompts {[[n for _, n in turns] for turns in served]} tokens")


def test_a_garbage_then_dead_event_stream_costs_hits_not_answers(stack):
    """A second proxy hears garbage, then nothing, for prefill0 (a PUB socket of the test's that then closes), and
    prefill1's real events: the conversations still answer like the decode alone."""
    context = zmq.Context.instance()
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def garbage():
        seq = 0
        while not stop.is_set():
            pub.send_multipart([b"", seq.to_bytes(8, "big"), b"\xc1 not msgpack"])
            pub.send_multipart([b"only a frame"])
            seq += 1
            time.sleep(0.05)

    feeder = threading.Thread(target=garbage, daemon=True)
    feeder.start()
    prefills = stack["prefills"]
    events = [f"tcp://127.0.0.1:{port}", prefills[1].kv_events[0]]  # and no replay: what the stream says goes
    proxy, url = start_proxy([p.url for p in prefills], [stack["decode"].url], stack["tmp"] / "proxy-garbage.log",
                             extra_args=["--kv-events", ",".join(events), "--kv-events-timeout", "1"])
    try:
        time.sleep(2)
        _converse(stack, url, seed=40)
        stop.set()
        feeder.join()
        pub.close(linger=0)  # the stream dies mid-run
        _converse(stack, url, seed=70)
        m = _proxy_metrics(url)
        refused = metric_total(m, "kvpp_proxy_kv_event_refused_total")
        print(f"garbage then a dead stream for prefill0: {refused:.0f} messages refused, "
              f"{metric_total(m, 'kvpp_proxy_prefix_hits_total'):.0f} hits and "
              f"{metric_total(m, 'kvpp_proxy_prefix_fallbacks_total'):.0f} fallbacks over {2 * CONVERSATIONS * TURNS} "
              "requests, every answer like the decode's own")
        assert refused > 0
        assert re.search(r'^kvpp_proxy_requests_total\{path="pd"\} (\S+)$', m, re.M).group(1) == \
            str(2 * CONVERSATIONS * TURNS)
    finally:
        stop.set()
        proxy.stop()


def test_after_a_proxy_restart_and_an_event_gap_turns_return_to_their_prefill(stack):
    """Mid-conversation the proxy is killed (SIGKILL: its index is lost) and replaced: the new one learns from the
    prefills' replay endpoints what they hold before its first choice. Later, every event of one turn is lost
    between the prefills and the proxy (a relay drops them: an event gap), and the proxy notices at the next event.
    Before each of those turns a request of another prompt puts the rotation out of step with the conversations'
    prefills, so a proxy that had lost track would move every one of them. At least 90% of the turns after the
    restart and after the gap land on their conversation's prefill, and every answer agrees with the decode's own."""
    prefills, decode = stack["prefills"], stack["decode"].url
    urls = [p.url for p in prefills]
    strangers = iter(range(1000, 2000))

    def out_of_step(url: str, sent: list[int]) -> None:
        """The first turns went by the rotation from its start (conversations 0, 1, 2 on prefills 0, 1, 0): with an
        odd count of requests sent through this proxy, the rotation would send each to the other prefill."""
        if sent[0] % 2 == 0:
            _complete(url, stack["model"], sample_prompt(FIRST_WORDS, seed=next(strangers)))
            sent[0] += 1

    with EventRelay(prefills[0].kv_events[0]) as relay0, EventRelay(prefills[1].kv_events[0]) as relay1:
        relays = (relay0, relay1)
        args = kv_events_flags([(r.endpoint, p.kv_events[1]) for r, p in zip(relays, prefills)])
        conversations = Conversations(stack, seed=130)
        proxy, url = start_proxy(urls, [decode], stack["tmp"] / "proxy-before-restart.log", extra_args=args)
        try:
            conversations.turn(url)
            conversations.turn(url)
        finally:
            os.kill(proxy.pid, signal.SIGKILL)
            proxy.stop()
        proxy, url = start_proxy(urls, [decode], stack["tmp"] / "proxy-after-restart.log", extra_args=args)
        sent = [0]
        try:
            for lose_events in (False, True, False, False):  # after the restart; its events lost; two after the gap
                out_of_step(url, sent)
                for relay in relays:
                    relay.pause() if lose_events else relay.resume()
                conversations.turn(url)
                sent[0] += CONVERSATIONS
                time.sleep(1)  # the turn's last events reach the relays (and are lost, or passed on)
            lost = sum(r.dropped for r in relays)
            m = _proxy_metrics(url)
        finally:
            proxy.stop()
    homes = [turns[0][0] for turns in conversations.served]
    later = [(c, t, turns[t][0]) for c, turns in enumerate(conversations.served) for t in range(2, len(turns))]
    home = sum(prefill == homes[c] for c, _, prefill in later)
    print(f"after a proxy restart and an event gap ({lost} event batches lost): {home} of {len(later)} later turns on "
          f"their conversation's prefill; syncs {metric_total(m, 'kvpp_proxy_kv_index_syncs_total'):.0f}, index resets "
          f"{metric_total(m, 'kvpp_proxy_kv_index_resets_total'):.0f}; served {conversations.served}")
    assert lost > 0, "the relays dropped nothing: no gap was made"
    assert homes == [urls[0], urls[1], urls[0]], f"the first turns went by the rotation: {homes}"
    assert home >= 0.9 * len(later), later
