"""P/D of the tiny GQA model (Llama, one KV head) with real servers, deployed as issue 42's GQA deployment: a
deployment spec of two KVPP prefills (TP2: both ranks hold the one KV head and KVPP splits its layers between them;
one stages foreign layers, one reads them in place) publishing their KV cache events, a TP1 decode, and the
cache-aware `kvpp proxy`, passed by `kvpp check` and started with the commands `kvpp render` writes. vLLM's CPU
attention keeps its prefix cache on every x86 host, so this runs on hosts without AMX.

Every request of several multi-turn conversations goes over P/D (the proxy's path "pd") and answers like the decode
engine serving the prompt by itself (colocated, KVPP off; its prefix cache is off, so its own answers share no block
with what it pulled): the decode reads each of the 8 layers of every prompt block once, from that layer's owner in
whichever prefill the proxy chose, and later turns land on the prefill whose KV events announced their prefix. A
TP2 decode, started for its test alone, reads from the same KVPP prefill: each of its ranks holds the one head.
"""

from __future__ import annotations

import json
import sys
import urllib.request

import pytest

from deploy.deployment.check import check_spec
from deploy.deployment.resolved import resolve
from deploy.deployment.spec import Model, Proxy, Spec, placed
from deploy.harness.engines import engine_metrics, metric_total
from deploy.harness.tiny_model import sample_prompt
from deploy.services.ports import free_port, free_port_range
from deploy.services.processes import GQA, LOOPBACK, Engine, ManagedProcess, cpu_instance, start_servers
from kvpp_core.config import STAGING_KEY
from kvpp_core.platforms import VLLM_CPU
from testbed.pd_servers import pd_server
from tests.helpers.pd_http import MAX_TOKENS, completion, metric, post, tokens_and_logprobs, wait_for

pytestmark = pytest.mark.engine

LAYERS = 8
PAGE_BYTES = GQA.block_size * 2 * 32 * 4  # one layer's block: 32 tokens x K and V of the one KV head (32) x fp32
KV_BYTES = 32 << 20
ENGINE_ENV = {"MC_LOG_LEVEL": "ERROR"}
DECODE_ARGS = ("--no-enable-prefix-caching",)
"""The decode computes or pulls every prompt block: its answers alone are the colocated reference, and a P/D
request pulls its whole prompt."""
FULL = {"ignore_eos": True}
"""Every answer MAX_TOKENS long: the tiny model's greedy answers often end early at its EOS."""
LOGPROB_TOL = 1e-4  # TP2 prefill vs the TP1 engine alone: fp32 sums in another order, same tokens
CONVERSATIONS = 3  # interleaved over 2 prefills: the rotation alone would move every later turn
TURNS = 2
FIRST_WORDS, TURN_WORDS = 150, 60  # the tiny tokenizer: one token per word; blocks of 32 tokens


def _prefill(name: str, staging: int):
    """A KVPP prefill (TP2) publishing its KV cache events and replaying them, on free ports."""
    return cpu_instance(name, LOOPBACK, free_port(), 2, [0, 1], KV_BYTES, log_stats=True, env=ENGINE_ENV, engine=GQA,
                        kv_port=free_port_range(3), enable_kvpp=True, additional_config={STAGING_KEY: staging},
                        kv_events=True, kv_events_port=free_port(), kv_events_replay_port=free_port())


def deployment(model: str) -> Spec:
    """Issue 42's GQA deployment on loopback: two TP2 KVPP prefills (staging, zero-copy), a TP1 decode, the
    cache-aware proxy."""
    decode = cpu_instance("decode", LOOPBACK, free_port(), 1, [1], KV_BYTES, log_stats=True, env=ENGINE_ENV,
                          engine=GQA, extra_args=DECODE_ARGS, kv_port=free_port_range(2))
    return placed(Spec(model=Model(path=model), platform=VLLM_CPU.name,
                       prefill=(_prefill("prefill-staging", 2), _prefill("prefill-zero-copy", 0)), decode=(decode,),
                       proxy=Proxy(host=LOOPBACK, port=free_port(), cache_aware=True)))


@pytest.fixture(scope="module")
def stack(tiny_gqa_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gqa-pd")
    spec = deployment(tiny_gqa_model)
    resolved = resolve(spec)
    errors = [str(f) for f in check_spec(spec) if f.severity == "error"]
    assert not errors, errors  # `kvpp check` passes the deployment: the decode reads the head from either rank
    started: list[ManagedProcess] = []
    try:
        engines = [Engine(instance, tmp / f"{instance.instance.name}.log") for instance in resolved.instances]
        start_servers(engines, started, timeout=600)
        argv = list(resolved.proxy.argv)
        assert argv[:2] == ["kvpp", "proxy"] and "--kv-events" in argv
        argv[argv.index("--host") + 1] = LOOPBACK  # as the engines, on loopback only
        proxy = ManagedProcess("kvpp-proxy", [sys.executable, "-m", "deploy.cli.main", *argv[1:]],
                               tmp / "proxy.log").start()
        started.append(proxy)
        url = f"http://{LOOPBACK}:{spec.proxy.port}"
        proxy.wait_http(f"{url}/health", timeout=60)
        yield {"prefills": engines[:2], "decode": engines[2], "proxy": url, "model": tiny_gqa_model, "tmp": tmp}
    finally:
        for proc in reversed(started):
            proc.stop()


def _via_proxy(url: str, model: str, prompt: str) -> tuple[dict, dict[str, str]]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1, **FULL}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def _assert_same_answer(got: dict, ref: dict, what: str) -> None:
    tokens, lps = tokens_and_logprobs(got)
    ref_tokens, ref_lps = tokens_and_logprobs(ref)
    assert len(tokens) == MAX_TOKENS and tokens == ref_tokens, f"{what}: {tokens} vs {ref_tokens}"
    assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= LOGPROB_TOL, f"{what}: {lps} vs {ref_lps}"


_PULLS = ("mooncake_v2_pulls_total", "mooncake_v2_pulled_bytes_total", "mooncake_v2_failed_pulls_total",
          "external_prefix_cache_hits_total")


def _pull_counters(decode) -> dict[str, float]:
    return {name: metric(decode.url, f"vllm:{name}") for name in _PULLS}


def _pulled_since(decode, before: dict[str, float], pulls: int) -> dict[str, float]:
    wait_for(lambda: metric(decode.url, "vllm:mooncake_v2_pulls_total") >= before["mooncake_v2_pulls_total"] + pulls,
             30, "pulls counted")
    after = _pull_counters(decode)
    return {name: after[name] - before[name] for name in after}


def _pages(tokens: int) -> int:
    return -(-tokens // GQA.block_size)


def _proxy_paths(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {path: metric_total(text, f'kvpp_proxy_requests_total{{path="{path}"}}')
            for path in ("pd", "decode_only", "prefill_only", "failed")} | {
        "prefix_hits": metric_total(text, "kvpp_proxy_prefix_hits_total")}


def _prefix_hits(prefills) -> float:
    return sum(metric_total(engine_metrics(p.url), "vllm:prefix_cache_hits_total") for p in prefills)


def test_every_turn_goes_over_pd_to_the_prefill_holding_its_prefix_and_answers_like_a_colocated_engine(stack):
    prefills, decode, model = stack["prefills"], stack["decode"], stack["model"]
    urls = [p.url for p in prefills]
    prompts = [sample_prompt(FIRST_WORDS, seed=40 + c) for c in range(CONVERSATIONS)]
    served: list[list[tuple[str, int]]] = [[] for _ in range(CONVERSATIONS)]
    paths, pulls, hits = _proxy_paths(stack["proxy"]), _pull_counters(decode), _prefix_hits(prefills)
    for turn in range(TURNS):
        for c in range(CONVERSATIONS):
            got, headers = _via_proxy(stack["proxy"], model, prompts[c])
            assert headers.get("X-Kvpp-Path") == "pd", headers
            _assert_same_answer(got, completion(decode.url, model, prompts[c], **FULL), f"conversation {c} turn {turn}")
            served[c].append((headers["X-Kvpp-Prefill"], got["usage"]["prompt_tokens"]))
            prompts[c] += got["choices"][0]["text"] + " " + sample_prompt(TURN_WORDS, seed=400 + 10 * turn + c)
    requests = CONVERSATIONS * TURNS
    after = _proxy_paths(stack["proxy"])
    assert {k: after[k] - paths[k] for k in after} == {"pd": requests, "decode_only": 0, "prefill_only": 0,
                                                       "failed": 0, "prefix_hits": CONVERSATIONS * (TURNS - 1)}
    # The decode pulled every request's whole prompt, all 8 layers of each block once (each from its owner).
    tokens = [n for turns in served for _, n in turns]
    assert _pulled_since(decode, pulls, requests) == {
        "mooncake_v2_pulls_total": requests, "mooncake_v2_failed_pulls_total": 0,
        "mooncake_v2_pulled_bytes_total": sum(LAYERS * _pages(n) * PAGE_BYTES for n in tokens),
        "external_prefix_cache_hits_total": sum(tokens)}
    # Both prefills (staging, zero-copy) served first turns; every later turn stayed on its conversation's prefill,
    # which found at least the earlier prompt's whole blocks in its prefix cache.
    firsts = [turns[0][0] for turns in served]
    assert set(firsts) == set(urls), firsts
    for c, turns in enumerate(served):
        assert [p for p, _ in turns] == [firsts[c]] * TURNS, f"conversation {c} moved: {turns}"
    expected = sum(turns[t - 1][1] // GQA.block_size * GQA.block_size for turns in served for t in range(1, TURNS))
    wait_for(lambda: _prefix_hits(prefills) - hits >= expected, 30,
             f"the prefills' prefix-cache hits of the {expected} tokens of the earlier prompts' whole blocks")


@pytest.fixture(scope="module")
def decode_tp2(stack):
    """A TP2 decode beside the stack (both its ranks hold the one KV head), for the last test."""
    engine = pd_server("decode-tp2", stack["model"], stack["tmp"], tp=2, cores=[0, 1], role="kv_consumer",
                       kv_port=free_port_range(3), extra_args=DECODE_ARGS,
                       server={"engine": GQA, "kv_cache_bytes": KV_BYTES})
    try:
        engine.start()
        engine.wait_ready(timeout=600)
        yield engine
    finally:
        engine.stop()


@pytest.mark.parametrize("prefill", [0, 1], ids=["staging", "zero-copy"])
def test_a_tp2_decode_reads_its_head_from_a_kvpp_prefill_and_answers_like_a_colocated_engine(stack, decode_tp2,
                                                                                               prefill):
    model, n = stack["model"], 130
    prompt = sample_prompt(n, seed=77 + prefill)
    reference = completion(stack["decode"].url, model, prompt, **FULL)
    before = _pull_counters(decode_tp2)
    first = post(f"{stack['prefills'][prefill].url}/v1/completions",
                 {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                  "kv_transfer_params": {"do_remote_decode": True}})
    params = first["kv_transfer_params"]
    assert (params["remote_tp_size"], params["remote_num_tokens"]) == (2, n)
    _assert_same_answer(completion(decode_tp2.url, model, prompt, kv_transfer_params=params, **FULL), reference,
                        "TP2 decode")
    delta = _pulled_since(decode_tp2, before, 1)
    # Each decode rank read the 8 layers of every block (the one head) from their owners: twice the TP1 decode's.
    assert delta["mooncake_v2_failed_pulls_total"] == 0, delta
    assert delta["mooncake_v2_pulled_bytes_total"] == 2 * LAYERS * _pages(n) * PAGE_BYTES, delta
    assert delta["external_prefix_cache_hits_total"] == n, delta
