"""`kvpp demo`: the whole suite working on one machine, with an embedded default and no arguments.

It builds the tiny MLA model, measures a colocated reference engine (TP=2, KVPP off), then starts
the Mooncake pool, a prefill engine (TP=2, KVPP on, MooncakeConnectorV2 producer plus the pool
through vLLM's MultiConnector), a decode engine (TP=1, consumer) and the P/D proxy, all on loopback.
It sends a few requests through the proxy, one of which repeats a long prefix, and reports KV
capacity against the plan, the P/D transfer, the pool hits, and whether every answer equals the
reference. Every process it started is stopped at the end, on failure and on Ctrl-C.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from deploy.harness.engines import (KV_BYTES, LAYERS, engine_metrics, engine_num_blocks, engine_server, metric_total,
                                    pd_servers)
from deploy.services.processes import AMX, GQA, REFERENCE, CpuEngine, ManagedProcess, host_engine, start_servers
from deploy.services.proxy import start_proxy
from deploy.harness.tiny_model import build_tiny_model, sample_prompt
from kvpp_core.capacity import CapacityPlan, plan_capacity
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology

MAX_TOKENS = 8
POOL_BOUNDS = {"backend_timeout_ms": 20_000, "backend_timeout_floor_ms": 20_000, "lookup_timeout_ms": 25_000}
"""The demo runs its engines, the pool and the proxy on one host, which may be small and busy, and reports the pool's
hits: every store call is bounded by 20 s rather than the connector's short defaults (0.5-3 s, for a pool on hosts
of its own), so that a starved call is not counted failed and its prefix recomputed."""


@dataclass(frozen=True)
class Agreement:
    """How close the P/D answers must be to the colocated engine's. The decode runs TP=1 and the reference TP=2,
    so their reductions round differently: in fp32 by less than `logprob_gap`, tokens always equal; in bf16 by
    up to ~0.1 (measured here), so where the reference's two best tokens lie closer than `near_tie` the other
    one may be picked, and the two continuations part from there."""

    logprob_gap: float
    near_tie: float


AGREEMENT = {REFERENCE.kernel.name: Agreement(1e-4, 0.0), GQA.kernel.name: Agreement(1e-4, 0.0),
             AMX.kernel.name: Agreement(0.25, 0.25)}


@dataclass(frozen=True)
class DemoRequest:
    name: str
    prompt: str


def _requests() -> list[DemoRequest]:
    shared = sample_prompt(320, seed=1)
    return [
        DemoRequest("long", shared + " " + sample_prompt(40, seed=2)),
        DemoRequest("short", sample_prompt(30, seed=3)),
        DemoRequest("medium", sample_prompt(150, seed=4)),
        # Repeats the long request's 320-word prefix: the prefill finds those blocks in the pool.
        DemoRequest("long-prefix-again", shared + " " + sample_prompt(25, seed=5)),
    ]


def progress(message: str) -> None:
    print(f"[kvpp demo] {message}", file=sys.stderr, flush=True)


class DemoError(RuntimeError):
    """A step of the demo failed; the message says which and why."""


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise DemoError(f"{url} answered {exc.code}: {exc.read().decode(errors='replace')[:500]}") from None


def completion_answer(resp: dict) -> dict:
    """What answers are compared by (`answer_agreement`): a completion's text, tokens, their logprobs and the best
    two logprobs of each step (it needs `"logprobs": 2`)."""
    lp = resp["choices"][0]["logprobs"]
    return {"text": resp["choices"][0]["text"], "tokens": lp["tokens"], "logprobs": lp["token_logprobs"],
            "top": [sorted(top.values(), reverse=True) for top in lp["top_logprobs"]]}


def _complete(base_url: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2}
    return completion_answer(_post(f"{base_url}/v1/completions", body))


def answer_agreement(got: dict, ref: dict, engine: CpuEngine) -> dict:
    """Whether `got` answers like `ref` within the engine's Agreement, and where a near tie parted them (None:
    every token equal)."""
    rule = AGREEMENT[engine.kernel.name]
    for i, (mine, theirs) in enumerate(zip(got["tokens"], ref["tokens"], strict=True)):
        if mine != theirs:
            best, second = (ref["top"][i] + [float("-inf")])[:2]
            return {"matches_reference": best - second <= rule.near_tie, "parted_at_near_tie": i}
        if abs(got["logprobs"][i] - ref["logprobs"][i]) > rule.logprob_gap:
            return {"matches_reference": False, "parted_at_near_tie": None}
    return {"matches_reference": True, "parted_at_near_tie": None}


def _plan(model: str, engine: CpuEngine) -> CapacityPlan:
    """`kvpp plan` for the stack's prefill: TP2, the demo's KV budget, in `engine`'s dtype and block size."""
    spec = ModelSpec.from_hf_config(model).with_overrides(kv_dtype=engine.dtype)
    return plan_capacity(spec, Topology(tp=2), KV_BYTES, block_size=engine.block_size)


def _drive(requests: list[DemoRequest], model: str, proxy_url: str, prefill_urls: list[str], decode_url: str,
           expected: dict[str, dict], blocks_off: int, engine: CpuEngine) -> dict:
    """Send the requests through the proxy and build the report from the engines' own counters (pool
    counters summed over the prefill instances, capacity from the first, which runs KVPP)."""
    answers, seconds = {}, {}
    for r in requests:
        t0 = time.perf_counter()
        answers[r.name] = _complete(proxy_url, model, r.prompt)
        seconds[r.name] = time.perf_counter() - t0
    # Counters reach /metrics with the next stats interval.
    time.sleep(6)
    decode_metrics = engine_metrics(decode_url)
    prefill_metrics = [engine_metrics(url) for url in prefill_urls]
    blocks_on = engine_num_blocks(prefill_urls[0])
    plan = _plan(model, engine)
    report = {
        "engine": {"kernel": engine.kernel.name, "dtype": engine.dtype, "block_size": engine.block_size},
        "capacity": {
            "blocks_off": blocks_off,
            "blocks_on": blocks_on,
            "ratio": blocks_on / blocks_off,
            "plan_blocks_off": plan.blocks_off,
            "plan_blocks_on": plan.blocks_on,
            "plan_ratio": plan.ratio,
        },
        "transfer": {
            "bytes": int(metric_total(decode_metrics, "vllm:mooncake_v2_pulled_bytes_total")),
            "seconds": metric_total(decode_metrics, "vllm:mooncake_v2_transfer_seconds_total"),
            "pulls": int(metric_total(decode_metrics, "vllm:mooncake_v2_pulls_total")),
            "failures": int(metric_total(decode_metrics, "vllm:mooncake_v2_failed_pulls_total")),
        },
        "pool": {
            # The engine's own count of prompt tokens that came through a connector: on the
            # prefill only the pool loads anything.
            "hit_tokens": int(sum(metric_total(m, "vllm:external_prefix_cache_hits_total") for m in prefill_metrics)),
            # vLLM's own prefix cache (on with AMX_MLA) finds a repeated prefix before the pool is asked.
            "local_hit_tokens": int(sum(metric_total(m, "vllm:prefix_cache_hits_total") for m in prefill_metrics)),
            "loaded_bytes": int(sum(metric_total(m, "vllm:kv_pool_loaded_bytes_total") for m in prefill_metrics)),
            "saved_bytes": int(sum(metric_total(m, "vllm:kv_pool_saved_bytes_total") for m in prefill_metrics)),
        },
        "requests": {
            r.name: {"seconds": seconds[r.name], "text": answers[r.name]["text"],
                     **answer_agreement(answers[r.name], expected[r.name], engine)}
            for r in requests
        },
    }
    report["answers_match"] = all(r["matches_reference"] for r in report["requests"].values())
    return report


def run_demo(workdir: Path) -> dict:
    from deploy.services.pool import pool_down, pool_up

    started: list[ManagedProcess] = []
    pool_dir = workdir / "pool"
    pool_started = False
    requests = _requests()
    try:
        engine = host_engine()
        progress(f"1/5 building the tiny 16-layer MLA model; this host runs it on {engine.kernel.name} "
                 f"({engine.dtype}, block size {engine.block_size})")
        model = str(build_tiny_model(workdir / "tiny16", layers=LAYERS))

        progress("2/5 colocated reference engine (TP=2, KVPP off): capacity and answers")
        reference = engine_server("reference", model, workdir, 2, [0, 1], [], engine=engine)
        start_servers((reference,), started, timeout=600)
        blocks_off = engine_num_blocks(reference.url)
        expected = {r.name: _complete(reference.url, model, r.prompt) for r in requests}
        reference.stop()
        started.remove(reference)

        progress("3/5 Mooncake pool (mooncake_master + segment holder)")
        pool = pool_up("mooncake", pool_dir, segment_bytes=256 << 20)
        pool_started = True

        progress("4/5 prefill (TP=2, KVPP on), decode (TP=1) and the P/D proxy")
        prefill, decode = pd_servers(model, workdir, pool.kv_connector_extra_config, engine=engine,
                                     pool_settings=POOL_BOUNDS)
        start_servers((prefill, decode), started, timeout=600)
        proxy, proxy_url = start_proxy([prefill.url], [decode.url], workdir / "proxy.log")
        started.append(proxy)

        progress("5/5 requests through the proxy")
        return _drive(requests, model, proxy_url, [prefill.url], decode.url, expected, blocks_off, engine)
    finally:
        for proc in reversed(started):
            proc.stop()
        if pool_started:
            pool_down(pool_dir)


def run_demo_hosts(workdir: Path) -> dict:
    """The demo's stack as a rendered deployment across five network-namespace hosts (needs root):
    `kvpp check` and `kvpp render --launcher api-server` produce the scripts, each runs on its host."""
    from deploy.harness.multihost import HOSTS, RenderedStack, cpu_spec
    from deploy.harness.testbed import Testbed

    requests = _requests()
    progress("1/4 building the tiny 16-layer MLA model")
    model = str(build_tiny_model(workdir / "tiny16", layers=LAYERS))
    with Testbed(list(HOSTS)) as bed:
        progress("2/4 hosts " + ", ".join(f"{h.name}={h.address}" for h in bed.hosts.values())
                  + f" on bridge {bed.bridge}; rendering the deployment")
        try:
            stack = RenderedStack(bed, cpu_spec(bed, model, kv_cache_bytes=KV_BYTES), workdir)
        except ValueError as exc:
            raise DemoError(f"kvpp render refused the demo spec: {exc}") from None
        progress(f"3/4 starting the rendered scripts ({stack.scripts}) on their hosts")
        stack.start_all(progress=progress)
        # Reference: the decode engine computing each prompt itself; its KV budget is the prefills', without
        # KVPP, so its blocks are the capacity without KVPP.
        expected = {r.name: _complete(stack.url("decode"), model, r.prompt) for r in requests}
        progress("4/4 requests through the proxy on host proxy")
        report = _drive(requests, model, stack.url("proxy"), [stack.url("prefill"), stack.url("prefill2")],
                        stack.url("decode"), expected, engine_num_blocks(stack.url("decode")), REFERENCE)
        report["hosts"] = {h.name: h.address for h in bed.hosts.values()}
        report["rendered"] = str(stack.scripts)
        return report
