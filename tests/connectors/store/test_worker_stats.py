"""The worker's stats file: the cumulative counters, written once per finished job or lookup (not once per
counter), and only when the job counted something; and what a lookup answers and counts."""

import json
from types import SimpleNamespace

import pytest

from connectors.store.settings import parse_store_settings
from connectors.store.metadata import BlockJob
from connectors.store.transfer import SaveResult
from connectors.store.worker import _Load
from connectors.store.backends import Status

pytestmark = pytest.mark.unit


@pytest.fixture
def worker(tmp_path, monkeypatch):
    import vllm.distributed.parallel_state as parallel_state

    from connectors.store import worker as worker_module

    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0))
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_world_group", lambda: SimpleNamespace(rank_in_group=1))
    cfg = parse_store_settings({"backend": "mooncake", "lookup_rpc_port": 6000, "stats_file": str(tmp_path / "stats")})
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role="kv_both"),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_rank=0),
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=4), use_mla=True),
        kv_events_config=None,
    )
    w = worker_module.StoreWorker(vllm_config, cfg)
    w._pages = SimpleNamespace(object_bytes=100)
    w._io = object()
    writes = []
    replace = worker_module.os.replace
    monkeypatch.setattr(worker_module.os, "replace", lambda src, dst: writes.append(dst) or replace(src, dst))
    return w, writes, tmp_path / "stats.pp0.tp1.json"


def _counted(path) -> dict[str, int]:
    return {k: v for k, v in json.loads(path.read_text()).items() if v}


def test_one_write_per_job_with_every_counter_of_the_job(worker):
    w, writes, path = worker
    w._finish_save(BlockJob("a", (1, 2, 3), ("x", "y", "z")), SaveResult(saved=2, skipped=1, failed=0))
    assert writes == [str(path)]
    assert _counted(path) == {"saved_blocks": 2, "saved_bytes": 200, "save_skipped_blocks": 1}
    with w._lock:
        w._in_flight += 1
        w._finish_load(_Load(BlockJob("b", (4, 5), ("x", "q")), None, report=True), [Status.OK, Status.WRONG_SIZE])
    assert len(writes) == 2
    assert _counted(path) == {"saved_blocks": 2, "saved_bytes": 200, "save_skipped_blocks": 1,
                                            "loaded_blocks": 1, "loaded_bytes": 100, "load_failures": 1,
                                            "load_wrong_size": 1}


def test_a_job_that_counted_nothing_leaves_the_file_alone(worker):
    w, writes, path = worker
    w._finish_save(BlockJob("a", (), ()), SaveResult(saved=0, skipped=0, failed=0))
    assert writes == [] and not path.exists()


class _Pool:
    """exists() as the test sets it."""

    def __init__(self, answer):
        self.answer = answer

    def exists(self, keys):
        return self.answer(keys)

    def breaker_opens(self):
        return 0


def _lookup(w, answer):
    from connectors.store.keys import ShardKey, block_hashes

    w._backend, w._all_shards = _Pool(answer), [ShardKey("fp", 0, 0), ShardKey("fp", 0, 1)]
    return w.lookup(block_hashes(list(range(64)), 16))


def test_a_lookup_the_pool_answered_counts_its_hit(worker):
    w, _, path = worker
    reply = _lookup(w, lambda keys: [Status.OK if i % 4 < 2 else Status.MISSING for i in range(len(keys))])
    assert reply.answered and reply.hit_blocks == 2
    assert _counted(path) == {"lookups": 1, "lookup_hit_blocks": 2, "lookup_hit_tokens": 32}


@pytest.mark.parametrize("status, refusals", [(Status.FAILED, 0), (Status.TIMEOUT, 0), (Status.REFUSED, 1)])
def test_a_lookup_the_pool_did_not_answer_is_a_counted_failure_not_zero_hits(worker, status, refusals):
    """Issue 35: `hit or 0` once made this an answer of 0 blocks, which announced the prefix's pooled blocks
    removed."""
    w, _, path = worker
    reply = _lookup(w, lambda keys: [status] * len(keys))
    assert not reply.answered and reply.counted and reply.hit_blocks == 0
    assert reply.error.startswith("the pool did not answer")
    assert _counted(path) == {"lookups": 1, "lookup_failures": 1, **({"lookup_refusals": 1} if refusals else {})}
