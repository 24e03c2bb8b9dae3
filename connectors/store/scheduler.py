"""Scheduler side of the pool connector: lookups, load planning, and which finished blocks to save.

Each request has a pool budget (`request_budget_ms`): its lookups spend from it (a lookup waits at most what is
left), a request that spent it is served as a miss without asking, and its load gets what is left
(`BlockJob.budget_s`)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from connectors.store.events import BlockFacts, PoolEvents
from connectors.store.settings import StoreSettings, role_actions
from connectors.store.keys import UnhashableExtraKeys
from connectors.store.lookup import LookupChannel, LookupClient, LookupReply
from connectors.store.metadata import BlockJob, SavedShards, StoreMetadata
from connectors.store.request_keys import block_facts, prompt_blocks
from connectors.store.stats import StoreStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's handlers print it
FAILURE_LOG_INTERVAL_S = 10.0
"""At most one warning this often about failed lookups: while a worker's breaker is open every lookup fails at once."""


@dataclass
class _SaveTracker:
    """A request whose prompt blocks are saved as they become complete."""

    hashes: list[str]
    """One per whole prompt block."""
    block_ids: list[int]
    facts: list[BlockFacts] | None
    """What the pool's events say of each block (None: events off, or vLLM's hashes cannot name them)."""
    saved_blocks: int = 0


class StoreScheduler:
    def __init__(self, vllm_config: "VllmConfig", cfg: StoreSettings) -> None:
        self._cfg = cfg
        self._block_size = vllm_config.cache_config.block_size
        self._loads, self._saves = role_actions(vllm_config.kv_transfer_config.kv_role, cfg)
        dp_rank = vllm_config.parallel_config.data_parallel_rank
        self._client = LookupClient(LookupChannel(cfg.lookup_rpc_port, dp_rank), cfg.lookup_timeout_s) if self._loads else None
        self._prompt_hashes: dict[str, list[str] | None] = {}
        """Per live request: its prompt blocks' pool hashes (None: not poolable)."""
        self._prompt_facts: dict[str, list[BlockFacts] | None] = {}
        """Per live request, with events on: what the events say of its prompt blocks."""
        events = vllm_config.kv_events_config
        self._events = (PoolEvents(vllm_config.parallel_config.world_size)
                        if events is not None and events.enable_kv_cache_events else None)
        """The pool's KV cache events (connectors.store.events), with vLLM's `--kv-events-config` on."""
        self._hits: dict[str, list[str]] = {}
        self._pending_loads: list[BlockJob] = []
        self._trackers: dict[str, _SaveTracker] = {}
        self._saving: set[str] = set()
        self._loading: dict[str, set[int]] = {}
        self._pool_failed: set[str] = set()
        """Requests whose pool load failed: served by recomputation from then on, never looked up again
        (vLLM re-queues a request whose load failed; looking it up again would repeat the failure)."""
        self._clock = time.monotonic
        self._pool_spent: dict[str, float] = {}
        """Per live request that was looked up: seconds its lookups took, out of its pool budget (inf once it was
        found spent)."""
        self._stats = StoreStats()
        self._unlogged_failures = 0
        self._next_failure_log = 0.0

    def _hashes(self, request: "Request") -> list[str] | None:
        """The request's prompt block hashes, computed once while it lives (saves need them too)."""
        req_id = request.request_id
        if req_id not in self._prompt_hashes:
            try:
                blocks = prompt_blocks(request, self._block_size)
                self._prompt_hashes[req_id] = blocks.hashes
                if self._events is not None:
                    self._prompt_facts[req_id] = block_facts(request, blocks, self._block_size)
            except UnhashableExtraKeys as exc:
                logger.warning("request %s bypasses the pool (neither loaded nor saved): %s", req_id, exc)
                self._stats.add("unpoolable_requests")
                self._prompt_hashes[req_id] = None
        return self._prompt_hashes[req_id]

    # ---- loads -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        hashes = self._hashes(request)
        if self._client is None or hashes is None or request.request_id in self._pool_failed:
            return 0, False
        # Whole blocks only, and never the block holding the last prompt token: it must be computed
        # to sample the first output token.
        hashes = hashes[: (request.num_prompt_tokens - 1) // self._block_size]
        left = self._budget_left(request.request_id)
        if left <= 0:
            return 0, False
        start = self._clock()
        reply = self._client.lookup(hashes, request.request_id, timeout_s=left)
        self._pool_spent[request.request_id] = self._pool_spent.get(request.request_id, 0.0) + self._clock() - start
        if not reply.answered:
            self._lookup_failed(request.request_id, reply)  # a miss (0 blocks) that proves nothing: no event
        elif self._events is not None:
            self._events.lookup(hashes, reply.hit_blocks)  # an answer: what it misses is lost
        hit = reply.hit_blocks
        hit_tokens = hit * self._block_size
        if hit_tokens <= num_computed_tokens:
            self._hits.pop(request.request_id, None)
            return 0, False
        self._hits[request.request_id] = hashes[:hit]
        return hit_tokens - num_computed_tokens, self._cfg.load_async

    def _budget_left(self, req_id: str) -> float:
        """Seconds left of the request's pool budget; the first time none is, the request is counted."""
        spent = self._pool_spent.get(req_id, 0.0)
        left = self._cfg.request_budget_s - spent
        if left <= 0 and spent != math.inf:
            self._pool_spent[req_id] = math.inf
            self._stats.add("lookup_over_budget")
        return left

    def _lookup_failed(self, req_id: str, reply: LookupReply) -> None:
        """Counted once (by the worker if the pool failed it there), warned about at most every
        FAILURE_LOG_INTERVAL_S."""
        if not reply.counted:
            self._stats.add("lookup_failures")
        self._unlogged_failures += 1
        now = time.monotonic()
        if now >= self._next_failure_log:
            logger.warning("pool lookup for %s failed and is served as a miss (%d such since the last warning): %s",
                           req_id, self._unlogged_failures, reply.error)
            self._unlogged_failures, self._next_failure_log = 0, now + FAILURE_LOG_INTERVAL_S

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        # A MultiConnector stops asking its children once one is still looking up, but tells every
        # child about the allocation: the save side's hashes are made here at the latest.
        self._hashes(request)
        hashes = self._hits.pop(request.request_id, None)
        if num_external_tokens == 0 or not hashes:
            return
        block_ids = blocks.get_block_ids()[0]
        end = len(hashes)
        start = end - num_external_tokens // self._block_size
        job = BlockJob(request.request_id, tuple(block_ids[start:end]), tuple(hashes[start:end]),
                       budget_s=max(0.0, self._cfg.request_budget_s - self._pool_spent.get(request.request_id, 0.0)))
        self._pending_loads.append(job)
        self._loading[request.request_id] = set(job.block_ids)

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """Note which requests' loads failed (workers report their blocks) before they are retried, and which
        blocks' shards landed."""
        shards = output.kv_connector_worker_meta
        if shards is not None and self._events is not None:
            if not isinstance(shards, SavedShards):
                raise TypeError(f"the pool's workers report SavedShards, got {type(shards).__name__}")
            self._events.report(shards)
        if output.invalid_block_ids:
            for req_id, blocks in self._loading.items():
                if blocks & output.invalid_block_ids:
                    self._pool_failed.add(req_id)
        for req_id in output.finished_recving or ():
            self._loading.pop(req_id, None)

    # ---- saves -------------------------------------------------------------------------------
    def _track(self, scheduler_output: "SchedulerOutput") -> list[BlockJob]:
        for new in scheduler_output.scheduled_new_reqs:
            hashes = self._prompt_hashes.get(new.req_id)
            if hashes:
                self._trackers[new.req_id] = _SaveTracker(hashes, list(new.block_ids[0]),
                                                          self._prompt_facts.get(new.req_id))
        cached = scheduler_output.scheduled_cached_reqs
        computed_before = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        for i, req_id in enumerate(cached.req_ids):
            computed_before[req_id] = cached.num_computed_tokens[i]
            tracker = self._trackers.get(req_id)
            new_ids = cached.new_block_ids[i]
            if tracker is None or new_ids is None:
                continue
            if req_id in cached.resumed_req_ids:
                tracker.block_ids = list(new_ids[0])
                tracker.saved_blocks = 0
            else:
                tracker.block_ids.extend(new_ids[0])
        jobs = []
        for req_id, tracker in list(self._trackers.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id)
            if scheduled is None:
                continue
            done = min((computed_before[req_id] + scheduled) // self._block_size, len(tracker.hashes))
            if done <= tracker.saved_blocks:
                continue
            jobs.append(BlockJob(req_id, tuple(tracker.block_ids[tracker.saved_blocks:done]),
                                 tuple(tracker.hashes[tracker.saved_blocks:done])))
            if self._events is not None and tracker.facts is not None:
                for i in range(tracker.saved_blocks, done):
                    self._events.expect(tracker.hashes[i], tracker.hashes[i - 1] if i else None, tracker.facts[i])
            tracker.saved_blocks = done
            self._saving.add(req_id)
            if done == len(tracker.hashes):
                del self._trackers[req_id]
        return jobs

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> StoreMetadata:
        preempted = scheduler_output.preempted_req_ids or set()
        meta = StoreMetadata(
            loads=self._pending_loads,
            saves=self._track(scheduler_output) if self._saves else [],
            sync_loads=not self._cfg.load_async,
            # A preempted request's blocks are about to be reused: in-flight saves reading them
            # must finish first.
            drain_saves=bool(preempted & self._saving),
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._pending_loads = []
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks until the workers report the request's saves done."""
        self._trackers.pop(request.request_id, None)
        self._prompt_hashes.pop(request.request_id, None)
        self._prompt_facts.pop(request.request_id, None)
        self._hits.pop(request.request_id, None)
        self._loading.pop(request.request_id, None)
        self._pool_failed.discard(request.request_id)
        self._pool_spent.pop(request.request_id, None)
        if request.request_id in self._saving:
            self._saving.discard(request.request_id)
            return True, None
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The pool's events decided since the last step (vLLM publishes them beside its own)."""
        return self._events.take() if self._events is not None else ()

    def get_stats(self) -> StoreStats | None:
        """Lookups the workers never saw (channel errors, timeouts); the rest is counted by workers."""
        if self._stats.is_empty():
            return None
        out, self._stats = self._stats, StoreStats()
        return out

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
