"""The pull probes of `kvpp chaos`: a prefill that stalls while the decode pulls from it, and pulls after
an idle gap longer than Mooncake's TCP lane timeout.

Each probe quiesces the load, then times a few P/D requests against the same prompts computed by the
decode alone (the recompute a failed pull falls back to), all sent at once. Its rule: every answer
equals the colocated reference's, and none takes longer than the decode's stall bound, the time its
given-up reads take to end (Mooncake's TCP progress timeout, the bound rounded up) and the recompute,
plus PROBE_SLACK_S.

- stall: the probe sends the prefill legs itself (as `kvpp proxy` does), then the decode legs, and
  SIGSTOPs the prefill as soon as they are on their way: their pulls meet a prefill that stopped
  answering, one of them queued behind the others. SIGCONT once all were answered.
- idle: no traffic for the probe's gap, then the requests go through the front as usual.
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from pathlib import Path

import aiohttp

from deploy.harness.chaos_load import Prompt, completion_body
from deploy.harness.engines import engine_metrics, metric_total
from deploy.services.proxy import decode_body, prefill_body

PROBE_PROMPTS = 3
"""Requests per probe: more than the decode's max_pulls_per_prefill (2), so one queues behind a stalled pull."""
PROBE_SLACK_S = 1.0
"""Beyond bound + drain + recompute: the HTTP round trips and vLLM's step around the failed load."""
IDLE_GAP_S = 8.0
"""Longer than the ~5 s of idleness after which Mooncake #4209's TCP lanes rejected transfers."""
PULL_COUNTERS = ("pulls", "failed_pulls", "stalled_pulls", "retried_reads")


def pull_limit_s(stall_timeout_s: float, recompute_s: float) -> float:
    """The longest a probe request may take: the stall bound, Mooncake's progress timeout for the reads
    still in flight (the bound rounded up), the recompute, and the slack."""
    return stall_timeout_s + math.ceil(stall_timeout_s) + recompute_s + PROBE_SLACK_S


async def timed(session: aiohttp.ClientSession, url: str, body: dict, prompt: Prompt) -> dict:
    start = time.monotonic()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            answer = await resp.json()
            if resp.status != 200:
                return {"outcome": "error", "status": resp.status, "seconds": round(time.monotonic() - start, 3),
                        "error": str(answer)[:200]}
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return {"outcome": "error", "seconds": round(time.monotonic() - start, 3), "error": f"{type(exc).__name__}: {exc}"}
    tokens = tuple(answer["choices"][0]["logprobs"]["tokens"])
    return {"outcome": "answered" if tokens == prompt.tokens else "wrong", "seconds": round(time.monotonic() - start, 3)}


def _counters(decode_url: str) -> dict[str, float]:
    text = engine_metrics(decode_url)
    return {name: metric_total(text, f"vllm:mooncake_v2_{name}_total") for name in PULL_COUNTERS}


async def _settled_counters(decode_url: str, before: dict[str, float], pulls: int) -> dict[str, int]:
    """The decode's pull counters' growth since `before`, once `pulls` pulls (either way) were counted:
    they reach /metrics with the next stats interval."""
    deadline = time.monotonic() + 30
    while True:
        after = await asyncio.to_thread(_counters, decode_url)
        grown = {k: int(after[k] - before[k]) for k in PULL_COUNTERS}
        if grown["pulls"] + grown["failed_pulls"] >= pulls or time.monotonic() > deadline:
            return grown
        await asyncio.sleep(1)


async def recompute_seconds(decode_url: str, model: str, prompts: list[Prompt], timeout_s: float) -> list[dict]:
    """The prompts computed by the decode alone, all at once: what a failed pull costs on top."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        return await asyncio.gather(*(timed(session, decode_url, completion_body(model, p.text, False), p)
                                      for p in prompts))


async def _prefill_leg(session: aiohttp.ClientSession, prefill_url: str, model: str, prompt: Prompt) -> dict:
    async with session.post(f"{prefill_url}/v1/completions",
                            json=prefill_body(completion_body(model, prompt.text, False))) as resp:
        return (await resp.json())["kv_transfer_params"]


async def stall_probe(prefill_url: str, decode_url: str, model: str, prompts: list[Prompt], stop, resume,
                      timeout_s: float) -> dict:
    """One P/D request by hand first (the decode then knows this prefill's metadata, as it does once it
    pulled from it), then the prefill legs, then the decode legs with the prefill stopped (`stop`,
    `resume`) as soon as they are on their way."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        warm = prompts[0]
        warm_up = await timed(session, decode_url, decode_body(completion_body(model, warm.text, False),
                                                               await _prefill_leg(session, prefill_url, model, warm)),
                              warm)
        before = await asyncio.to_thread(_counters, decode_url)
        params = [await _prefill_leg(session, prefill_url, model, p) for p in prompts]
        legs = [asyncio.ensure_future(timed(session, decode_url,
                                            decode_body(completion_body(model, p.text, False), kv), p))
                for p, kv in zip(prompts, params)]
        stop()
        stopped = time.monotonic()
        try:
            requests = await asyncio.gather(*legs)
        finally:
            resume()
        stopped_s = time.monotonic() - stopped
    return {"requests": requests, "warm_up": warm_up, "stopped_s": round(stopped_s, 2),
            "counters": await _settled_counters(decode_url, before, len(prompts))}


async def idle_probe(front_url: str, decode_url: str, model: str, prompts: list[Prompt], gap_s: float,
                     timeout_s: float) -> dict:
    """No traffic for `gap_s`, then the requests through the front."""
    before = await asyncio.to_thread(_counters, decode_url)
    await asyncio.sleep(gap_s)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        requests = await asyncio.gather(*(timed(session, front_url, completion_body(model, p.text, False), p)
                                          for p in prompts))
    return {"requests": requests, "gap_s": gap_s, "counters": await _settled_counters(decode_url, before, len(prompts))}


PULL_LOG_MARKS = ("pulling KV from prefill", "past its own bound")
"""The decode's log lines a probe keeps: its failed pulls (why each failed) and reads Mooncake still ran past its own
bound on them."""


def pull_log(path: Path, offset: int, limit: int = 8) -> list[str]:
    """The decode's pull failures logged past `offset` of its log: a slow probe request says why."""
    with open(path, "rb") as log:
        log.seek(offset)
        lines = log.read().decode(errors="replace").splitlines()
    return [line[:300] for line in lines if any(mark in line for mark in PULL_LOG_MARKS)][:limit]


def judge(label: str, probe: dict, recompute: list[dict], stall_timeout_s: float) -> dict:
    """The probe's verdict: every answer right, none past pull_limit_s of the slowest recompute, and a
    stall probe that stalled a pull (else it tested nothing)."""
    recompute_s = max(r["seconds"] for r in recompute)
    limit = pull_limit_s(stall_timeout_s, recompute_s)
    slowest = max(r["seconds"] for r in probe["requests"])
    extra = [probe["warm_up"]] if "warm_up" in probe else []
    problems = [f"{label}: the recompute reference answered {r['outcome']}" for r in recompute if r["outcome"] != "answered"]
    problems += [f"{label}: a request {r['outcome']}" + (f" ({r.get('error')})" if r.get("error") else "")
                 for r in probe["requests"] + extra if r["outcome"] != "answered"]
    if "stopped_s" in probe and not probe["counters"]["stalled_pulls"]:
        problems.append(f"{label}: no pull met the stopped prefill (the decode counted no stalled pull)")
    if slowest > limit:
        problems.append(f"{label}: a request took {slowest:.1f} s, over the limit {limit:.1f} s (stall bound "
                        f"{stall_timeout_s:g} s + its reads ending + recompute {recompute_s:.1f} s + {PROBE_SLACK_S:g} s)"
                        + ("; the decode logged: " + " | ".join(probe["decode_log"]) if probe.get("decode_log") else ""))
    return {"label": label, **probe, "recompute_s": recompute_s, "limit_s": round(limit, 2),
            "slowest_s": slowest, "problems": problems}


def stop_group(member) -> tuple:
    """(stop, resume) of a member's whole process group."""
    return (lambda: member.signal(signal.SIGSTOP)), (lambda: member.signal(signal.SIGCONT))
