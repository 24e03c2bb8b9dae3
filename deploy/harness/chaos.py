"""`kvpp chaos`: a fault harness for the P/D stack with the KV pool.

It computes reference answers on a colocated engine (then stops it), starts the local stack
(Mooncake pool, prefill TP=2 with KVPP and a MultiConnector of MooncakeConnectorV2 and the pool,
decode TP=1, `kvpp proxy` or, with --front, vllm-router) or points at running instances, drives concurrent clients (plain,
streaming and client-cancelled completions over prompts with shared prefixes) and injects faults on
a schedule: SIGKILL + restart and SIGSTOP/SIGCONT of the prefill, the decode, the pool master and
the segment holder, a proxy restart, clients abandoning long generations, the prefill stopped while
the decode pulls from it, and pulls after an idle gap longer than Mooncake's TCP lane timeout (those
two must cost no request more than the decode's stall bound plus a recompute), and the whole pool stopped
for 12 s under four clients (no request may take longer than the prefill's per-request pool bound plus a
recompute). Every answer is compared with the reference's tokens; after the run every engine's /metrics must
show no request running or waiting, KV cache usage 0, and as many pulls as P/D requests. Prints a one-screen summary
(or `--json`) and writes the whole report, every request included, to `--report`.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from connectors.store.settings import parse_store_settings
from deploy.harness.chaos_load import CLIENT_TIMEOUT_S, Load, Prompt, cancel_probe, reference_prompts
from deploy.harness.chaos_pool import POOL_PROBE_CLIENTS, POOL_STALL_S, judge as judge_pool, pool_stall_probe, \
    recompute_seconds as pool_recompute_seconds, stop_pool
from deploy.harness.chaos_pulls import IDLE_GAP_S, PROBE_PROMPTS, idle_probe, judge, pull_log, recompute_seconds, \
    stall_probe, stop_group
from deploy.harness.chaos_stack import (Stack, StackSettings, inject, progress, reference_answers, restart, start_front,
                                        start_local_stack)
from deploy.harness.engines import LAYERS, engine_metrics, metric_total
from deploy.services.processes import REFERENCE, http_ok
from deploy.services.proxy import PATHS
from deploy.harness.tiny_model import build_tiny_model, sample_prompt
from kvpp_core.model import ModelSpec

SETTLE_S = 2.0
"""A request ending this long after a fault was over still counts as affected by it."""
CANCEL_IDLE_LIMIT_S = 5.0
"""A request whose client left must have ended on every engine within this."""
PROGRESS_EVERY_S = 5.0


@dataclass(frozen=True)
class Fault:
    kind: str
    """kill (SIGKILL, then restart), stop (SIGSTOP, then SIGCONT), cancel (a client abandons a long generation),
    stall (the prefill stopped while the decode pulls from it; the pool's holder and master stopped for `down_s`
    under POOL_PROBE_CLIENTS clients) or idle (no traffic for `down_s`, then pulls)."""
    target: str
    """prefill, decode, pool_master, pool_holder, proxy; for cancel: stream or plain; for stall: prefill or pool;
    for idle: pd."""
    down_s: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.kind} {self.target}"


SHORT_SCHEDULE = (
    Fault("cancel", "stream"),
    Fault("kill", "prefill", 8), Fault("stop", "prefill", 6),
    Fault("kill", "decode", 8), Fault("stop", "decode", 6),
    Fault("kill", "pool_holder", 1), Fault("stop", "pool_master", 6),
    Fault("kill", "pool_master", 1), Fault("stop", "pool_holder", 6),
    Fault("kill", "proxy", 0), Fault("stop", "proxy", 4),
    Fault("cancel", "plain"),
    Fault("stall", "prefill"), Fault("idle", "pd", IDLE_GAP_S), Fault("stall", "pool", POOL_STALL_S),
)
PROBES = ("cancel", "stall", "idle")
"""Kinds run as probes with the load paused (their requests are timed alone), not as faults under load."""


def soak_schedule(seed: int) -> Iterator[Fault]:
    """The short schedule's faults in shuffled rounds, without end: the run stops drawing from it
    once its `--soak-seconds` have passed (a round's length depends on the host)."""
    rng = random.Random(seed)
    while True:
        faults = list(SHORT_SCHEDULE)
        rng.shuffle(faults)
        yield from faults


class Engines:
    """The engines' /metrics, read together."""

    def __init__(self, urls: dict[str, str]):
        self.urls = urls

    def read(self) -> dict[str, str]:
        return {name: engine_metrics(url) for name, url in self.urls.items()}

    def busy(self) -> dict[str, dict]:
        """Per engine: requests running and waiting, KV cache usage (unreachable engines count as busy)."""
        out = {}
        for name, url in self.urls.items():
            try:
                text = engine_metrics(url)
            except OSError as exc:
                out[name] = {"unreachable": str(exc)[:100]}
                continue
            out[name] = {"running": metric_total(text, "vllm:num_requests_running"),
                         "waiting": metric_total(text, "vllm:num_requests_waiting"),
                         "kv_cache_usage": metric_total(text, "vllm:kv_cache_usage_perc")}
        return out

    def wait_idle(self, timeout: float, kv_too: bool) -> tuple[float, dict]:
        """Seconds until no engine runs or queues a request (and, with `kv_too`, holds KV blocks)."""
        start = time.monotonic()
        while True:
            state = self.busy()
            idle = all("unreachable" not in s and s["running"] == 0 and s["waiting"] == 0
                       and (not kv_too or s["kv_cache_usage"] == 0) for s in state.values())
            if idle or time.monotonic() - start > timeout:
                return time.monotonic() - start, {"idle": idle, "engines": state}
            time.sleep(0.25)


class Run:
    def __init__(self, stack: Stack, model: str, prompts: list[Prompt], clients: int, seed: int,
                 settings: StackSettings, page_bytes: int | None = None, restart_under_load: bool = False):
        self.stack, self.model, self.prompts, self.settings = stack, model, prompts, settings
        self.restart_under_load = restart_under_load
        self.page_bytes = page_bytes
        """Bytes one block of all layers takes (known for the local stack's model)."""
        self.engines = Engines(stack.engines)
        self.load = Load(stack.proxy_url, model, prompts, clients, seed, default_path=_DEFAULT_PATH[stack.front])
        self.t0 = time.monotonic()
        self.faults: list[dict] = []
        self.probes: list[dict] = []
        self.pull_probes: list[dict] = []
        self.pool_probes: list[dict] = []
        self.current = "warm-up"

    async def run(self, schedule: Iterable[Fault], gap_s: float, seconds: float | None = None) -> dict:
        """Inject the schedule's faults one after another, `gap_s` apart, under load; with `seconds`,
        start no fault once that long has passed since the run began."""
        load_task = asyncio.ensure_future(self.load.run())
        ticker = asyncio.ensure_future(self._progress())
        injected: list[str] = []
        try:
            await asyncio.sleep(gap_s)
            for i, fault in enumerate(schedule):
                if seconds is not None and time.monotonic() - self.t0 >= seconds:
                    break
                injected.append(fault.label)
                self.current = f"fault {i + 1} {fault.label}"
                if fault.kind == "cancel":
                    await self._cancel_probe(fault)
                elif fault.kind == "stall" and fault.target == "pool":
                    await self._pool_probe(fault)
                elif fault.kind in PROBES:
                    await self._pull_probe(fault)
                else:
                    await self._fault(fault)
                self.current = f"after fault {i + 1}"
                await asyncio.sleep(gap_s)
            self.current = "draining"
            await self.load.stop()
            await load_task
            drain_s, drain = await asyncio.to_thread(self.engines.wait_idle, self.settings.hold_timeout_s + 30, True)
            self.current = "final P/D check"
            counters = await self._counters_check()
        finally:
            ticker.cancel()
            if not load_task.done():
                load_task.cancel()
        return {**self._report(drain_s, drain, counters), "schedule": injected}

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            s = self.load.summary()
            progress(f"{time.monotonic() - self.t0:5.0f} s  {self.current:<32} requests {s['requests']} "
                     f"(answered {s['answered']}, errors {s['error']}, wrong {s['wrong']}, "
                     f"cancelled {s['cancelled']}, in flight {s['in_flight']})")

    async def _fault(self, fault: Fault) -> None:
        member = self.stack.members[fault.target]
        start = time.monotonic()
        if fault.kind == "kill" and fault.target in self.stack.engines and not self.restart_under_load:
            # The outage is served under load; the restart is not: on a 2-core host the restarting
            # engine's worker shares a pinned core with the other engine, which spins while busy and
            # starves it for minutes.
            await asyncio.to_thread(member.kill)
            down = time.monotonic()
            await asyncio.sleep(fault.down_s)
            end = time.monotonic()
            await self.load.pause()
            await asyncio.to_thread(restart, member, self.stack)
            self.load.resume()
        else:
            down = await asyncio.to_thread(inject, member, fault.kind, fault.down_s, self.stack)
            end = time.monotonic()
        back = time.monotonic()
        self.faults.append({**asdict(fault), "label": fault.label, "start": start, "down": down, "end": end,
                            "back": back, "recovered_s": round(back - start, 2)})

    async def _cancel_probe(self, fault: Fault) -> None:
        """Quiesce the load, then have a client abandon a 600-token generation and time how long the
        engines take to drop it (they would otherwise generate for many seconds)."""
        await self.load.pause()
        await asyncio.to_thread(self.engines.wait_idle, self.settings.hold_timeout_s + 30, False)
        decode = self.stack.engines["decode"]
        before = metric_total(engine_metrics(decode), "vllm:generation_tokens_total")
        left = await cancel_probe(self.stack.proxy_url, self.model, sample_prompt(30, seed=7),
                                  fault.target == "stream", lambda: self.engines.busy()["decode"].get("running", 0) > 0)
        idle_s, state = await asyncio.to_thread(self.engines.wait_idle, 60, False)
        generated = metric_total(engine_metrics(decode), "vllm:generation_tokens_total") - before
        self.probes.append({"label": fault.label, "idle_after_s": round(idle_s, 2), "idle": state["idle"],
                            "tokens_generated": int(generated), "client_left_at": round(left - self.t0, 2)})
        self.load.resume()

    async def _pull_probe(self, fault: Fault) -> None:
        """Quiesce the load, time the decode computing a few prompts alone (the recompute), then the
        same prompts P/D under the fault: the prefill stopped as their pulls start (stall), or after an
        idle gap (idle)."""
        await self.load.pause()
        await asyncio.to_thread(self.engines.wait_idle, self.settings.hold_timeout_s + 30, False)
        # Prompts without the shared prefix: the prefill computes each whole, the decode pulls each whole.
        decode, prompts = self.stack.engines["decode"], self.prompts[-PROBE_PROMPTS:]
        recompute = await recompute_seconds(decode, self.model, prompts, CLIENT_TIMEOUT_S)
        decode_log = self.stack.members["decode"].log_path
        logged = decode_log.stat().st_size
        if fault.kind == "stall":
            stop, resume = stop_group(self.stack.members["prefill"])
            probe = await stall_probe(self.stack.engines["prefill"], decode, self.model, prompts, stop, resume,
                                      CLIENT_TIMEOUT_S)
        else:
            probe = await idle_probe(self.stack.proxy_url, decode, self.model, prompts, fault.down_s, CLIENT_TIMEOUT_S)
        probe["decode_log"] = pull_log(decode_log, logged)
        self.pull_probes.append(judge(fault.label, probe, recompute, self.settings.stall_timeout_s))
        self.load.resume()

    async def _pool_probe(self, fault: Fault) -> None:
        """Quiesce the load, time the probe's prompts computed whole (no pool hit), then the requests of at least
        POOL_PROBE_CLIENTS clients with the pool's segment holder and master stopped for the fault's `down_s`."""
        await self.load.pause()
        await asyncio.to_thread(self.engines.wait_idle, self.settings.hold_timeout_s + 30, False)
        prompts, url, clients = self.prompts, self.stack.proxy_url, max(self.load.clients, POOL_PROBE_CLIENTS)
        recompute = await pool_recompute_seconds(url, self.model, prompts[:clients], CLIENT_TIMEOUT_S)
        stop, resume = stop_pool(self.stack.members["pool_holder"], self.stack.members["pool_master"])
        probe = await pool_stall_probe(url, self.stack.engines["prefill"], self.model, prompts, clients, stop, resume,
                                       fault.down_s, CLIENT_TIMEOUT_S)
        budget_s = parse_store_settings(self.stack.members["pool_master"].pool_extra).request_budget_s
        self.pool_probes.append(judge_pool(fault.label, probe, recompute, budget_s))
        self.load.resume()

    async def _counters_check(self) -> dict:
        """With nothing else running: every P/D request is one pull of exactly its prompt's pages."""
        if "decode" not in self.stack.engines:
            return {"consistent": True, "skipped": "no engine named decode"}
        decode, stack = self.stack.engines["decode"], self.stack
        names = ("vllm:mooncake_v2_pulls_total", "vllm:mooncake_v2_failed_pulls_total",
                 "vllm:mooncake_v2_pulled_bytes_total")

        def snapshot():
            text = engine_metrics(decode)
            return [metric_total(text, n) for n in names] + [metric_total(engine_metrics(stack.front_metrics_url),
                                                                           _PD_REQUESTS[stack.front])]

        before = await asyncio.to_thread(snapshot)
        check = Load(stack.proxy_url, self.model, self.prompts, 1, default_path=_DEFAULT_PATH[stack.front])
        await check.each_prompt_once()
        # Counters reach /metrics with the next stats interval.
        deadline = time.monotonic() + 30
        while True:
            after = await asyncio.to_thread(snapshot)
            if after[0] - before[0] >= len(self.prompts) or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        pulls, failed, pulled, pd = (a - b for a, b in zip(after, before))
        expected_bytes = sum(math.ceil(p.prompt_tokens / REFERENCE.block_size) * self.page_bytes for p in self.prompts) \
            if self.page_bytes else pulled
        answers = check.summary()
        return {"requests": len(self.prompts), "answered": answers["answered"], "proxy_pd": int(pd),
                "pulls": int(pulls), "failed_pulls": int(failed), "pulled_bytes": int(pulled),
                "expected_bytes": expected_bytes,
                "consistent": pulls == pd == len(self.prompts) and failed == 0 and pulled == expected_bytes
                and answers["answered"] == len(self.prompts)}

    def _report(self, drain_s: float, drain: dict, counters: dict) -> dict:
        records = self.load.records
        per_fault = [{"fault": f["label"], "down_s": f["down_s"], "recovered_s": f["recovered_s"],
                      **_tally([r for r in records if _affected(r, f)], self.faults)} for f in self.faults]
        quiet = [r for r in records if not any(_affected(r, f) for f in self.faults)]
        proxy_paths = _front_counts(self.stack)
        problems = []
        for row in per_fault:
            if row["wrong"]:
                problems.append(f"{row['fault']}: {row['wrong']} wrong answers")
            if row["errors_unexcused"]:
                problems.append(f"{row['fault']}: {row['errors_unexcused']} client-visible errors")
        baseline = _tally(quiet, [])
        if baseline["wrong"] or baseline["errors"]:
            problems.append(f"without a fault: {baseline['wrong']} wrong, {baseline['errors']} errors")
        for p in self.probes:
            if not p["idle"] or p["idle_after_s"] > CANCEL_IDLE_LIMIT_S or p["tokens_generated"] >= 600:
                problems.append(f"{p['label']}: engines still busy {p['idle_after_s']} s after the client left")
        for p in self.pull_probes + self.pool_probes:
            problems += p["problems"]
        if not drain["idle"]:
            problems.append(f"after the run engines not idle with KV usage 0 within {drain_s:.0f} s: {drain['engines']}")
        if not counters["consistent"]:
            problems.append(f"P/D counters inconsistent: {counters}")
        return {
            "front": self.stack.front,
            "duration_s": round(time.monotonic() - self.t0, 1),
            "clients": self.load.clients,
            "totals": self.load.summary(),
            "faults": per_fault,
            "fault_kinds": _by_kind(records, self.faults),
            "without_fault": baseline,
            "cancel_probes": self.probes,
            "pull_probes": self.pull_probes,
            "pool_probes": self.pool_probes,
            "drain": {"seconds": round(drain_s, 2), **drain},
            "counters": counters,
            "proxy_paths": proxy_paths,
            "ok": not problems,
            "problems": problems,
            "requests": [r.asdict() | {"start": round(r.start - self.t0, 3), "end": round(r.end - self.t0, 3)}
                         | ({"excused": _excused(r, self.faults)} if r.outcome == "error" else {})
                         for r in records],
        }


def _affected(record, fault: dict) -> bool:
    """A request overlapping a fault, or ending within SETTLE_S after it was over, is affected by it."""
    return record.start <= fault["end"] + SETTLE_S and record.end >= fault["start"]


def _by_kind(records, faults: list[dict]) -> list[dict]:
    """One row per fault kind over all its injections (a soak repeats each), every request counted
    once per kind; `recovered_s` is the longest time until the part served again."""
    kinds: dict[str, list[dict]] = {}
    for f in faults:
        kinds.setdefault(f["label"], []).append(f)
    return [{"fault": label, "injected": len(group), "down_s": group[0]["down_s"],
             "recovered_s": max(f["recovered_s"] for f in group),
             **_tally([r for r in records if any(_affected(r, f) for f in group)], faults)}
            for label, group in kinds.items()]


SERVED_BY = {"pd": "decode", "decode_only": "decode", "prefill_only": "prefill"}
"""The role whose instance streams the answer, by the path the proxy took."""
ENGINE_ROLES = frozenset(SERVED_BY.values())


def _excused(record, faults: list[dict]) -> bool:
    """The only errors the issue allows: a stream already relayed (its headers reached the client)
    from an instance that a kill took down under it; a request inside the proxy while the proxy was
    being killed (from the SIGKILL until it was dead: the kernel still accepts connections meanwhile),
    cut off with its connection (never an HTTP error the proxy chose to send); and any request that
    ended while no instance of either role was alive. Judged against every fault, not only the window
    the request is counted in (a request can span two)."""
    for f in faults:
        if f["kind"] != "kill":
            continue
        in_flight = record.start <= f["down"] and f["start"] <= record.end
        if f["target"] == "proxy" and in_flight and record.status in (None, 200):
            return True
        if not record.start <= f["start"] <= record.end:
            continue
        relayed = record.status == 200 and record.first_byte is not None \
            and record.start + record.first_byte <= f["start"]
        if f["target"] == SERVED_BY.get(record.path) and record.mode == "stream" and relayed:
            return True
    dead = {f["target"] for f in faults if f["kind"] == "kill" and f["start"] <= record.end <= f["back"]}
    return ENGINE_ROLES <= dead


def _tally(records, faults: list[dict]) -> dict:
    errors = [r for r in records if r.outcome == "error"]
    excused = [r for r in errors if _excused(r, faults)]
    return {"affected": len(records),
            "answered": sum(r.outcome == "answered" for r in records),
            "errors": len(errors), "errors_unexcused": len(errors) - len(excused),
            "wrong": sum(r.outcome == "wrong" for r in records),
            "cancelled": sum(r.outcome == "cancelled" for r in records),
            "paths": dict(collections.Counter(r.path for r in records if r.path)),
            "longest_s": round(max((r.seconds for r in records), default=0.0), 2),
            "error_samples": sorted({r.error for r in errors})[:3]}


_PD_REQUESTS = {"kvpp-proxy": 'kvpp_proxy_requests_total{path="pd"}', "vllm-router": "vllm_router_pd_requests_total"}
"""Each front's count of requests it sent prefill, then decode."""
_DEFAULT_PATH = {"kvpp-proxy": "", "vllm-router": "pd"}
_ROUTER_COUNTS = ("requests", "prefill_errors", "decode_errors", "stream_errors")


def _front_counts(stack: Stack) -> dict:
    """kvpp proxy: requests per path it took (cache-aware: also its prefill choices, the event batches it applied
    and refused, its index resets); vllm-router: its P/D requests and errors per leg."""
    try:
        text = urllib.request.urlopen(f"{stack.front_metrics_url}/metrics", timeout=10).read().decode()
    except OSError as exc:
        return {"unreachable": str(exc)}
    if stack.front == "vllm-router":
        return {c: int(metric_total(text, f"vllm_router_pd_{c}_total")) for c in _ROUTER_COUNTS}
    counts = {p: int(metric_total(text, f'kvpp_proxy_requests_total{{path="{p}"}}')) for p in PATHS}
    if stack.events:
        counts |= {name: int(metric_total(text, f"kvpp_proxy_{name}_total"))
                   for name in ("prefix_hits", "prefix_fallbacks", "kv_event_batches", "kv_event_refused",
                                "kv_index_resets", "kv_index_syncs")}
    return counts


# ---- the command ---------------------------------------------------------------------------------
def run_chaos(workdir: Path, schedule: Callable[[], Iterable[Fault]], clients: int, seed: int, gap_s: float,
              settings: StackSettings, restart_under_load: bool = False, seconds: float | None = None,
              fronts: tuple[str, ...] = ("kvpp-proxy",)) -> dict:
    """`schedule()`'s faults under load through each front in turn (each front gets a fresh schedule), against
    one set of engines and references; one front: its report, several: {"fronts": [their reports], "ok"}."""
    progress("1/4 building the tiny 16-layer MLA model")
    model = str(build_tiny_model(workdir / "tiny16", layers=LAYERS))
    progress("2/4 reference answers from a colocated engine (TP=2, KVPP off), then it stops")
    prompts = reference_answers(model, workdir, lambda url: asyncio.run(reference_prompts(url, model)))
    progress(f"3/4 pool, prefill (TP=2, KVPP), decode (TP=1), {fronts[0]}")
    stack = start_local_stack(model, workdir, settings, fronts[0])
    reports = []
    try:
        spec = ModelSpec.from_hf_config(model)
        for front in fronts:
            if front != stack.front:
                progress(f"next front: {front}")
                start_front(stack, front, workdir, settings)
            faults = schedule()
            progress(f"4/4 {front}: {clients} clients, " + (f"{len(faults)} faults" if seconds is None
                                                             else f"faults in shuffled rounds for {seconds:.0f} s"))
            report = asyncio.run(Run(stack, model, prompts, clients, seed, settings,
                                     spec.num_layers * spec.page_bytes(REFERENCE.block_size), restart_under_load)
                                 .run(faults, gap_s, seconds))
            reports.append({**report, "settings": asdict(settings)})
    finally:
        stack.stop()
    if len(reports) == 1:
        return reports[0]
    return {"fronts": reports, "ok": all(r["ok"] for r in reports)}


def run_attached(proxy_url: str, engines: dict[str, str], reference_url: str, model: str, clients: int,
                 seed: int, seconds: float, settings: StackSettings) -> dict:
    """Load, cancel probes and the after-run checks against running instances; no process faults (the
    harness does not own those processes)."""
    check_attached(proxy_url, engines, reference_url)
    try:
        prompts = asyncio.run(reference_prompts(reference_url, model))
    except RuntimeError as exc:
        raise ValueError(f"--reference {reference_url} with --model {model}: {exc}") from None
    stack = Stack(engines=engines, proxy_url=proxy_url, front_metrics_url=proxy_url)
    schedule = (Fault("cancel", "stream"), Fault("cancel", "plain"))
    report = asyncio.run(Run(stack, model, prompts, clients, seed, settings).run(schedule, seconds / 3))
    return report


def check_attached(proxy_url: str, engines: dict[str, str], reference_url: str) -> None:
    """Refuse to start the load while any instance is unreachable or is not what its option says;
    every problem is named by its option, one per line."""
    problems = []
    if "decode" not in engines:
        problems.append(f"--engines names {', '.join(sorted(engines)) or 'no engine'}; name the P/D decode `decode` "
                        "(its pulls are checked against the proxy's P/D requests), e.g. "
                        "prefill=http://P:8100,decode=http://D:8200")
    for name, url in engines.items():
        try:
            text = engine_metrics(url)
        except (OSError, ValueError) as exc:
            problems.append(f"--engines {name}={url}: {url}/metrics unreachable ({exc})")
            continue
        if "vllm:num_requests_running" not in text:
            problems.append(f"--engines {name}={url}: its /metrics is not a vLLM engine's (no vllm:num_requests_running)")
    for flag, url in (("--proxy", proxy_url), ("--reference", reference_url)):
        if not http_ok(f"{url}/health"):
            problems.append(f"{flag} {url}: {url}/health does not answer 200")
    if problems:
        raise ValueError("\n".join(problems))
