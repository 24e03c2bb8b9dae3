"""AscendStoreConnector's scheduler side: save planning, tenant keys and failed loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from connectors.store.settings import parse_store_settings
from connectors.store.keys import block_hashes
from tests.helpers.store_config import BASE

pytestmark = pytest.mark.unit


def _scheduler(role="kv_producer", events=False, workers=1):
    from vllm.config.kv_events import KVEventsConfig

    from connectors.store.scheduler import StoreScheduler

    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16),
        kv_transfer_config=SimpleNamespace(kv_role=role),
        parallel_config=SimpleNamespace(data_parallel_rank=0, world_size=workers),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True) if events else None,
    )
    return StoreScheduler(vllm_config, parse_store_settings(BASE))


def _output(new=(), cached=None, scheduled=None, preempted=None):
    from vllm.v1.core.sched.output import CachedRequestData

    scheduled = scheduled or {}
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
                           num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                           preempted_req_ids=preempted)


def _admit(sched, req_id, tokens, block_ids, **extras):
    """What vLLM does with a waiting request before it first schedules it: ask the connector."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request(req_id, tokens, SamplingParams(max_tokens=1), None, **extras)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    return SimpleNamespace(req_id=req_id, prompt_token_ids=tokens, block_ids=(block_ids,), num_computed_tokens=0)


def test_whole_prompt_blocks_are_saved_once_as_they_complete():
    from vllm.v1.core.sched.output import CachedRequestData

    sched = _scheduler()
    prompt = list(range(50))  # 3 whole blocks + 2 tokens
    new = _admit(sched, "r", prompt, [7, 8])
    meta = sched.build_connector_meta(_output([new], scheduled={"r": 20}))  # chunk 1: 20 tokens
    assert [(j.block_ids, j.block_hashes) for j in meta.saves] == [((7,), tuple(block_hashes(prompt, 16)[:1]))]
    cached = CachedRequestData(req_ids=["r"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
                               new_block_ids=[([9, 10],)], num_computed_tokens=[20], num_output_tokens=[0])
    meta = sched.build_connector_meta(_output(cached=cached, scheduled={"r": 30}))
    assert [j.block_ids for j in meta.saves] == [(8, 9)], "the partial 4th block is never saved"
    assert sched.request_finished(SimpleNamespace(request_id="r"), [7, 8, 9, 10]) == (True, None)
    assert sched.request_finished(SimpleNamespace(request_id="other"), []) == (False, None)


def test_preempting_a_request_with_saves_in_flight_drains_them():
    sched = _scheduler()
    new = _admit(sched, "r", list(range(32)), [1, 2])
    assert sched.build_connector_meta(_output([new], scheduled={"r": 32})).drain_saves is False
    assert sched.build_connector_meta(_output(preempted={"r"})).drain_saves is True


def test_saves_are_keyed_by_the_tenant():
    sched = _scheduler()
    new = [_admit(sched, "a", list(range(32)), [1, 2], cache_salt="tenant-a"), _admit(sched, "p", list(range(32)), [3, 4])]
    saves = {j.req_id: j.block_hashes for j in sched.build_connector_meta(_output(new, scheduled={"a": 32, "p": 32})).saves}
    assert saves["p"] == tuple(block_hashes(list(range(32)), 16))
    assert not set(saves["a"]) & set(saves["p"]), "a salted prompt never writes the unsalted keys"


def test_saves_are_keyed_when_a_multiconnector_skips_the_lookup():
    """A MultiConnector stops asking children after one says "still looking up", but every child hears
    about the allocation: the salted keys are made there."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sched = _scheduler("kv_both")
    request = Request("a", list(range(32)), SamplingParams(max_tokens=1), None, cache_salt="tenant-a")
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    new = SimpleNamespace(req_id="a", prompt_token_ids=list(range(32)), block_ids=([1, 2],), num_computed_tokens=0)
    (job,) = sched.build_connector_meta(_output([new], scheduled={"a": 32})).saves
    assert job.block_ids == (1, 2) and not set(job.block_hashes) & set(block_hashes(list(range(32)), 16))
    sched.close()


def test_a_request_whose_load_failed_is_not_looked_up_again():
    from vllm.v1.outputs import KVConnectorOutput

    from connectors.store.lookup import LookupReply
    from connectors.store.scheduler import StoreScheduler

    class _Client:
        calls = 0

        def lookup(self, hashes, request_id="", timeout_s=None):
            self.calls += 1
            return LookupReply(2)

    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=16),
                                  kv_transfer_config=SimpleNamespace(kv_role="kv_both"),
                                  parallel_config=SimpleNamespace(data_parallel_rank=0, world_size=1),
                                  kv_events_config=None)
    sched = StoreScheduler(vllm_config, parse_store_settings({**BASE, "load_async": True}))
    sched._client.close()
    sched._client = client = _Client()
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request("r", list(range(40)), SamplingParams(max_tokens=1), None)
    assert sched.get_num_new_matched_tokens(request, 0) == (32, True)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7],)), 32)
    assert [j.block_ids for j in sched.build_connector_meta(_output()).loads] == [(5, 6)]
    sched.update_connector_output(KVConnectorOutput(finished_recving={"r"}, invalid_block_ids={6}))
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False), "vLLM retries it: recompute, no new lookup"
    assert client.calls == 1
    sched.request_finished(request, [])
    assert sched.get_num_new_matched_tokens(request, 0) == (32, True), "the failure is forgotten with the request"


def test_a_request_spends_at_most_its_pool_budget_on_lookups_and_its_load_gets_what_is_left():
    """Issue 41: a request's lookups and load share one budget (request_budget_ms, 4 s by default: lookup_timeout_ms
    + backend_timeout_ms). Each lookup waits at most what is left; once none is, the request is a miss without
    asking (counted once); a load is scheduled with what is left."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from connectors.store.lookup import LookupReply
    from tests.helpers.clock import Clock

    clock = Clock()

    class _Slow(_Answers):
        took: list[float] = []

        def lookup(self, hashes, request_id="", timeout_s=None):
            clock.now += self.took.pop(0)  # what the worker took to answer
            return super().lookup(hashes, request_id, timeout_s)

    sched = _scheduler("kv_both")
    sched._client.close()
    sched._client = client = _Slow()
    sched._clock = clock
    client.took = [1.5, 2.5, 1.0]
    client.reply = LookupReply(0, "the pool did not answer: the store did not answer within its bound", counted=True)
    stalled = Request("stalled", list(range(40)), SamplingParams(max_tokens=1), None)
    for _ in range(4):  # vLLM asks again each step it cannot admit the request
        assert sched.get_num_new_matched_tokens(stalled, 0) == (0, False)
    assert client.timeouts == [4.0, 2.5], "each lookup may wait what is left of the budget; then none is asked"
    assert sched.get_stats().data["lookup_over_budget"] == 1
    client.reply = LookupReply(2)
    hit = Request("hit", list(range(40)), SamplingParams(max_tokens=1), None)
    assert sched.get_num_new_matched_tokens(hit, 0) == (32, False)
    sched.update_state_after_alloc(hit, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7],)), 32)
    (load,) = sched.build_connector_meta(_output()).loads
    assert load.block_ids == (5, 6) and load.budget_s == pytest.approx(3.0), "the 1 s lookup spent, 3 s left"
    sched.request_finished(stalled, [])
    assert "stalled" not in sched._pool_spent


def _hashed_request(req_id, tokens, **extras):
    """A request as vLLM's engine core makes it with a connector: its block hashes made by vLLM's own hasher."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(16, hash_fn), **extras)


def test_saved_blocks_are_announced_in_vllms_terms_once_every_worker_reported_them():
    """TP2 (two workers): the events name the blocks by vLLM's own block hashes, with their tokens and cache_salt,
    and only once both workers' shards landed; the workers' reports arrive through vLLM's connector output."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.outputs import KVConnectorOutput

    from connectors.store.metadata import SavedShards, ShardReport

    sched = _scheduler(events=True, workers=2)
    tokens = list(range(40))  # two whole blocks
    request = _hashed_request("r", tokens, cache_salt="tenant-a")
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    new = SimpleNamespace(req_id="r", prompt_token_ids=tokens, block_ids=([3, 4, 5],), num_computed_tokens=0)
    (job,) = sched.build_connector_meta(_output([new], scheduled={"r": 40})).saves
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=SavedShards((ShardReport(1, job.block_hashes),))))
    assert list(sched.take_events()) == []
    both = SavedShards((ShardReport(0, job.block_hashes[:1]),)).aggregate(SavedShards((ShardReport(1, job.block_hashes),)))
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=both))
    (stored,) = sched.take_events()
    assert stored.block_hashes == [maybe_convert_block_hash(request.block_hashes[0])]
    assert (stored.parent_block_hash, stored.token_ids, stored.extra_keys) == (None, tokens[:16], [("tenant-a",)])
    with pytest.raises(TypeError, match="SavedShards"):
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=SimpleNamespace()))


class _Answers:
    """Worker rank 0's lookup channel, answering what the test sets."""

    def __init__(self):
        from connectors.store.lookup import LookupReply

        self.reply = LookupReply(0)
        self.timeouts: list[float | None] = []

    def lookup(self, hashes, request_id="", timeout_s=None):
        self.timeouts.append(timeout_s)
        return self.reply

    def close(self):
        pass


def _announced(sched, client, tokens):
    """A request whose whole prompt blocks were looked up (a miss), saved and announced stored: its vLLM hashes."""
    from vllm.v1.outputs import KVConnectorOutput

    from connectors.store.lookup import LookupReply
    from connectors.store.metadata import SavedShards, ShardReport

    request = _hashed_request("r", tokens)
    client.reply = LookupReply(0)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],)), 0)
    new = SimpleNamespace(req_id="r", prompt_token_ids=tokens, block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=0)
    (job,) = sched.build_connector_meta(_output([new], scheduled={"r": len(tokens)})).saves
    sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=SavedShards((ShardReport(0, job.block_hashes),))))
    assert len(list(sched.take_events())) == 4
    sched.request_finished(request, [])
    return _hashed_request("r2", tokens)


@pytest.fixture
def announced():
    """A scheduler with events on whose four-block prompt is announced stored, and that prompt asked again."""
    sched = _scheduler("kv_both", events=True)
    sched._client.close()
    sched._client = client = _Answers()
    again = _announced(sched, client, list(range(16 * 4 + 1)))  # four whole blocks and the token always computed
    return sched, client, again


def test_a_lookup_shorter_than_the_announced_prefix_announces_the_rest_removed(announced):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from connectors.store.lookup import LookupReply

    sched, client, again = announced
    client.reply = LookupReply(1)
    assert sched.get_num_new_matched_tokens(again, 0) == (16, False)
    (removed,) = sched.take_events()
    assert removed.block_hashes == [maybe_convert_block_hash(h) for h in again.block_hashes[1:4]]


@pytest.mark.parametrize("failure, counted_here", [
    ("the pool did not answer: the store did not answer within its bound", False),  # the master stalled
    ("the pool did not answer: the store failed", False),  # the master died
    ("the pool did not answer: not asked: the pool failed to answer a recent call (the breaker is open)", False),
    ("no lookup answer from worker rank 0 within 1000 ms", True),  # the channel: the worker never counted it
    ("lookup channel error: gone", True),
])
def test_a_lookup_the_pool_did_not_answer_is_a_counted_miss_that_removes_nothing(announced, failure, counted_here):
    """Issue 35: a failed or timed-out lookup once became an answer of 0 blocks, and a killed or slow master wiped
    every announced block of the prefix from every router's view. Now it is a miss that proves nothing, counted
    once: by the worker when the pool failed it there, by the scheduler when no answer came back."""
    from connectors.store.lookup import LookupReply

    sched, client, again = announced
    sched.get_stats()
    client.reply = LookupReply(0, failure, counted=not counted_here)
    assert sched.get_num_new_matched_tokens(again, 0) == (0, False)
    assert list(sched.take_events()) == [], "no BlockRemoved: the pool did not say it lost anything"
    stats = sched.get_stats()
    assert (stats.data["lookup_failures"] if stats else 0) == int(counted_here)
    client.reply = LookupReply(4)
    assert sched.get_num_new_matched_tokens(again, 0) == (64, False), "the blocks are still pooled"
    assert list(sched.take_events()) == [], "and still announced"
