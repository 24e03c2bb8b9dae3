"""Worker side of the pool connector: this rank's shard of each block, saved and loaded in the background.

Without KVPP a block is identical on every rank of a cache-replica group (every TP rank for MLA, the TP
ranks of one KV head for GQA), so the group's first rank stores it once for the group and every rank
loads it. With KVPP each rank stores its persistent caches (owned layers + MTP; staging never) as one
object per block keyed by its KV heads and kvpp rank, and loads land in those same persistent buffers
before the request runs, so the normal broadcast feeds the other ranks of its group.

Loads and saves run on a thread each, so a load never waits behind a save. A load ends within what is left of
its request's pool budget when it arrives (`BlockJob.budget_s`): one still waiting for its turn at that deadline
is reported failed without a call (nothing touched its blocks), and it makes no call whose bound would end past
it. Store calls move data through staging slots (connectors.store.staging), so a job is reported as soon as its
calls returned or missed their bound, whatever a late call still does.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger

from kvpp_core.ownership import target_layer
from kvpp_core.runtime import ActiveLayout, active_layout

from connectors.common.kv_caches import block_pages_problem, kv_topology, rank_kv_heads, replica_heads
from connectors.common.names import STORE
from connectors.store.backends import Backend, Status, open_backend
from connectors.store.settings import StoreSettings, role_actions
from connectors.store.keys import CacheLayout
from connectors.store.lookup import LookupChannel, LookupReply, LookupServer
from connectors.store.metadata import BlockJob, SavedShards, ShardReport, StoreMetadata
from connectors.store.shards import (MTP, PoolUnanswered, StageLayers, all_shards, count_pooled, shard_keys,
                                     stage_shards)
from connectors.store.staging import SLOT_BYTES, Staging
from connectors.store.stats import StoreStats
from connectors.store.transfer import BlockPages, SaveResult, ShardIO

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's handlers print it
IDLE_POLL_S = 0.02


@dataclass(eq=False)
class _Load:
    """A load job on its way: `deadline` (time.monotonic, None: no budget) from its request's pool budget."""

    job: BlockJob
    deadline: float | None
    report: bool
    expired: bool = False
    """Its deadline passed while it waited for its turn: reported failed, never started."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def order_caches(names: Sequence[str], layer_of: dict[str, int | None]) -> tuple[list[str], tuple[int | str, ...]]:
    """Cache names in object order (target layers by id, then MTP caches by name) and their layer tags."""
    targets = sorted((n for n in names if layer_of[n] is not None), key=lambda n: (layer_of[n], n))
    mtp = sorted(n for n in names if layer_of[n] is None)
    tags = tuple(layer_of[n] for n in targets) + tuple(f"{MTP}{i}" for i in range(len(mtp)))
    return targets + mtp, tags


class StoreWorker:
    def __init__(self, vllm_config: "VllmConfig", cfg: StoreSettings) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank, get_world_group

        self._vllm_config = vllm_config
        self._cfg = cfg
        self._loads, self._saves = role_actions(vllm_config.kv_transfer_config.kv_role, cfg)
        self._tp_rank = get_tensor_model_parallel_rank()
        self._pp_rank = get_pp_group().rank_in_group
        self._pp_size = vllm_config.parallel_config.pipeline_parallel_size
        self._dp_rank = vllm_config.parallel_config.data_parallel_rank
        self._block_size = vllm_config.cache_config.block_size
        self._num_hidden = vllm_config.model_config.hf_text_config.num_hidden_layers
        self._topology = kv_topology(vllm_config)
        self._backend: Backend | None = None
        self._server: LookupServer | None = None
        self._stats = StoreStats()
        self._totals = StoreStats()
        self._stats_file = cfg.stats_file
        self._counted = False  # since the stats file was last written
        self._lock = threading.Lock()
        self._save_pending: dict[str, int] = defaultdict(int)
        self._save_reqs: set[str] = set()
        self._finishing: set[str] = set()
        self._loaded: set[str] = set()
        self._load_errors: set[int] = set()
        self._queued_loads: list[_Load] = []
        self._load_jobs: queue.Queue = queue.Queue()
        self._save_jobs: queue.Queue = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._idle_step = False
        self._threads = [threading.Thread(target=self._run_jobs, args=(jobs,), name=f"kvpp-pool-{what}", daemon=True)
                         for what, jobs in (("load", self._load_jobs), ("save", self._save_jobs))]
        self._breaker_opens = 0
        events = vllm_config.kv_events_config
        self._reports = events is not None and events.enable_kv_cache_events
        """Report each saved block's outcome to the scheduler side, which decides the pool's KV events."""
        self._rank = get_world_group().rank_in_group
        self._landed: list[str] = []
        self._failed: list[str] = []

    # ---- setup -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        problem = block_pages_problem(self._vllm_config, kv_caches, STORE)
        if problem is not None:
            raise ValueError(problem)
        layout = active_layout()
        self._kvpp = layout is not None
        names, layer_of = self._persistent_caches(kv_caches, layout)
        ordered, tags = order_caches(names, layer_of)
        caches = [kv_caches[n] for n in ordered]
        # A KVPP rank may own no layer (layers < group size): it stores and restores nothing, but the
        # layout (for the other ranks' keys) is the same on every rank.
        first = next(iter(kv_caches.values()))
        self._pages = BlockPages(caches or [first])
        self._layout = CacheLayout(
            model=self._vllm_config.model_config.model,
            dtype=dtype_name(first.dtype),
            block_size=self._block_size,
            page_bytes=self._pages.page_bytes,
        )
        self._group = layout.group_size if layout else self._topology.group_size
        owner = layout.kvpp_rank if layout else 0
        targets = layout.rank_layout.target_layers if layout else tuple(t for t in tags if isinstance(t, int))
        own_stage = StageLayers(self._pp_rank, tuple(targets), sum(1 for t in tags if isinstance(t, str)))
        heads = (rank_kv_heads(self._vllm_config, self._tp_rank),)
        mine = [s for s in stage_shards(own_stage, self._group, kvpp=self._kvpp, heads=heads) if s.owner == owner]
        if mine and mine[0].layers != tags:
            raise RuntimeError(f"pool shard layers {mine[0].layers} differ from this rank's persistent caches {tags}")
        self._shard = shard_keys(self._layout, mine)[0] if mine else None
        # Without KVPP the group's one copy is written by its first TP rank; every rank of the group loads it.
        self._writes = self._saves and self._shard is not None and (self._kvpp or self._tp_rank % self._group == 0)

        self._backend = open_backend(self._cfg, device_memory=first.device.type != "cpu")
        self._io = None
        if self._shard:
            # The store client moves data only through the staging slots: they alone are registered with it.
            staging = Staging(max(SLOT_BYTES, self._pages.object_bytes), first.device)
            for ptr, size in staging.regions():
                self._backend.register(ptr, size)
            self._io = ShardIO(self._backend, self._shard, self._pages, staging)
        for thread in self._threads:
            thread.start()
        if self._loads and self._tp_rank == 0 and self._pp_rank == 0:
            self._all_shards = shard_keys(self._layout, all_shards(self._stages(own_stage), self._group,
                                                                   kvpp=self._kvpp, heads=replica_heads(self._topology)))
            self._server = LookupServer(LookupChannel(self._cfg.lookup_rpc_port, self._dp_rank), self.lookup)
        logger.info("pool connector: %s backend, kvpp=%s, shard=%s, %d caches x %d bytes per block, writes=%s",
                    self._cfg.backend, self._kvpp, self._shard, len(caches), self._pages.page_bytes, self._writes)

    def _persistent_caches(self, kv_caches, layout: ActiveLayout | None) -> tuple[list[str], dict[str, int | None]]:
        if layout is not None:
            names = list(layout.persistent_layer_names)
            return names, {n: layout.layer_ids[n] for n in names}
        return list(kv_caches), {name: target_layer(name, self._num_hidden) for name in kv_caches}

    def _stages(self, own: StageLayers) -> list[StageLayers]:
        """Every PP stage's layers; other stages derived the way vLLM splits layers."""
        if self._pp_size == 1:
            return [own]
        from vllm.distributed.utils import get_pp_indices

        hf = self._vllm_config.model_config.hf_text_config
        mtp = getattr(hf, "num_nextn_predict_layers", 0) if self._vllm_config.speculative_config else 0
        stages = []
        for rank in range(self._pp_size):
            if rank == self._pp_rank:
                stages.append(own)
                continue
            start, end = get_pp_indices(self._num_hidden, rank, self._pp_size)
            stages.append(StageLayers(rank, tuple(range(start, end)), mtp if rank == self._pp_size - 1 else 0))
        return stages

    # ---- lookup (worker rank 0) -----------------------------------------------------------------
    def lookup(self, hashes: Sequence[str]) -> LookupReply:
        """How many leading blocks of `hashes` the pool holds whole, or a counted failure if it did not say."""
        try:
            hit, failure = count_pooled(self._backend, self._all_shards, hashes), None
        except PoolUnanswered as exc:
            hit, failure = 0, exc
        with self._lock:
            self._count("lookups")
            if failure is not None:
                self._count("lookup_failures")
                self._count("lookup_refusals", int(failure.status is Status.REFUSED))
            else:
                self._count("lookup_hit_blocks", hit)
                self._count("lookup_hit_tokens", hit * self._block_size)
            self._write_stats()
        if failure is not None:
            return LookupReply(0, f"the pool did not answer: {failure}", counted=True)
        return LookupReply(hit)

    # ---- per-step hooks --------------------------------------------------------------------------
    def start_load_kv(self, meta: StoreMetadata) -> None:
        self._idle_step = meta.idle
        now = time.monotonic()
        for job in meta.loads:
            load = _Load(job, None if job.budget_s is None else now + job.budget_s, report=not meta.sync_loads)
            if meta.sync_loads:
                self._load(load)  # the request runs in this very step: nothing to report
            else:
                with self._lock:
                    self._queued_loads.append(load)
                self._submit(self._load_jobs, self._load, load)

    def wait_for_save(self, meta: StoreMetadata) -> None:
        for job in meta.saves:
            with self._lock:
                self._save_reqs.add(job.req_id)
                self._save_pending[job.req_id] += 1
            self._submit(self._save_jobs, self._save, job)

    def handle_preemptions(self, meta: StoreMetadata) -> None:
        # A preempted request's blocks are reused by this very step: no save may still be reading them.
        if meta.drain_saves:
            while not self.drain(self._cfg.backend_timeout_s):  # the ceiling of any store call
                logger.warning("pool I/O on preempted blocks still running; the step waits for it")

    def drain(self, timeout_s: float) -> bool:
        """Wait until no job is queued or running; False if that took longer than timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._in_flight:
                if not self._idle.wait(max(deadline - time.monotonic(), 0)) and time.monotonic() >= deadline:
                    return False
        return True

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            if self._idle_step and self._in_flight and not self._loaded:
                # An engine that only waits for pool I/O steps empty in a busy loop, which on a small
                # host starves the I/O (a slow get then outlives its store lease). Block briefly on
                # the I/O instead; a step with tokens to compute never waits.
                self._idle.wait(IDLE_POLL_S)
            self._expire_queued_loads()
            self._finishing |= finished_req_ids & self._save_reqs
            sent = {r for r in self._finishing if not self._save_pending.get(r)}
            self._finishing -= sent
            self._save_reqs -= sent
            for r in sent:
                self._save_pending.pop(r, None)
            recv, self._loaded = self._loaded, set()
        return sent or None, recv or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_shard_report(self) -> SavedShards | None:
        """This worker's save outcomes since the last step, for the scheduler side's events."""
        with self._lock:
            if not (self._landed or self._failed):
                return None
            report = ShardReport(self._rank, tuple(self._landed), tuple(self._failed))
            self._landed, self._failed = [], []
        return SavedShards((report,))

    def get_stats(self) -> StoreStats | None:
        with self._lock:
            self._count_breaker_opens()
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, StoreStats()
        return out

    # ---- background I/O ----------------------------------------------------------------------------
    def _submit(self, jobs: queue.Queue, fn: Callable, job) -> None:
        with self._lock:
            self._in_flight += 1
        jobs.put((fn, job))

    def _run_jobs(self, jobs: queue.Queue) -> None:
        while True:
            item = jobs.get()
            if item is None:
                return
            fn, job = item
            try:
                fn(job)  # the job ends itself (_job_done)
            except Exception:  # a failed job is a miss or a dropped save, never a dead I/O thread
                logger.exception("pool job %s failed", job)

    def _job_done(self) -> None:
        """Caller holds self._lock."""
        self._in_flight -= 1
        self._idle.notify_all()

    def _expire_queued_loads(self) -> None:
        """Caller holds self._lock: a load whose deadline passed while it waited for its turn is reported failed now
        (its request recomputes); it never starts."""
        now = time.monotonic()
        for load in [q for q in self._queued_loads if q.deadline is not None and now >= q.deadline]:
            load.expired = True
            self._queued_loads.remove(load)
            self._finish_load(load, [Status.OVER_BUDGET] * len(load.job.block_ids))

    def _save(self, job: BlockJob) -> None:
        # A rank that writes nothing (not the group's writer, or a KVPP owner of no layer) has its share
        # of every block in the pool already.
        result = SaveResult.nothing_written(len(job.block_ids), failed=self._writes)
        try:
            if self._writes:
                result = self._io.save(job.block_ids, job.block_hashes)
        finally:
            self._finish_save(job, result)

    def _finish_save(self, job: BlockJob, result: SaveResult) -> None:
        with self._lock:
            self._count("saved_blocks", result.saved)
            self._count("saved_bytes", result.saved * self._pages.object_bytes)
            self._count("save_skipped_blocks", result.skipped)
            self._count("save_failures", result.failed)
            self._count("save_refusals", result.refused)
            self._count("save_timeouts", result.timeouts)
            self._write_stats()
            if self._reports:
                for block_hash, landed in zip(job.block_hashes, result.landed):
                    (self._landed if landed else self._failed).append(block_hash)
            self._save_pending[job.req_id] -= 1
            self._job_done()

    def _load(self, load: _Load) -> None:
        """Restore the job's blocks within its deadline; failed blocks (and all after them) go to the load-error set,
        and an asynchronous load is reported finished so vLLM schedules the request."""
        job = load.job
        with self._lock:
            if load.expired:
                return  # already reported at its deadline
            if load in self._queued_loads:
                self._queued_loads.remove(load)
        status: list[Status] = [Status.FAILED] * len(job.block_ids)
        try:
            # A rank without persistent pages (KVPP owner of nothing) has nothing to restore.
            status = (self._io.load(job.block_ids, job.block_hashes, load.deadline) if self._io
                      else [Status.OK] * len(status))
        finally:
            with self._lock:
                self._finish_load(load, status)

    def _finish_load(self, load: _Load, status: list[Status]) -> None:
        """Caller holds self._lock."""
        job = load.job
        bad = next((i for i, s in enumerate(status) if s is not Status.OK), len(status))
        self._count("loaded_blocks", bad)
        self._count("loaded_bytes", bad * self._pages.object_bytes if self._io else 0)
        if bad < len(status):
            # Everything from the first bad block on is recomputed (a prefix must stay contiguous).
            self._load_errors.update(job.block_ids[bad:])
            self._count("load_failures", len(status) - bad)
            self._count("load_wrong_size", sum(s is Status.WRONG_SIZE for s in status))
            self._count("load_refusals", status.count(Status.REFUSED))
            self._count("load_timeouts", status.count(Status.TIMEOUT))
            self._count("load_over_budget", status.count(Status.OVER_BUDGET))
        self._write_stats()
        if load.report:
            self._loaded.add(job.req_id)
            self._job_done()

    def _count(self, name: str, value: int = 1) -> None:
        """Caller holds self._lock; `_write_stats` publishes the counts once the job or lookup is done."""
        if not value:
            return
        self._stats.add(name, value)
        self._totals.add(name, value)
        self._counted = True

    def _count_breaker_opens(self) -> None:
        """Caller holds self._lock: the times the store client's breaker opened since the last count."""
        opens = self._backend.breaker_opens() if self._backend is not None else 0
        self._count("breaker_opens", opens - self._breaker_opens)
        self._breaker_opens = opens

    def _write_stats(self) -> None:
        """Caller holds self._lock: the cumulative counters to `stats_file`, once per job or lookup that
        counted something (atomically: readers never see half a file)."""
        self._count_breaker_opens()
        if not (self._stats_file and self._counted):
            return
        self._counted = False
        path = f"{self._stats_file}.pp{self._pp_rank}.tp{self._tp_rank}.json"
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self._totals.data, fh)
        os.replace(tmp, path)

    def close(self) -> None:
        self.drain(self._cfg.backend_timeout_s)
        self._load_jobs.put(None)
        self._save_jobs.put(None)
        if self._server is not None:
            self._server.close()
        if self._backend is not None:
            self._backend.close()
