"""One simulation: a trace through N engines of one configuration behind a routing policy, in simulated time.

The driver reads the trace ahead (`read_ahead` requests at most in memory), issues each request when it arrives
(open loop: its `arrival_s`, a traced conversation's later turn not before `client_s` after the previous turn's
answer; closed loop: `client_s` plus its `think_s` after its conversation's previous answer),
routes it with the policy (deploy/simulation/routes.py), and lets the engines (deploy/simulation/engine.py) run up
to the next arrival. Their events feed the router's indexes and the proxy's load count as they happen, and the
answers start the conversations' next turns. As P/D prefills (`held`), an engine's answer is one token; the
decode leg that follows is the cost model's (the KV read, then `decode_token_s` per output token), on a decode
that never runs out of room.
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from deploy.simulation import engine as E
from deploy.simulation import routes
from deploy.simulation.costs import CostModel
from deploy.simulation.progress import Progress
from deploy.simulation.state import EngineConfig, EngineState
from deploy.simulation.trace import Request, turn_label

DRAWS = 4096



@dataclass
class Result:
    """What one simulation measured (simulated seconds; host seconds in `host_s`)."""

    requests: int = 0
    answered: int = 0
    query_tokens: int = 0
    """Prompt tokens of first admissions (vLLM's prefix-cache queries)."""
    hit_tokens: int = 0
    """Of those, found cached (vLLM's prefix-cache hits)."""
    computed_tokens: int = 0
    """Tokens the engines computed in prefill (a preempted request's output too, when it is computed again)."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    evictions: int = 0
    late: int = 0
    """Closed-loop requests issued later than their conversation allowed (their line was beyond the read-ahead)."""
    held_back: int = 0
    """Traced turns issued after their timestamp, because the previous turn's answer came later here."""
    groups: dict[str, list[int]] = field(default_factory=dict)
    """A request type or turn of the trace ("type text", "turn 2") -> [requests, query tokens, hit tokens]."""
    makespan_s: float = 0.0
    busy_s: list[float] = field(default_factory=list)
    engine_queries: list[int] = field(default_factory=list)
    engine_hits: list[int] = field(default_factory=list)
    engine_steps: list[int] = field(default_factory=list)
    ttft_s: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))
    tpot_s: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))
    """Per answer of two tokens or more: the mean time between its tokens."""
    host_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def summary(self, ttft_slo_s: float | None = None) -> dict:
        """The figures; goodput counts the answers whose TTFT met `ttft_slo_s` (all of them without one)."""
        ttft = self.ttft_s.astype(np.float64)
        span = self.makespan_s or float("nan")
        good = len(ttft) if ttft_slo_s is None else int((ttft <= ttft_slo_s).sum())
        return {
            "requests": self.requests, "answered": self.answered, "hit_rate": self.hit_rate,
            "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens,
            "prefill_tokens_computed": self.computed_tokens,
            "prefill_saved": 1 - self.computed_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "preemptions": self.preemptions, "evictions": self.evictions, "late_arrivals": self.late,
            "held_back_turns": self.held_back,
            "makespan_s": self.makespan_s, "requests_per_s": self.answered / span, "goodput_rps": good / span,
            "prompt_tokens_per_s": self.prompt_tokens / span,
            **{f"{name}_p{q}_s": float(np.percentile(values, q)) if len(values) else float("nan")
               for name, values in (("ttft", ttft), ("tpot", self.tpot_s.astype(np.float64))) for q in (50, 99)},
            "engine_busy": [b / span for b in self.busy_s], "engine_query_tokens": self.engine_queries,
            "engine_hit_tokens": self.engine_hits, "engine_steps": self.engine_steps,
            **{f"by_{kind}": {name[len(kind) + 1:]: {"requests": n, "query_tokens": q, "hit_tokens": h,
                                                      "hit_rate": h / q if q else 0.0}
                              for name, (n, q, h) in self.groups.items() if name.startswith(kind + " ")}
               for kind in ("type", "turn") if any(g.startswith(kind + " ") for g in self.groups)},
            "host_s": self.host_s,
        }


class _Arrivals:
    """The trace's requests in the order they arrive, read ahead from the stream."""

    def __init__(self, requests: Iterable[Request], read_ahead: int, client_s: float, dispatch_s: float):
        self._it: Iterator[Request] = iter(requests)
        self._read_ahead, self._client_s, self._dispatch_s = read_ahead, client_s, dispatch_s
        self._front_free = 0.0
        """When the front end (the proxy, or an engine's API server) can pass on the next request."""
        self._open: deque[Request] = deque()
        self._ready: list[float] = []
        """When requests are ready (a heap of distinct times; `_at` holds the requests of each, in order)."""
        self._at: dict[float, deque[Request]] = {}
        self._pending: dict[object, int] = {}
        """A conversation -> its requests read and not answered yet (besides those queued behind them)."""
        self._queued: dict[object, deque[Request]] = {}
        """A conversation -> its closed-loop requests waiting for the previous answer."""
        self._answered: dict[object, float] = {}
        """A conversation with nothing pending -> when its last answer came (its next line not read yet)."""
        self._buffered = 0
        self._eof = False
        self.now = 0.0
        self.late = 0
        self.held_back = 0

    def _fill(self) -> None:
        while self._buffered < self._read_ahead and not self._eof:
            r = next(self._it, None)
            if r is None:
                self._eof = True
                return
            self._buffered += 1
            conv = r.conversation
            if r.arrival_s is not None:
                if r.follows and (self._pending.get(conv) or conv in self._queued):
                    self._queued.setdefault(conv, deque()).append(r)  # after the previous turn's answer
                    continue
                if r.follows and conv in self._answered:
                    self._follow(r, self._answered.pop(conv))
                else:
                    self._open.append(r)
            elif conv is None:
                self._ready_at(r, r.think_s)
                continue
            elif self._pending.get(conv) or conv in self._queued:
                self._queued.setdefault(conv, deque()).append(r)
                continue
            else:
                self._ready_at(r, self._answered.pop(conv, -self._client_s) + self._client_s + r.think_s)
            if conv is not None:
                self._pending[conv] = self._pending.get(conv, 0) + 1

    def _follow(self, r: Request, answered: float) -> None:
        """A traced turn: at its timestamp, unless its conversation's previous answer came later here."""
        t = answered + self._client_s
        if t > r.arrival_s:
            self.held_back += 1
        self._ready_at(r, max(t, r.arrival_s))

    def _ready_at(self, r: Request, t: float) -> None:
        if t < self.now:
            self.late += 1
            t = self.now
        same = self._at.get(t)
        if same is None:
            self._at[t] = deque((r,))
            heapq.heappush(self._ready, t)
        else:
            same.append(r)

    def next_time(self) -> float:
        """When the next request reaches the engines: it arrives, and the front end has passed on the one before."""
        if self._buffered < self._read_ahead:
            self._fill()
        t = self._open[0].arrival_s if self._open else math.inf
        if self._ready and self._ready[0] < t:
            t = self._ready[0]
        return t if t > self._front_free else self._front_free

    def pop(self, t: float) -> Request:
        """The request that reaches the engines at t (`next_time`): open loop first on a tie."""
        self.now = t
        ready = self._ready
        if self._open and (not ready or self._open[0].arrival_s <= ready[0]):
            r = self._open.popleft()
        else:
            same = self._at[ready[0]]
            r = same.popleft()
            if not same:
                del self._at[heapq.heappop(ready)]
        self._buffered -= 1
        self._front_free = t + self._dispatch_s
        return r

    def answered(self, conv, t: float) -> None:
        if conv is None:
            return
        left = self._pending[conv] - 1
        if left:
            self._pending[conv] = left
            return
        queue = self._queued.get(conv)
        if queue:
            r = queue.popleft()
            if not queue:
                del self._queued[conv]
            if r.arrival_s is not None:
                self._follow(r, t)
            else:
                self._ready_at(r, t + self._client_s + r.think_s)
        else:
            del self._pending[conv]
            self._answered[conv] = t


class Simulation:
    """`engines` engines of `config`, in KVPP `mode` (for its costs), behind `policy`; with a `progress` label, the
    run's progress out of `total` requests goes to stderr (deploy/simulation/progress.py)."""

    def __init__(self, config: EngineConfig, engines: int, policy: str, costs: CostModel, mode: str,
                 read_ahead: int = 1 << 16, progress: str | None = None, total: int | None = None, seed: int = 0,
                 log: list[dict] | None = None):
        if engines < 1:
            raise ValueError(f"needs at least one engine, got {engines}")
        if read_ahead < 1:
            raise ValueError(f"read-ahead must be >= 1 request, got {read_ahead}")
        self.policy = routes.policy(policy, engines, config.block_size)
        self.config = config = replace(config, cache_events=self.policy.name == "cache-aware")
        self.costs = costs
        self.state = EngineState(config, engines, costs.coefficients(mode, config.held))
        self.read_ahead, self.progress, self.total = read_ahead, progress, total
        self._flight: dict[int, tuple[Request, int, float]] = {}
        """A request's row -> the request, its leg's tokens in the proxy's load count, its KV read's time."""
        self._rng = np.random.default_rng(seed)
        self._draws: list[float] = []
        """The KV reads' factors drawn ahead, DRAWS at a time (the generator's sequence: one draw a request)."""
        self._log = log
        """Where each answered request's story goes, if anywhere (its line, engine, times and hits)."""
        self._last_answer = 0.0
        self._ttft: list[float] = []
        self._tpot: list[float] = []

    def run(self, requests: Iterable[Request]) -> Result:
        """Simulate `requests` to their answers. Python's cycle collector is off meanwhile: the run makes no cycles
        (its peak memory is the same without it), and the collector's passes over the millions of objects the
        router's indexes hold cost 5-20% of a cache-aware run."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run(requests)
        finally:
            if collecting:
                gc.enable()

    def _run(self, requests: Iterable[Request]) -> Result:
        started = time.perf_counter()
        state, costs, cfg = self.state, self.costs, self.config
        arrivals = _Arrivals(requests, self.read_ahead, costs.client_s, costs.dispatch_s)
        result = Result()
        follow_s = costs.client_s + ((costs.pull_s + costs.decode_token_s) if cfg.held else 0.0)
        progress = None if self.progress is None else Progress(self.progress, self.total)
        issued: tuple = ()
        while True:
            t = arrivals.next_time()
            stop, reached = state.advance(t, follow_s, *issued)  # the request issued last is admitted first
            issued = ()
            self._events(result, arrivals)
            if stop != E.STOP_TIME:
                continue
            if t == math.inf:
                break
            issued = self._issue(arrivals.pop(t), t, result)
            if progress is not None and progress.due():
                progress.show(result.answered, t, result.hit_rate, time.perf_counter() - started)
        result.late, result.held_back = arrivals.late, arrivals.held_back
        result.makespan_s = max(float(state.ef[:, E.F_CLOCK].max()), self._last_answer)
        result.busy_s = state.ef[:, E.F_BUSY].tolist()
        result.engine_queries = state.es[:, E.E_QUERY_TOKENS].tolist()
        result.engine_hits = state.es[:, E.E_HIT_TOKENS].tolist()
        result.engine_steps = state.es[:, E.E_STEPS].tolist()
        result.preemptions = int(state.es[:, E.E_PREEMPTIONS].sum())
        result.evictions = int(state.es[:, E.E_EVICTIONS].sum())
        result.computed_tokens = int(state.es[:, E.E_PREFILL_TOKENS].sum())
        result.ttft_s = np.array(self._ttft, np.float32)
        result.tpot_s = np.array(self._tpot, np.float32)
        result.host_s = time.perf_counter() - started
        if progress is not None:
            progress.close(result.answered, result.makespan_s, result.hit_rate, result.host_s)
        return result

    def _issue(self, r: Request, t: float, result: Result) -> tuple:
        """Route `r`, arriving at t: what `EngineState.advance` admits."""
        room = self.state.reserve(r.hashes, r.prompt, 1 if self.config.held else r.output)
        engine, leg_tokens = self.policy.choose(r.prompt, r.hashes)
        self.policy.backends[engine].queued_tokens += leg_tokens
        pull = 0.0
        if self.config.held:
            pull = self._pull(r.prompt)
        self._flight[room[1]] = r, leg_tokens, pull
        result.requests += 1
        result.prompt_tokens += r.prompt
        result.output_tokens += r.output
        return room, engine, t, pull

    def _pull(self, prompt: int) -> float:
        """A P/D prefill's KV read: its mean from the cost model, drawn from a gamma distribution of its spread."""
        costs = self.costs
        pull = costs.pull_s + costs.pull_token_s * prompt
        if costs.pull_cv > 0:
            if not self._draws:
                self._draws = self._rng.gamma(1 / costs.pull_cv ** 2, costs.pull_cv ** 2, DRAWS).tolist()[::-1]
            pull *= self._draws.pop()
        return pull

    def _events(self, result: Result, arrivals: _Arrivals) -> None:
        state, costs, policy = self.state, self.costs, self.policy
        if not state.n_ev[0]:
            return
        ev, evt = state.events()
        held = self.config.held
        rows, times = ev.tolist(), evt.tolist()
        pool, flights, backends, decode = state.pool, self._flight, policy.backends, costs.decode_token_s
        i, n = 0, len(rows)
        while i < n:
            kind, e, x, a, b, c = rows[i]
            if kind == E.EV_REMOVED:  # a run of evictions on one engine: one BlockRemoved
                j = i + 1
                while j < n and rows[j][0] == E.EV_REMOVED and rows[j][1] == e:
                    j += 1
                policy.removed(e, [row[2] for row in rows[i:j]])
                i = j
                continue
            if kind == E.EV_STORED:
                policy.stored(e, pool[a:a + b], int(pool[a - 1]) if c else None)
            elif kind == E.EV_FINISHED:
                t, first, arrival = times[i]
                r, leg_tokens, pull = flights[x]
                backends[e].queued_tokens -= leg_tokens
                if held:
                    first = t + pull + decode
                    answer = first + decode * (r.output - 1)
                else:
                    answer = t
                if answer > self._last_answer:
                    self._last_answer = answer
                if self._log is not None:
                    self._log.append({"index": r.index, "conversation": r.conversation, "engine": e,
                                      "arrival_s": arrival, "first_token_s": first, "answer_s": answer,
                                      "hit_tokens": b, "leg_tokens": leg_tokens})
                self._ttft.append(first - arrival)
                if r.output > 1:
                    self._tpot.append((answer - first) / (r.output - 1))
                result.answered += 1
                query, hits = a, b
                result.query_tokens += query
                result.hit_tokens += hits
                if r.kind is not None or r.turn is not None:
                    for name in (r.kind is not None and f"type {r.kind}", r.turn is not None and f"turn {turn_label(r.turn)}"):
                        if name:
                            group = result.groups.setdefault(name, [0, 0, 0])
                            group[0] += 1
                            group[1] += query
                            group[2] += hits
                arrivals.answered(r.conversation, answer)
            elif kind == E.EV_RELEASED:
                state.release(x, a, b)
                del flights[x]
            i += 1
        state.clear_events()
