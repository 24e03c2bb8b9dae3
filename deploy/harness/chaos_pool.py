"""The pool probe of `kvpp chaos`: the pool's segment holder and master stopped (SIGSTOP) for longer than any
bound of the pool connector, under concurrent clients.

The probe quiesces the load, then times its prompts computed without the pool (each with a fresh
`cache_salt`: no pooled object and no cached block matches, so the prefill computes them whole: what a
request falls back to), all at once. Then `clients` clients send the prompts through the front back to
back, unsalted (their pooled prefixes make lookups hit, loads load, saves save). Once the prefill counted a pool
hit again (a breaker opened by an earlier stall has closed) the pool is stopped for `stall_s`: the segment holder first, the master HOLDER_LEAD_S later, so lookups
still hit meanwhile and loads and saves meet a pool that stopped under them (a store call in flight when the
pool stops ran natively for the whole stall, and once held its request that long); it runs again for TAIL_S
after. Its rule: every answer equals the colocated reference's, no request overlapping the stall waits it out
(takes as long as the stall), and the prefill counted store calls missing their bound (the breaker opened), else
the probe tested nothing. Its figure: the requests over the per-request limit, the prefill's pool bound
(`request_budget_ms`) + the slowest recompute + PROBE_SLACK_S (`over_limit`), which bench/pool_stall.py holds to
zero; a verdict of seconds would fail a loaded host's test run on its noise (docs/tests.md).
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time

import aiohttp

from deploy.harness.chaos_load import Prompt, completion_body
from deploy.harness.chaos_pulls import PROBE_SLACK_S, timed
from deploy.harness.engines import engine_metrics, metric_total

POOL_STALL_S = 12.0
"""How long the probe stops the pool: longer than every store call's bound and the per-request budget."""
HOLDER_LEAD_S = 1.0
"""The segment holder stops this long before the master."""
POOL_PROBE_CLIENTS = 4
"""The fewest clients the probe runs (the load's, if more)."""
ANSWERING_WAIT_S = 90.0
"""How long the probe waits for the prefill to count a pool hit before it stops the pool: longer than the longest
backoff (pool_backoff_max_ms, 30 s) after an earlier stall, and a probe."""
TAIL_S = 4.0
"""Clients keep going this long after the pool resumed: a request that met the stall and ends after it counts."""
POOL_COUNTERS = ("lookups", "lookup_failures", "lookup_refusals", "lookup_over_budget", "load_failures",
                 "load_timeouts", "load_refusals", "load_over_budget", "save_failures", "save_timeouts", "save_refusals",
                 "breaker_opens")
"""The prefill's pool counters (`vllm:kv_pool_<name>`) the probe reports; a breaker opening proves the stall was
met, the timeouts that loads and saves met it in flight."""


def _counters(prefill_url: str) -> dict[str, float]:
    text = engine_metrics(prefill_url)
    return {name: metric_total(text, f"vllm:kv_pool_{name}_total") for name in POOL_COUNTERS}


def _hit_tokens(prefill_url: str) -> float:
    return metric_total(engine_metrics(prefill_url), "vllm:kv_pool_hit_tokens_total")


async def _settled_counters(prefill_url: str, before: dict[str, float], settle_s: float = 12.0) -> dict[str, int]:
    """The prefill's pool counters' growth since `before`, read once they stopped growing (they reach /metrics
    with the next stats interval)."""
    deadline, last = time.monotonic() + settle_s, None
    while True:
        after = await asyncio.to_thread(_counters, prefill_url)
        grown = {k: int(after[k] - before[k]) for k in POOL_COUNTERS}
        if grown == last or time.monotonic() > deadline:
            return grown
        last = grown
        await asyncio.sleep(2)


async def recompute_seconds(front_url: str, model: str, prompts: list[Prompt], timeout_s: float) -> list[dict]:
    """The prompts through the front with a fresh cache_salt each, all at once: computed whole, no pool hit."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        return await asyncio.gather(*(timed(session, front_url, completion_body(
            model, p.text, False, cache_salt=secrets.token_hex(8)), p) for p in prompts))


def stop_pool(holder, master) -> tuple:
    """(stop, resume) of the pool: the holder, then HOLDER_LEAD_S later the master; both at once again."""

    def stop() -> None:
        holder.signal(signal.SIGSTOP)
        time.sleep(HOLDER_LEAD_S)
        master.signal(signal.SIGSTOP)

    def resume() -> None:
        for member in (master, holder):
            member.signal(signal.SIGCONT)

    return stop, resume


async def pool_stall_probe(front_url: str, prefill_url: str, model: str, prompts: list[Prompt], clients: int,
                           stop, resume, stall_s: float, timeout_s: float) -> dict:
    """`clients` clients cycling through `prompts` through the front; the pool stopped (`stop`, `resume`) once the
    prefill counted a pool hit, `stall_s` from the start of `stop`; every request's time relative to that start."""
    before = await asyncio.to_thread(_counters, prefill_url)
    hits = await asyncio.to_thread(_hit_tokens, prefill_url)
    window: dict[str, float] = {}
    requests: list[dict] = []
    started = asyncio.Event()

    async def client(session: aiohttp.ClientSession, first: int) -> None:
        i = first
        while "resumed" not in window or time.monotonic() < window["resumed"] + TAIL_S:
            prompt = prompts[i % len(prompts)]
            start = time.monotonic()
            answer = await timed(session, front_url, completion_body(model, prompt.text, False), prompt)
            requests.append({**answer, "prompt": i % len(prompts), "start": start})
            started.set()
            i += 1

    async def fault() -> None:
        await started.wait()
        deadline = time.monotonic() + ANSWERING_WAIT_S
        while await asyncio.to_thread(_hit_tokens, prefill_url) <= hits:
            if time.monotonic() > deadline:  # stopping a pool that does not answer would test nothing
                window["stopped"] = window["resumed"] = time.monotonic()
                return
            await asyncio.sleep(0.2)
        window["answered"] = window["stopped"] = time.monotonic()
        await asyncio.to_thread(stop)
        await asyncio.sleep(window["stopped"] + stall_s - time.monotonic())
        await asyncio.to_thread(resume)
        window["resumed"] = time.monotonic()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        try:
            await asyncio.gather(fault(), *(client(session, c) for c in range(clients)))
        finally:
            if "resumed" not in window:
                resume()
                window["resumed"] = time.monotonic()
    stopped, resumed = window["stopped"], window["resumed"]
    during = [{**r, "start": round(r["start"] - stopped, 3)} for r in requests
              if r["start"] <= resumed and r["start"] + r["seconds"] >= stopped]
    return {"requests": sorted(during, key=lambda r: r["start"]), "stopped_s": round(resumed - stopped, 2),
            "clients": clients, "pool_answered": "answered" in window,
            "counters": await _settled_counters(prefill_url, before)}


def judge(label: str, probe: dict, recompute: list[dict], budget_s: float) -> dict:
    """The probe's verdict: every answer right, none waiting out the stall, and the pool met (the breaker opened);
    beside it the requests past the per-request pool bound plus the slowest recompute plus PROBE_SLACK_S."""
    recompute_s = max(r["seconds"] for r in recompute)
    limit = budget_s + recompute_s + PROBE_SLACK_S
    times = [r["seconds"] for r in probe["requests"]]
    slowest = max(times, default=0.0)
    problems = [f"{label}: the recompute reference answered {r['outcome']}" for r in recompute if r["outcome"] != "answered"]
    problems += [f"{label}: a request {r['outcome']}" + (f" ({r.get('error')})" if r.get("error") else "")
                 for r in probe["requests"] if r["outcome"] != "answered"]
    if not probe["pool_answered"]:
        problems.append(f"{label}: the prefill counted no pool hit within {ANSWERING_WAIT_S:g} s: the pool was not "
                        "stopped")
    elif not probe["requests"]:
        problems.append(f"{label}: no request overlapped the stall")
    if not probe["counters"]["breaker_opens"]:
        problems.append(f"{label}: the prefill's breaker never opened (no store call met the stall)")
    if slowest >= probe["stopped_s"]:
        problems.append(f"{label}: a request took {slowest:.1f} s, waiting out the pool's {probe['stopped_s']:g} s "
                        "stall")
    return {"label": label, **probe, "recompute_s": recompute_s, "limit_s": round(limit, 2), "slowest_s": slowest,
            "over_limit": sum(t > limit for t in times), "problems": problems}
