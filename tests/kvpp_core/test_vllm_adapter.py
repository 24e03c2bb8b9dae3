"""The vLLM adapter without an engine: which blocks a step broadcasts, which steps broadcast at all,
and the KV cache config rewrite, bound by vLLM 0.32's own allocator (unit); and vLLM's shared-memory
queue readers on CPU hosts (integration): with the connectors' reader wait, a reader that waits between
messages sleeps instead of spinning, and still gets every message without a stall (no notify is lost for good).
Real vLLM MessageQueues between two processes; vLLM's own spinning readers are the baseline of the same run."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kvpp_core.allocation import CacheLayer, place
from kvpp_core.ownership import rank_layout
from kvpp_core.vllm_adapter import RequestBlocks, kvpp_cache_config, step_needs_broadcast

BLOCK = 16


def _new(req_id, block_ids, computed):
    from vllm.v1.core.sched.output import NewRequestData

    return NewRequestData(req_id=req_id, prompt_token_ids=list(range(64)), mm_features=[], sampling_params=None,
                          pooling_params=None, block_ids=(list(block_ids),), num_computed_tokens=computed,
                          lora_request=None)


def _output(new=(), cached=(), finished=(), preempted=None):
    """A SchedulerOutput as vLLM builds it; `cached` holds (req_id, new block ids or None, computed, resumed)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    cached_data = CachedRequestData(
        req_ids=[c[0] for c in cached], resumed_req_ids={c[0] for c in cached if c[3]},
        new_token_ids=[[] for _ in cached], all_token_ids={},
        new_block_ids=[None if c[1] is None else (list(c[1]),) for c in cached],
        num_computed_tokens=[c[2] for c in cached], num_output_tokens=[1 for _ in cached])
    scheduled = {r.req_id: 8 for r in new} | {c[0]: 1 for c in cached}
    return replace(SchedulerOutput.make_empty(), scheduled_new_reqs=list(new), scheduled_cached_reqs=cached_data,
                   num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                   finished_req_ids=set(finished), preempted_req_ids=preempted)


@pytest.mark.unit
def test_history_is_the_blocks_up_to_each_requests_computed_tokens():
    blocks = RequestBlocks()
    step = _output(new=[_new("a", [4, 5, 6], 33), _new("b", [7, 8], 16), _new("fresh", [10, 11], 0)])
    blocks.update(step)  # 33 tokens: blocks 4, 5 and the partial 6; b: exactly one block; fresh: none
    assert blocks.history(step, BLOCK) == [4, 5, 6, 7]
    step = _output(cached=[("a", [9], 49, False), ("b", None, 17, False)])  # a grew a block, b did not
    blocks.update(step)
    assert blocks.history(step, BLOCK) == [4, 5, 6, 7, 8, 9]
    step = _output(cached=[("b", None, 18, False)], finished=["a", "fresh"])
    blocks.update(step)
    assert blocks.history(step, BLOCK) == [7, 8]


@pytest.mark.unit
def test_a_resumed_request_takes_its_new_block_list_and_a_preempted_one_is_dropped():
    blocks = RequestBlocks()
    blocks.update(_output(new=[_new("a", [1, 2], 20)]))
    blocks.update(_output(preempted={"a"}))  # Model Runner V2 is told; V1 only sees it resume
    step = _output(cached=[("a", [30, 31, 32], 40, True)])
    blocks.update(step)
    assert blocks.history(step, BLOCK) == [30, 31, 32]


@pytest.mark.unit
def test_history_falls_back_to_every_block_when_a_requests_blocks_are_not_known():
    blocks = RequestBlocks()
    step = _output(cached=[("unknown", [3], 16, False)])  # first seen running (never as a new request)
    blocks.update(step)
    assert blocks.history(step, BLOCK) is None
    two_groups = replace(_new("g", [1], 16), block_ids=([1], [2]))
    step = _output(new=[two_groups])
    blocks.update(step)
    assert blocks.history(step, BLOCK) is None


def _scheduled(tokens, new_computed=(), running=0):
    return SimpleNamespace(
        total_num_scheduled_tokens=tokens,
        scheduled_new_reqs=[SimpleNamespace(num_computed_tokens=n) for n in new_computed],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[f"r{i}" for i in range(running)]),
    )


@pytest.mark.unit
@pytest.mark.parametrize("output, expected", [
    (_scheduled(0, running=2), False),  # an empty step (e.g. only finished requests)
    (_scheduled(300, new_computed=(0, 0)), False),  # fresh prefills only
    (_scheduled(300, new_computed=(0, 32)), True),  # a prefix hit or KV load brought history
    (_scheduled(2, running=2), True),  # decodes attend over their history
    (_scheduled(45, new_computed=(0,), running=1), True),
])
def test_step_gating(output, expected):
    assert step_needs_broadcast(output) is expected


@pytest.mark.unit
def test_rewritten_cache_config_binds_each_cache_where_the_placement_says():
    """vLLM's allocator, given the rewritten config, puts every cache at its planned offset: owned ones
    apart, the foreign layers of one staging slot on the same bytes, and no more bytes than planned."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)] + ["model.layers.6.self_attn.attn"]
    layers = [CacheLayer(n, spec.page_size_bytes, i if i < 6 else None) for i, n in enumerate(names)]
    layout = rank_layout(range(6), 2, 1, staging=2)  # owns 3-5; 0-2 land in two staging slots; 6 is MTP
    num_blocks = 3
    placement = place(layers, layout, num_blocks)
    engine_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )
    config = kvpp_cache_config(engine_config, placement)
    assert config.num_blocks == num_blocks and config.kv_cache_groups == engine_config.kv_cache_groups
    assert sorted(t.layers[0] for t in config.kv_cache_tensors) == sorted(names)

    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    base = caches[names[0]].untyped_storage()
    assert base.nbytes() == placement.total_bytes == (3 + 1 + 2) * num_blocks * spec.page_size_bytes
    for name, cache in caches.items():
        assert cache.untyped_storage().data_ptr() == base.data_ptr()
        assert cache.data_ptr() - base.data_ptr() == placement.offsets[name]
        assert cache.shape[0] == num_blocks and cache.nbytes == num_blocks * spec.page_size_bytes
    # Layers 0 and 2 run at even positions, layer 1 at an odd one: two slots, the even ones aliased.
    assert caches[names[0]].data_ptr() == caches[names[2]].data_ptr() != caches[names[1]].data_ptr()
    caches[names[0]].fill_(1.0)
    assert torch.equal(caches[names[2]], caches[names[0]]) and not caches[names[1]].any()
    persistent = [caches[n] for n in placement.persistent]
    assert len({c.data_ptr() for c in persistent}) == 4 and not any(c.any() for c in persistent)


MESSAGES = 400
IDLE_S = 0.8


def _counted(queue) -> dict:
    """Count what the reader's waits do, by calls, not by the clock: each `sched_yield` of vLLM's spin, and each
    poll of the notify socket with its timeout and whether a notify (or cancel) ended it."""
    from vllm.distributed.device_communicators import shm_broadcast

    counts = {"yields": 0, "polls": []}
    yield_once = shm_broadcast.sched_yield

    def counted_yield():
        counts["yields"] += 1
        yield_once()

    poller = queue._spin_condition.poller
    poll_once = poller.poll

    def counted_poll(timeout=None):
        events = poll_once(timeout)
        counts["polls"].append((timeout, bool(events)))
        return events

    shm_broadcast.sched_yield, poller.poll = counted_yield, counted_poll
    return counts


def _reader(handle, mode: str, results) -> None:
    from kvpp_core import vllm_adapter

    from connectors.launch import connector_rules

    if mode == "spin":
        os.environ[vllm_adapter.SPINNING_READERS_ENV] = "1"
    vllm_adapter.install(connector_rules)
    vllm_adapter.quiet_shm_readers()
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    queue = MessageQueue.create_from_handle(handle, 0)
    queue.wait_until_ready()
    counts = _counted(queue)
    seen = [queue.dequeue(timeout=30) for _ in range(MESSAGES + 1)]  # the writer idles IDLE_S before the last
    results.put({"polling": vllm_adapter._readers_poll, "seen": seen, **counts})


def _run(mode: str) -> dict:
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    ctx = mp.get_context("spawn")
    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    results = ctx.Queue()
    child = ctx.Process(target=_reader, args=(writer.export_handle(), mode, results), daemon=True)
    child.start()
    try:
        writer.wait_until_ready()
        for index in range(MESSAGES):
            writer.enqueue(index)
            # gaps around the poll slice, and a few long enough to leave the busy window
            gap = (0, 0.0002, 0.001, 0.003)[index % 4] if index % 97 else 1.2
            time.sleep(gap)
        time.sleep(IDLE_S)
        writer.enqueue(MESSAGES)
        return results.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    from kvpp_core import vllm_adapter

    from connectors.launch import connector_rules

    vllm_adapter.install(connector_rules)
    return {mode: _run(mode) for mode in ("spin", "poll")}


@pytest.mark.integration
@pytest.mark.vllm
def test_polling_readers_get_every_message_in_order_without_a_stall(runs):
    """A lost notify used to cost vLLM's 5 s recheck: a stall is a poll longer than one slice that no notify
    ended. Counted, not timed: the writer's longest silence (1.2 s) is far inside a long poll's 5 s."""
    from kvpp_core.vllm_adapter import READER_POLL_MS

    poll = runs["poll"]
    assert poll["polling"] is True
    assert poll["seen"] == list(range(MESSAGES + 1))
    stalls = [timeout for timeout, notified in poll["polls"] if not notified and (timeout or 1e9) > READER_POLL_MS]
    assert stalls == [], stalls


@pytest.mark.integration
@pytest.mark.vllm
def test_waiting_readers_sleep_on_their_socket_where_vllms_spin(runs):
    """What waiting costs, by what the reader does rather than by CPU seconds (which depend on the host's
    load; bench/pd_transfer.py --readers spin,poll measures those): vLLM's reader yields in a loop for 1 s
    after each message, the polling one never yields and blocks in its socket in slices of READER_POLL_MS."""
    from kvpp_core.vllm_adapter import READER_POLL_MS

    spin, poll = runs["spin"], runs["poll"]
    assert spin["polling"] is False and spin["seen"] == list(range(MESSAGES + 1))
    assert spin["yields"] > 0 and not [t for t, _ in spin["polls"] if t == READER_POLL_MS]  # the baseline spins
    assert poll["yields"] == 0, poll["yields"]
    slices = [t for t, _ in poll["polls"] if t is not None and t <= READER_POLL_MS]
    assert slices and set(slices) == {READER_POLL_MS}, sorted(set(slices))  # never a 0 ms busy poll


@pytest.mark.unit
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_history_follows_vllms_scheduler_through_chunks_decodes_preemption_and_prefix_hits(
        tiny_model, runner, monkeypatch):
    """vLLM's own Scheduler, short of blocks, runs two requests that share a prefix through chunked
    prefills, decodes, a preemption and a resume; at every step the history kept from its outputs is
    exactly the scheduler's blocks of each scheduled request up to its computed tokens. Under both
    runners: the scheduler tells Model Runner V2 of preemptions, V1 only of resumes."""
    from tests.helpers import vllm_scheduler as vs

    config = vs.engine_config(tiny_model, None, max_num_batched_tokens=48)
    # vLLM turns these off for MLA on CPU (its CPU attention cannot use them); its scheduler can.
    config.cache_config.enable_prefix_caching = config.scheduler_config.enable_chunked_prefill = True
    config.scheduler_config.max_num_batched_tokens = 48
    # After the config is built: vLLM refuses V2 where Triton cannot run, but its scheduler runs anywhere.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner == "v2" else "0")
    sched = vs.scheduler(config, num_blocks=9)  # 8 usable: each request fits alone, both do not
    assert sched.vllm_config.use_v2_model_runner is (runner == "v2")
    shared = list(range(100, 148))
    sched.add_request(vs.request("a", shared + list(range(22)), max_tokens=40))
    blocks, seen, started = RequestBlocks(), set(), set()
    for index in range(300):
        if index == 3:
            sched.add_request(vs.request("b", shared + list(range(500, 520)), max_tokens=40))
        if not sched.requests:
            break
        before = {req_id: req.num_computed_tokens for req_id, req in sched.requests.items()}
        out = sched.schedule()
        blocks.update(out)
        cached = out.scheduled_cached_reqs
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        assert all(computed[r] == before[r] for r in cached.req_ids if r not in cached.resumed_req_ids)
        expected = sorted({b for r in out.num_scheduled_tokens for b in vs.block_ids(sched, r)[: -(-computed[r] // BLOCK)]})
        assert blocks.history(out, BLOCK) == expected, index
        vs.report_step(sched, out)
        seen |= {"resumed"} if cached.resumed_req_ids or any(r.req_id in started for r in out.scheduled_new_reqs) else set()
        started |= {r.req_id for r in out.scheduled_new_reqs}
        seen |= {"prefix hit"} if any(r.num_computed_tokens for r in out.scheduled_new_reqs) else set()
        seen |= {"preempted"} if out.preempted_req_ids else set()
    assert not sched.requests, "both requests finished"
    assert seen == {"preempted", "resumed", "prefix hit"}


@pytest.mark.unit
def test_the_shared_memory_backing_is_adopted_from_model_runner_v2s_allocator(monkeypatch):
    """V2's `init_kv_cache` calls the allocator through its own module (vllm.v1.worker.gpu.attn_utils):
    inside the adoption, vLLM's V2 allocation path hands its caches to the shared-memory group."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.gpu import attn_utils

    from kvpp_core import vllm_adapter

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=2, kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)], kv_cache_tensors=[
        KVCacheTensor(size=2 * spec.page_size_bytes, layers=["l0"], layer_stride=2 * spec.page_size_bytes,
                      block_stride=spec.page_size_bytes)])
    adopted = []
    original = attn_utils.allocate_kv_cache
    with vllm_adapter._kv_backing_adopted_by(lambda caches: adopted.append(caches) or caches):
        caches = attn_utils.allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    assert adopted == [caches] and caches["l0"].nbytes == 2 * spec.page_size_bytes
    assert attn_utils.allocate_kv_cache is original, "the allocator is restored after the allocation"


@pytest.mark.unit
def test_every_patch_target_exists_on_this_vllm_and_a_missing_one_refuses_kvpp_by_name(monkeypatch):
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    from kvpp_core import startup, vllm_adapter
    from kvpp_core.config import KvppConfigError

    assert startup.vllm_version() in startup.SUPPORTED_VLLM and vllm_adapter.missing_patch_targets() == ()
    monkeypatch.delattr(MLAAttention, "prepare_kv_cache_update")
    missing = vllm_adapter.missing_patch_targets()
    assert missing == ("vllm.model_executor.layers.attention.mla_attention.MLAAttention.prepare_kv_cache_update",)
    monkeypatch.setattr(startup, "_adapter_gaps", missing)
    with pytest.raises(KvppConfigError, match="MLAAttention.prepare_kv_cache_update.*enable_kvpp"):
        startup.check_vllm_version()


# ---- GQA: vLLM's CPU attention kernel, hooked on both releases ---------------------------------------------
GQA_BLOCKS, GQA_BLOCK, GQA_HEAD = 4, 32, 32


class _Delivery:
    """A staging broadcaster's place in the runtime, narrowed to what the write hook calls: each delivery, with
    whether the layer's cache was still untouched by this step's write when it came."""

    def __init__(self, caches: dict[int, torch.Tensor]) -> None:
        self.caches, self.delivered = caches, []

    def before_layer(self, layer_id: int) -> None:
        self.delivered.append((layer_id, bool(self.caches[layer_id].count_nonzero() == 0)))


def _gqa_runtime(broadcaster):
    """The real KvppRuntime over a layout of two target layers, their caches named as vLLM names them."""
    from kvpp_core.runtime import KvppRuntime

    names = {f"model.layers.{i}.self_attn.attn": i for i in range(2)}
    return KvppRuntime(SimpleNamespace(layer_ids=names), broadcaster)


def _cpu_attention():
    """vLLM's own CPUAttentionBackendImpl and a layer of it; the kernel's C++ op (absent from vLLM 0.33.0's wheel
    here) is replaced by a plain write of each new token's K and V into its block, so that only vLLM's Python runs."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    impl = CPUAttentionBackendImpl.__new__(CPUAttentionBackendImpl)
    impl.attn_type, impl.kv_cache_dtype = AttentionType.DECODER, "auto"
    return impl


def _write_slots(key, value, key_cache, value_cache, slot_mapping, isa, **scales):
    for token, slot in enumerate(slot_mapping.tolist()):
        block, offset = divmod(slot, GQA_BLOCK)
        key_cache[block, :, offset] = key[token]
        value_cache[block, :, offset] = value[token]


def _layer(i: int):
    return SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn", isa="vec", _k_scale_float=1.0,
                           _v_scale_float=1.0)


def _new_tokens():
    """Two new tokens, in blocks 1 and 2 (slots 33 and 70): [tokens, kv heads, head size], as vLLM passes them."""
    return torch.randn(2, 1, GQA_HEAD), torch.randn(2, 1, GQA_HEAD), torch.tensor([33, 70])


@pytest.fixture
def gqa_hooks(monkeypatch):
    """The adapter installed on this release (vLLM 0.32.0, or 0.33.0 in its contract tier), vLLM's kernel op
    replaced as above, and the runtime left as found."""
    from vllm.v1.attention.backends import cpu_attn

    from connectors.launch import connector_rules
    from kvpp_core import runtime, vllm_adapter

    vllm_adapter.install(connector_rules)
    monkeypatch.setattr(cpu_attn.ops, "cpu_attn_reshape_and_cache", _write_slots, raising=False)
    monkeypatch.setattr(runtime, "_RUNTIME", None)
    return cpu_attn.CPUAttentionBackendImpl


@pytest.mark.unit
def test_the_gqa_hooks_wrap_cpu_attentions_kv_write_and_attention_on_this_vllm(gqa_hooks):
    from kvpp_core import vllm_adapter

    assert ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", ("do_kv_cache_update", "forward")) \
        in vllm_adapter._PATCH_TARGETS
    for method in ("do_kv_cache_update", "forward"):
        hooked = vars(gqa_hooks)[method]
        original = hooked.__wrapped__
        assert hooked.kvpp_patch and not getattr(original, "kvpp_patch", False)
        assert (original.__module__, original.__qualname__) == (
            "vllm.v1.attention.backends.cpu_attn", f"CPUAttentionBackendImpl.{method}")


@pytest.mark.unit
def test_a_gqa_layer_is_delivered_before_its_new_tokens_are_written(gqa_hooks, monkeypatch):
    """Staging: the write hook delivers the layer's history (before_layer), then vLLM's write runs, on every
    rank; without KVPP (no runtime) the write is vLLM's alone."""
    from kvpp_core import runtime

    caches = {i: torch.zeros(GQA_BLOCKS, 1, GQA_BLOCK, 2 * GQA_HEAD) for i in range(2)}
    delivery = _Delivery(caches)
    impl = _cpu_attention()
    key, value, slots = _new_tokens()
    impl.do_kv_cache_update(_layer(0), key, value, caches[0], slots)
    assert delivery.delivered == [] and caches[0].count_nonzero() > 0, "no runtime: vLLM's write alone"
    caches[0].zero_()
    monkeypatch.setattr(runtime, "_RUNTIME", _gqa_runtime(delivery))
    for i in range(2):
        impl.do_kv_cache_update(_layer(i), key, value, caches[i], slots)
    assert delivery.delivered == [(0, True), (1, True)], "each layer delivered before its write"
    for cache in caches.values():
        k, v = cache.view(GQA_BLOCKS, 1, 2 * GQA_BLOCK, GQA_HEAD).chunk(2, dim=2)
        assert torch.equal(k[1, :, 1], key[0]) and torch.equal(v[2, :, 6], value[1])
        assert cache[0].count_nonzero() == 0 and cache[3].count_nonzero() == 0, "only the new tokens' blocks"


@pytest.mark.unit
def test_under_zero_copy_a_reader_skips_its_write_and_waits_before_reading(gqa_hooks, monkeypatch):
    """kvpp rank 1 of a group of 2 owns layer 1: it writes layer 1's new tokens, skips layer 0's (its owner
    writes them into the pages this rank reads in place), and asks before attending over either layer."""
    from kvpp_core import runtime
    from kvpp_core.zero_copy import ZeroCopyLayers

    class Reads(ZeroCopyLayers):
        asked: list[int] = []

        def before_read(self, layer_id: int) -> None:
            self.asked.append(layer_id)

    reader = Reads(rank_layout(range(2), 2, 1, staging=0), None, 1.0)
    monkeypatch.setattr(runtime, "_RUNTIME", _gqa_runtime(reader))
    impl = _cpu_attention()
    key, value, slots = _new_tokens()
    caches = {i: torch.zeros(GQA_BLOCKS, 1, GQA_BLOCK, 2 * GQA_HEAD) for i in range(2)}
    for i in range(2):
        impl.do_kv_cache_update(_layer(i), key, value, caches[i], slots)
    assert caches[0].count_nonzero() == 0 and caches[1].count_nonzero() > 0
    output = torch.zeros(2, 4 * GQA_HEAD)
    for i in range(2):  # no metadata: vLLM's forward returns the output untouched (its warm-up path)
        assert impl.forward(_layer(i), torch.zeros(2, 4, GQA_HEAD), key, value, caches[i], None, output) is output
    assert Reads.asked == [0, 1]


def _worker(specs: dict, impls: dict):
    forward_context = {name: SimpleNamespace(impl=impl) for name, impl in impls.items()}
    return SimpleNamespace(model_runner=SimpleNamespace(get_kv_cache_spec=lambda: specs),
                           vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(
                               static_forward_context=forward_context)))


@pytest.mark.unit
def test_a_gqa_cache_kvpp_cannot_shard_is_refused_one_line_each(gqa_hooks):
    """Fail closed on this release: a sliding-window cache, or a layer on a kernel whose write and read KVPP does
    not wrap, is named with its reason; plain full attention on CPU_ATTN passes."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvpp_core.vllm_adapter import _uncovered_gqa_caches

    class OtherKernelImpl(gqa_hooks):  # inherits the hooked methods but is not the class KVPP wraps
        pass

    shape = dict(block_size=GQA_BLOCK, num_kv_heads=1, head_size=GQA_HEAD, dtype=torch.float32)
    full, window = FullAttentionSpec(**shape), SlidingWindowSpec(**shape, sliding_window=128)
    impl = _cpu_attention()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    assert _uncovered_gqa_caches(_worker({n: full for n in names}, {n: impl for n in names})) == []
    problems = _uncovered_gqa_caches(_worker(
        {names[0]: full, names[1]: window, names[2]: full},
        {names[0]: impl, names[1]: impl, names[2]: OtherKernelImpl.__new__(OtherKernelImpl)}))
    assert problems == [
        f"{names[1]} is a SlidingWindowSpec cache (sliding-window, chunked, sink, linear-attention and Mamba caches, "
        "and hybrid KV cache groups, are not handled): only plain full attention",
        f"{names[2]} runs on OtherKernelImpl, a kernel KVPP does not cover: it wraps do_kv_cache_update and forward "
        "of CPUAttentionBackendImpl (vLLM's CPU attention) only",
    ]
    assert all("\n" not in p for p in problems)
    windowed = FullAttentionSpec(**shape, sliding_window=64)  # what vLLM builds with its hybrid KV cache manager off
    assert _uncovered_gqa_caches(_worker({names[0]: windowed}, {names[0]: impl})) == [
        f"{names[0]} attends over a window (sliding_window 64): only plain full attention is handled"]
