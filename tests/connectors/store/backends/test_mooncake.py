"""The Mooncake store backend against a real `mooncake_master` plus the pool's own segment holder
(`kvpp pool up`): bytes intact through zero-copy multi-page objects, wrong sizes refused, pooled
objects outliving the client that wrote them, the shard hit rule on real keys, a killed master
turning every call into a failure within a bounded time, and a holder stalled past the client TTL
costing its blocks but not the pool. With the connector's default bounds, a stopped master or segment
holder costs a lookup, a load and a save at most a short bound, after which they fail at once while the
client's breaker is open, and the pool is used again once its prober finds the master or holder answering
(or a killed master started again). A store call that outlives its bound holds a staging slot, never a block."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from connectors.store.backends import Status, open_backend
from connectors.common.mooncake_env import PROGRESS_TIMEOUT_ENV
from connectors.store.backends.mooncake import RPC_TIMEOUT_ENV
from connectors.store.settings import parse_store_settings
from connectors.store.keys import CacheLayout, ShardKey, block_hashes
from connectors.store.metadata import BlockJob, StoreMetadata
from connectors.store.shards import StageLayers, all_shards, count_pooled, shard_keys
from connectors.store.staging import SLOTS, Staging
from connectors.store.transfer import BlockPages, ShardIO
from deploy.services.pool import pool_down, pool_up
from deploy.services.processes import running

from tests.helpers.paths import REPO as ROOT
from tests.helpers.pool_runs import POOL_ENV, POOL_TIMERS

BOUND_S = 4.0
LAYERS, BLOCKS, PAGE = 3, 8, (16, 576)


@pytest.fixture(autouse=True)
def native_bounds_left_as_found():
    """Every Mooncake client sets the transfer-progress bound for its process unless the environment has one
    (connectors.store.backends.mooncake.native_bounds): no test leaves its own behind for the next."""
    before = {name: os.environ.get(name) for name in (PROGRESS_TIMEOUT_ENV, RPC_TIMEOUT_ENV)}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    os.environ.update(POOL_ENV)
    state = tmp_path_factory.mktemp("pool")
    info = pool_up("mooncake", state, 256 << 20, **POOL_TIMERS)
    yield info
    pool_down(state)


@pytest.fixture(scope="module")
def backend(pool):
    b = open_backend(pool.store_config, call_timeout_s=BOUND_S)
    yield b
    b.close()


def _caches(seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, *PAGE, generator=gen) for _ in range(LAYERS)]


_REGISTERED: list[torch.Tensor] = []
"""Registered tensors stay alive: a freed one's address could be reused and registered twice."""


def _register(backend, caches):
    _REGISTERED.extend(caches)
    for c in caches:
        backend.register(c.data_ptr(), c.numel() * c.element_size())
    return BlockPages(caches)


def _staging(backend, pages, **kwargs):
    """Staging slots for `pages`' objects, registered with `backend` (the store client moves data only through them)."""
    staging = Staging(pages.object_bytes, **kwargs)
    _REGISTERED.extend(staging.tensors)
    for ptr, size in staging.regions():
        backend.register(ptr, size)
    return staging


def _objects(pages, block_ids):
    return [pages.ptrs(b) for b in block_ids], [pages.sizes()] * len(block_ids)


@pytest.mark.integration
def test_multi_page_objects_round_trip_bytes_intact(backend):
    src, dst = _caches(1), [torch.zeros(BLOCKS, *PAGE) for _ in range(LAYERS)]
    src_pages, dst_pages = _register(backend, src), _register(backend, dst)
    keys = [f"test/intact/{i}" for i in range(4)]
    assert backend.put(keys, *_objects(src_pages, [0, 1, 2, 3])) == [Status.OK] * 4
    assert backend.exists(keys + ["test/intact/none"]) == [Status.OK] * 4 + [Status.MISSING]
    # Load into other block ids: object i lands in block 7 - i of every layer.
    assert backend.get(keys, *_objects(dst_pages, [7, 6, 5, 4])) == [Status.OK] * 4
    for s, d in zip(src, dst):
        assert torch.equal(d[[7, 6, 5, 4]], s[[0, 1, 2, 3]])
        assert torch.count_nonzero(d[:4]) == 0, "nothing outside the target blocks was written"


@pytest.mark.integration
def test_missing_and_wrong_size_objects_are_refused(backend):
    caches = _caches(2)
    pages = _register(backend, caches)
    small = torch.ones(100)
    big = torch.ones(pages.object_bytes // 4 + 64)
    _REGISTERED.extend((small, big))
    for t in (small, big):
        backend.register(t.data_ptr(), t.numel() * 4)
    assert backend.put(["test/small", "test/big"], [[small.data_ptr()], [big.data_ptr()]],
                       [[small.numel() * 4], [big.numel() * 4]]) == [Status.OK, Status.OK]
    before = [c.clone() for c in caches]
    got = backend.get(["test/small", "test/big", "test/absent"], *_objects(pages, [0, 1, 2]))
    assert got == [Status.WRONG_SIZE, Status.WRONG_SIZE, Status.MISSING]
    assert all(torch.equal(b[1:], c[1:]) for b, c in zip(before, caches)), "an oversized object wrote nothing"
    # Through the connector's path the bad object is also dropped from the pool.
    layout_key = ShardKey("fp", 0, 0)
    assert backend.put([layout_key.key("a" * 64)], [[small.data_ptr()]], [[small.numel() * 4]]) == [Status.OK]
    assert ShardIO(backend, layout_key, pages, _staging(backend, pages, count=1)).load([3], ["a" * 64]) == \
        [Status.WRONG_SIZE]
    assert backend.exists([layout_key.key("a" * 64)]) == [Status.MISSING]


_WRITER = """
import sys, torch
from connectors.store.backends import open_backend
from connectors.store.settings import parse_store_settings
b = open_backend(parse_store_settings({"backend": "mooncake", "lookup_rpc_port": 1,
                                       "mooncake": {"master_server_address": sys.argv[1]}}), call_timeout_s=4)
t = torch.arange(4096, dtype=torch.float32)
b.register(t.data_ptr(), t.numel() * 4)
print(b.put(["test/survivor"], [[t.data_ptr()]], [[t.numel() * 4]]))
b.close()
"""


@pytest.mark.integration
def test_pooled_objects_outlive_the_process_that_wrote_them(pool, backend):
    address = pool.store_config.mooncake.master_server_address
    out = subprocess.run([sys.executable, "-c", _WRITER, address], cwd=ROOT, env={**os.environ, **POOL_ENV},
                         capture_output=True, text=True, timeout=60)
    assert "[<Status.OK: 0>]" in out.stdout, out.stderr[-2000:]
    time.sleep(POOL_TIMERS["client_ttl_s"] + 1)  # beyond the master's client_ttl: the writer is gone for good
    dst = torch.zeros(4096)
    _REGISTERED.append(dst)
    backend.register(dst.data_ptr(), dst.numel() * 4)
    assert backend.get(["test/survivor"], [[dst.data_ptr()]], [[dst.numel() * 4]]) == [Status.OK]
    assert torch.equal(dst, torch.arange(4096, dtype=torch.float32))


@pytest.mark.integration
def test_a_removed_owner_shard_ends_the_hit_prefix(backend):
    caches = _caches(3)
    pages = _register(backend, caches)
    layout = CacheLayout("itest-model", "float32", 16, pages.page_bytes)
    shards = shard_keys(layout, all_shards([StageLayers(0, (0, 1, 2, 3))], 2, kvpp=True))
    hashes = block_hashes(list(range(16 * 5)), 16)
    for shard in shards:
        assert backend.put(shard.keys(hashes), *_objects(pages, range(5))) == [Status.OK] * 5
    assert count_pooled(backend, shards, hashes) == 5
    assert backend.remove([shards[1].key(hashes[3])]) == [Status.OK]
    assert count_pooled(backend, shards, hashes) == 3
    assert count_pooled(backend, shards[:1], hashes) == 5, "the other owner's shard is still whole"


@pytest.mark.integration
def test_the_owner_shards_of_two_gqa_heads_of_one_block_are_two_objects(backend):
    """A TP4 KVPP engine of a model with 2 KV heads: ranks 0-1 hold head 0 and ranks 2-3 head 1, each pair splitting
    the layers between its owners. The four ranks save the same blocks: each loads back its own head's pages, and a
    block is a hit only while both heads' owner shards are pooled."""
    layout = CacheLayout("itest-gqa", "float32", 16, BlockPages(_caches(0)).page_bytes)
    shards = shard_keys(layout, all_shards([StageLayers(0, (0, 1, 2, 3, 4, 5))], 2, kvpp=True, heads=((0,), (1,))))
    assert [(s.heads, s.owner) for s in shards] == [((0,), 0), ((0,), 1), ((1,), 0), ((1,), 1)]
    hashes = block_hashes(list(range(16 * 4)), 16)
    ranks = [_caches(40 + rank) for rank in range(4)]  # each rank's owned layers (LAYERS of them), its own content
    for caches, shard in zip(ranks, shards):
        pages = _register(backend, caches)
        result = ShardIO(backend, shard, pages, _staging(backend, pages)).save([0, 1, 2, 3], hashes)
        assert (result.saved, result.skipped) == (4, 0), "no rank found another head's object under its key"
    assert count_pooled(backend, shards, hashes) == 4
    for caches, shard in zip(ranks, shards):
        loaded = [torch.zeros(BLOCKS, *PAGE) for _ in range(LAYERS)]
        pages = _register(backend, loaded)
        assert ShardIO(backend, shard, pages, _staging(backend, pages)).load([5, 6, 7, 4], hashes) == [Status.OK] * 4
        assert all(torch.equal(d[[5, 6, 7, 4]], s[:4]) for d, s in zip(loaded, caches)), shard
    assert backend.remove([shards[3].key(hashes[2])]) == [Status.OK]  # head 1's second owner loses block 2
    assert count_pooled(backend, shards, hashes) == 2
    assert count_pooled(backend, shards[:2], hashes) == 4, "head 0's shards are still whole"


@pytest.mark.integration
def test_killed_master_turns_calls_into_bounded_failures(tmp_path):
    info = pool_up("mooncake", tmp_path / "doomed", 16 << 20, **POOL_TIMERS)
    try:
        b = open_backend(info.store_config, call_timeout_s=BOUND_S)
        caches = _caches(4)
        pages = _register(b, caches)
        assert b.put(["test/doomed"], *_objects(pages, [0])) == [Status.OK]
        os.kill(info.pids[0], signal.SIGKILL)  # the master
        for call in (lambda: b.exists(["test/doomed", "x"]), lambda: b.get(["test/doomed"], *_objects(pages, [1])),
                     lambda: b.put(["test/new"], *_objects(pages, [2]))):
            start = time.monotonic()
            status = call()
            assert all(s in (Status.FAILED, Status.TIMEOUT, Status.MISSING, Status.REFUSED) for s in status), status
            assert Status.OK not in status
            # Liveness: the 4 s call bound, doubled for a loaded host, and still short of the 10 s master RPC timeout.
            assert time.monotonic() - start <= 2 * BOUND_S
        b.close()
    finally:
        pool_down(tmp_path / "doomed")


@pytest.mark.integration
def test_a_holder_stalled_past_the_client_ttl_costs_its_blocks_not_the_pool(tmp_path):
    """A segment holder that misses its heartbeats for the master's client_ttl (in CI: starved by the
    engine tier, at a 2 s TTL) has its segment unmounted with every block in it. That must cost misses only:
    the holder mounts its segment again on its next heartbeat and the pool takes saves again."""
    ttl = POOL_TIMERS["client_ttl_s"]  # one a loaded host keeps until the stall, so only the stall expires it
    info = pool_up("mooncake", tmp_path / "starved", 16 << 20, **POOL_TIMERS)
    holder = info.pids[1]
    try:
        b = open_backend(info.store_config, call_timeout_s=BOUND_S)
        src, dst = _caches(6), [torch.zeros(BLOCKS, *PAGE) for _ in range(LAYERS)]
        src_pages, dst_pages = _register(b, src), _register(b, dst)
        assert b.put(["test/before"], *_objects(src_pages, [0])) == [Status.OK]
        os.kill(holder, signal.SIGSTOP)
        time.sleep(ttl + 3)
        os.kill(holder, signal.SIGCONT)
        wait = time.monotonic() + 30
        while b.exists(["test/before"]) != [Status.MISSING]:
            assert time.monotonic() < wait, "the stalled holder's segment was never unmounted"
            time.sleep(0.5)
        while (saved := b.put(["test/after"], *_objects(src_pages, [1]))) != [Status.OK]:
            assert time.monotonic() < wait, f"the pool took no save after the holder woke: {saved}"
            time.sleep(0.5)
        assert b.get(["test/after"], *_objects(dst_pages, [2])) == [Status.OK]
        assert all(torch.equal(d[2], s[1]) for s, d in zip(src, dst))
        b.close()
    finally:
        os.kill(holder, signal.SIGCONT)
        pool_down(tmp_path / "starved")


# ---- calls that outlive their bound -------------------------------------------------------------------
# A store call that misses its bound keeps running natively and keeps reading or writing the blocks it
# was given. The worker must not hand those blocks back to vLLM (which frees and reuses them at once)
# before the call has returned. Objects of 4 x 1 MiB pages make a 4-block call last well beyond 1 ms.
BIG_LAYERS, BIG_BLOCKS, BIG_PAGE = 4, 4, (512, 512)


def _fixed(bound_ms: float) -> dict:
    """Settings bounding every store call of a worker by `bound_ms` alone."""
    return {"backend_timeout_ms": bound_ms, "backend_timeout_floor_ms": bound_ms, "lookup_timeout_ms": bound_ms + 1}


def _store_worker(pool, monkeypatch, caches, events: bool = False, role: str = "kv_producer", **settings):
    """A real StoreWorker on the real pool with the connector's `settings` over the pool's (the defaults unless
    given; `events`: vLLM's KV events on, so it reports its saves; role kv_both: it answers lookups too); only
    vLLM's rank lookups are stubbed (no process group)."""
    from vllm.config.kv_events import KVEventsConfig

    import vllm.distributed.parallel_state as parallel_state

    from connectors.store.worker import StoreWorker

    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0))
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_world_group", lambda: SimpleNamespace(rank_in_group=0))
    vllm_config = SimpleNamespace(
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True) if events else None,
        kv_transfer_config=SimpleNamespace(kv_role=role),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_rank=0),
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(model="late-calls", use_mla=True,
                                     hf_text_config=SimpleNamespace(num_hidden_layers=BIG_LAYERS)),
    )
    cfg = parse_store_settings({**pool.kv_connector_extra_config, **settings})
    worker = StoreWorker(vllm_config, cfg)
    _REGISTERED.extend(caches)
    worker.register_kv_caches({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)})
    return worker


def _wait_reported(worker, *req_ids: str, sending: bool, within_s: float = 30) -> None:
    deadline, waiting = time.monotonic() + within_s, set(req_ids)
    while time.monotonic() < deadline:
        sent, recv = worker.get_finished(waiting if sending else set())
        waiting -= (sent if sending else recv) or set()
        if not waiting:
            return
        time.sleep(0.001)
    raise AssertionError(f"{sorted(waiting)} never reported finished")


def _big_caches(fill=None):
    gen = torch.Generator().manual_seed(5)
    shape = (BIG_BLOCKS, *BIG_PAGE)
    return [torch.randn(shape, generator=gen) if fill is None else torch.full(shape, fill) for _ in range(BIG_LAYERS)]


def _stop(pid: int) -> None:
    """SIGSTOP, returning once the process is stopped (state T): on a loaded host a stopped master was seen answering
    a lookup sent right after the signal, before the stop landed."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"pid {pid} never stopped"
        time.sleep(0.005)


def _slots_free(worker, within_s: float = 60) -> None:
    """Wait until every staging slot of the worker is free: no store call still runs late."""
    deadline = time.monotonic() + within_s
    while worker._io.staging.free() < SLOTS:
        assert time.monotonic() < deadline, "a late store call never returned"
        time.sleep(0.01)


@pytest.mark.integration
def test_a_load_that_outlives_its_bound_is_reported_at_once_and_its_late_get_never_writes_its_blocks(pool, monkeypatch):
    """Issue 41: a get that misses its bound keeps running natively (for a stalled pool, the whole stall). The load is
    reported failed (vLLM recomputes) without waiting for it, and what it writes lands in its staging slot: the
    blocks hold what they held, before and after the late get returned."""
    src = _big_caches()
    hashes = tuple(block_hashes(list(range(16 * BIG_BLOCKS)), 16))
    blocks = tuple(range(BIG_BLOCKS))
    writer = _store_worker(pool, monkeypatch, src, **_fixed(10_000))
    writer.wait_for_save(StoreMetadata(saves=[BlockJob("w", blocks, hashes)]))
    _wait_reported(writer, "w", sending=True)
    assert writer.get_stats().data["saved_blocks"] == BIG_BLOCKS
    writer.close()

    dst = _big_caches(fill=0.0)
    reader = _store_worker(pool, monkeypatch, dst, **_fixed(1))  # a 16 MiB get cannot return within 1 ms
    reader.start_load_kv(StoreMetadata(loads=[BlockJob("r", blocks, hashes)]))
    _wait_reported(reader, "r", sending=False)
    assert reader.get_block_ids_with_load_errors() == set(blocks)
    assert reader.get_stats().data["load_timeouts"] == BIG_BLOCKS
    _slots_free(reader)
    assert all(not d.any() for d in dst), "the late get wrote into its slot, never into the blocks"
    reader.close()


def _wait_answered(worker, hashes, within_s: float = 60):
    """Ask the pool (a lookup) until it answers: the client's backoff ended and its probe was answered."""
    deadline = time.monotonic() + within_s
    while not (reply := worker.lookup(hashes)).answered:
        assert time.monotonic() < deadline, f"the pool was never asked again: {reply.error}"
        time.sleep(0.2)
    return reply


def _pooled(pool, monkeypatch, seed: int):
    """BIG_BLOCKS blocks saved to `pool` by a worker of long bounds, which leaves no transfer bound of its own in
    the environment for the worker under test: (hashes, block ids)."""
    hashes = tuple(block_hashes(list(range(seed, seed + 16 * BIG_BLOCKS)), 16))
    blocks = tuple(range(BIG_BLOCKS))
    before = os.environ.get(PROGRESS_TIMEOUT_ENV)
    writer = _store_worker(pool, monkeypatch, _big_caches(), **_fixed(10_000))
    writer.wait_for_save(StoreMetadata(saves=[BlockJob("w", blocks, hashes)]))
    _wait_reported(writer, "w", sending=True)
    assert writer.get_stats().data["saved_blocks"] == BIG_BLOCKS
    writer.close()
    if before is None:
        os.environ.pop(PROGRESS_TIMEOUT_ENV, None)
    return hashes, blocks


@pytest.fixture
def connector_defaults(monkeypatch):
    """The connector's default bounds in force: no Mooncake transfer bound in the environment (the worker sets it
    from its ceiling). The test pools' master RPC bound (POOL_ENV, 2 s) stays: the connector's floor is shorter."""
    monkeypatch.delenv(PROGRESS_TIMEOUT_ENV, raising=False)
    return parse_store_settings({"backend": "mooncake", "lookup_rpc_port": 1}).call_policy


@pytest.mark.integration
def test_a_stalled_segment_holder_costs_a_load_its_bound_then_loads_and_lookups_fail_at_once(
        tmp_path, monkeypatch, runtime_dir, connector_defaults):
    """The segment holder stops answering mid-get. The get misses its bound (from its bytes and the rate of the
    warm load), is counted failed and the load reported then, while the native get still runs (Mooncake ends it at
    its own bounds, or when the holder resumes): the get holds its staging slot, never the blocks. From the
    timed-out get on, lookups and loads fail at once, and once the holder runs again the breaker's prober finds
    the pool answering and loads work again."""
    pool = pool_up("mooncake", tmp_path / "stalled", 64 << 20, **POOL_TIMERS)
    holder = pool.pids[1]
    try:
        hashes, blocks = _pooled(pool, monkeypatch, 7)
        dst = _big_caches(fill=0.0)
        reader = _store_worker(pool, monkeypatch, dst, role="kv_both")
        assert os.environ[PROGRESS_TIMEOUT_ENV] == "3", "the worker bounded Mooncake's transfers by its ceiling"
        reader.start_load_kv(StoreMetadata(loads=[BlockJob("warm", blocks, hashes)]))
        _wait_reported(reader, "warm", sending=False)
        assert reader.get_block_ids_with_load_errors() == set()
        for d in dst:
            d.zero_()
        _stop(holder)
        start = time.monotonic()
        reader.start_load_kv(StoreMetadata(loads=[BlockJob("r", blocks[:1], hashes[:1])]))
        _wait_reported(reader, "r", sending=False)
        held = time.monotonic() - start
        late = reader._backend._calls.late()
        print(f"the load of a stalled holder's object was reported failed after {held:.2f} s")
        assert late, "reported while the native get still ran"
        # Liveness: the get's bound is at most the ceiling (3 s), with 12 s of slack for a loaded host; it took 30 s
        # before the connector set Mooncake's bounds, and the whole stall before loads went through staging slots.
        assert held <= connector_defaults.ceiling_s + 12, f"reported after {held:.1f} s"
        refused = reader.lookup(hashes)  # within the first backoff (1 s) after the get's failure
        assert not refused.answered and "breaker is open" in refused.error
        reader.start_load_kv(StoreMetadata(loads=[BlockJob("r2", blocks, hashes)]))
        _wait_reported(reader, "r2", sending=False)
        assert reader.get_block_ids_with_load_errors() == set(blocks)
        stats = reader.get_stats().data
        assert (stats["load_failures"], stats["load_timeouts"], stats["load_refusals"]) == (1 + BIG_BLOCKS, 1,
                                                                                             BIG_BLOCKS)
        assert stats["breaker_opens"] == 1
        os.kill(holder, signal.SIGCONT)
        _slots_free(reader)
        assert all(not d.any() for d in dst), "the late get never wrote into the blocks"
        assert _wait_answered(reader, hashes).hit_blocks == BIG_BLOCKS
        # The first get after the stall may fail while Mooncake reconnects to the holder (seen: TRANSFER_FAIL after
        # about 1 s, an answer about these objects, which costs no backoff); loads then work again.
        for attempt in range(10):
            reader.start_load_kv(StoreMetadata(loads=[BlockJob(f"again{attempt}", blocks, hashes)]))
            _wait_reported(reader, f"again{attempt}", sending=False)
            if not reader.get_block_ids_with_load_errors():
                break
        else:
            pytest.fail("no load worked again in 10 attempts after the holder resumed")
        reader.close()
    finally:
        os.kill(holder, signal.SIGCONT)
        pool_down(tmp_path / "stalled")


@pytest.mark.integration
def test_a_stopped_master_costs_one_lookup_its_floor_then_calls_fail_at_once_until_it_answers_again(
        tmp_path, monkeypatch, runtime_dir, connector_defaults):
    """With KV events on: the lookup the stopped master does not answer is a counted failure at the floor (0.5 s;
    Mooncake's own master RPC bound is set to 30 s here, so only the connector can end it sooner), the next lookup,
    a load and a save fail at once without asking (no store call is made), the save is reported failed and never
    landed (so never announced stored), and once the master runs again the pool answers, holds what it held, and
    takes saves."""
    pool = pool_up("mooncake", tmp_path / "stopped", 64 << 20, **POOL_TIMERS)
    master = pool.pids[0]
    try:
        hashes, blocks = _pooled(pool, monkeypatch, 11)
        monkeypatch.setenv(RPC_TIMEOUT_ENV, "30000")  # read when the worker's client is set up
        worker = _store_worker(pool, monkeypatch, _big_caches(), events=True, role="kv_both")
        assert worker.lookup(hashes).hit_blocks == BIG_BLOCKS
        _stop(master)
        start = time.monotonic()
        failed = worker.lookup(hashes)
        took = time.monotonic() - start
        print(f"the lookup the stopped master did not answer failed after {took:.2f} s")
        assert not failed.answered and failed.counted and "within its bound" in failed.error
        # The floor (0.5 s) plus 10 s of slack for a loaded host, against the 30 s the native call waits.
        assert took <= connector_defaults.floor_s + 10, f"the lookup took {took:.1f} s"
        refused = worker.lookup(hashes)
        assert not refused.answered and "breaker is open" in refused.error
        worker.start_load_kv(StoreMetadata(loads=[BlockJob("load", blocks, hashes)]))
        _wait_reported(worker, "load", sending=False)
        assert worker.get_block_ids_with_load_errors() == set(blocks)
        fresh = tuple(block_hashes(list(range(500, 500 + 16 * BIG_BLOCKS)), 16))
        worker.wait_for_save(StoreMetadata(saves=[BlockJob("save", blocks, fresh)]))
        _wait_reported(worker, "save", sending=True)
        (report,) = worker.take_shard_report().reports
        assert (report.landed, report.failed) == ((), fresh), "a save the pool did not take is never announced"
        stats = worker.get_stats().data
        assert (stats["lookup_failures"], stats["lookup_refusals"], stats["save_failures"]) == (2, 1, BIG_BLOCKS)
        os.kill(master, signal.SIGCONT)
        assert _wait_answered(worker, hashes).hit_blocks == BIG_BLOCKS, "what it held is still pooled"
        worker.wait_for_save(StoreMetadata(saves=[BlockJob("save2", blocks, fresh)]))
        _wait_reported(worker, "save2", sending=True)
        assert worker.take_shard_report().reports[0].landed == fresh, "and it takes saves again"
        worker.close()
    finally:
        os.kill(master, signal.SIGCONT)
        pool_down(tmp_path / "stopped")


@pytest.mark.integration
def test_a_killed_master_started_again_is_asked_again_and_answers(tmp_path, monkeypatch, runtime_dir,
                                                                  connector_defaults):
    """A dead master fails lookups (counted, at once while the client's breaker is open); a new master on the same address
    is asked again once a backoff ends and answers (it knows no key: a miss, which is an answer)."""
    pool = pool_up("mooncake", tmp_path / "reborn", 64 << 20, **POOL_TIMERS)
    master = pool.pids[0]
    argv = Path(f"/proc/{master}/cmdline").read_text().split("\0")[:-1]
    again = None
    try:
        hashes, _ = _pooled(pool, monkeypatch, 13)
        worker = _store_worker(pool, monkeypatch, _big_caches(), role="kv_both")
        assert worker.lookup(hashes).hit_blocks == BIG_BLOCKS
        os.kill(master, signal.SIGKILL)
        assert not worker.lookup(hashes).answered
        refused = worker.lookup(hashes)
        assert not refused.answered and "breaker is open" in refused.error
        again = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        reply = _wait_answered(worker, hashes)
        assert reply.hit_blocks == 0, "a new master knows no key"
        stats = worker.get_stats().data
        assert stats["lookup_failures"] >= 2 and stats["lookup_refusals"] >= 1
        worker.close()
    finally:
        if again is not None:
            again.kill()
            again.wait()
        pool_down(tmp_path / "reborn")


@pytest.mark.integration
def test_a_worker_reports_each_saved_block_landed_whether_it_wrote_it_or_found_it_pooled(pool, monkeypatch):
    """What the scheduler side's KV events are decided from (connectors.store.events): per block, this worker's
    shard is in the pool, written now or by an earlier save."""
    src = _big_caches()
    worker = _store_worker(pool, monkeypatch, src, events=True, **_fixed(10_000))
    hashes = tuple(block_hashes([99] * 16 * BIG_BLOCKS, 16))
    assert worker.take_shard_report() is None, "nothing saved, nothing to report"
    worker.wait_for_save(StoreMetadata(saves=[BlockJob("first", (1,), hashes[1:2])]))
    _wait_reported(worker, "first", sending=True)
    worker.wait_for_save(StoreMetadata(saves=[BlockJob("all", tuple(range(BIG_BLOCKS)), hashes)]))
    _wait_reported(worker, "all", sending=True)
    stats = worker.get_stats().data
    assert (stats["saved_blocks"], stats["save_skipped_blocks"]) == (BIG_BLOCKS, 1)
    (report,) = worker.take_shard_report().reports
    assert (report.worker, report.landed, report.failed) == (0, hashes[1:2] + hashes, ())
    assert worker.take_shard_report() is None, "each outcome is reported once"
    worker.close()


@pytest.mark.integration
def test_a_save_whose_put_outlives_its_bound_pools_what_the_blocks_held(pool, monkeypatch):
    """vLLM reuses a request's blocks once its saves are reported, and a late put runs on: it reads the staging slot
    its blocks were copied into, so it never pools another request's KV under this prompt's keys."""
    src = _big_caches()
    original = [c.clone() for c in src]
    # Bound: the existence check (one small RPC) fits, the 16 MiB put does not; retried on a slow check.
    for attempt in range(5):
        worker = _store_worker(pool, monkeypatch, src, events=True, **_fixed(5))
        hashes = tuple(block_hashes([attempt + 1] * 16 * BIG_BLOCKS, 16))
        worker.wait_for_save(StoreMetadata(saves=[BlockJob("s", tuple(range(BIG_BLOCKS)), hashes)]))
        _wait_reported(worker, "s", sending=True)
        for c in src:
            c.zero_()  # what the next request would do to the freed blocks
        stats = worker.get_stats().data
        (report,) = worker.take_shard_report().reports
        assert (report.landed, report.failed) == ((), hashes), "a put that missed its bound never counts as landed"
        keys = worker._shard.keys(hashes)
        worker.close()
        for c, o in zip(src, original):
            c.copy_(o)
        if stats.get("save_failures") != BIG_BLOCKS or stats.get("saved_blocks"):
            continue  # the existence check itself ran late: nothing was put
        reader = open_backend(pool.store_config, call_timeout_s=BOUND_S)
        if reader.exists(keys) != [Status.OK] * BIG_BLOCKS:
            reader.close()
            continue
        dst = _big_caches(fill=0.0)
        pages = _register(reader, dst)
        assert reader.get(keys, *_objects(pages, range(BIG_BLOCKS))) == [Status.OK] * BIG_BLOCKS
        reader.close()
        assert all(torch.equal(d, o) for d, o in zip(dst, original)), "the late put read reused blocks"
        return
    pytest.fail("no save ran late in 5 attempts: the 16 MiB put returned within 5 ms")


@pytest.mark.integration
def test_pool_cli_up_prints_the_connector_config_and_down_stops_it(tmp_path):
    env = {**os.environ, **POOL_ENV}
    kvpp = [sys.executable, "-m", "deploy.cli.main", "pool"]
    up = subprocess.run([*kvpp, "up", "--backend", "mooncake", "--segment-size", "32MB", "--json",
                         "--state-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stderr
    out = json.loads(up.stdout)
    extra = out["kv_connector_extra_config"]
    assert extra["backend"] == "mooncake" and extra["mooncake"]["master_server_address"].startswith("127.0.0.1:")
    assert isinstance(extra["lookup_rpc_port"], int) and len(out["pids"]) == 2
    b = open_backend(parse_store_settings(extra), call_timeout_s=BOUND_S)
    assert b.exists(["anything"]) == [Status.MISSING]
    b.close()
    again = subprocess.run([*kvpp, "up", "--backend", "mooncake", "--state-dir", str(tmp_path)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "already running" in again.stderr
    down = subprocess.run([*kvpp, "down", "--state-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    for pid in out["pids"]:  # exited: gone, or a zombie until its new parent (init) reaps it
        assert not running(pid)


@pytest.mark.unit
def test_the_mooncake_config_file_is_read_as_the_same_struct(tmp_path, monkeypatch):
    from connectors.store.backends import BackendError
    from connectors.store.backends.mooncake import resolve_settings
    from connectors.store.backends.settings import MooncakeSettings

    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    good = tmp_path / "mooncake.json"
    good.write_text(json.dumps({"master_server_address": "10.0.0.9:50051", "protocol": "rdma"}))
    resolved = resolve_settings(MooncakeSettings(config_path=str(good), protocol="tcp"))
    # explicit settings win over the file, which wins over the defaults
    assert (resolved.master_server_address, resolved.protocol, resolved.local_buffer_size) == \
        ("10.0.0.9:50051", "tcp", 16 << 20)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"master_server_address": "10.0.0.9:50051", "protcol": "tcp", "local_buffer_size": -1}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(bad))
    with pytest.raises(BackendError) as err:
        resolve_settings(MooncakeSettings())
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{bad} (MOONCAKE_CONFIG_PATH") for line in lines)
    assert "kv_connector_extra_config.mooncake.protcol: unknown option; did you mean protocol?" in lines[0]
    assert "kv_connector_extra_config.mooncake.local_buffer_size: Expected `int` >= 0" in lines[1]
