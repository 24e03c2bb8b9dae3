"""AscendStoreConnector's scheduler side: save planning, tenant keys and failed loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from connectors.store.settings import parse_store_settings
from connectors.store.keys import block_hashes
from tests.helpers.store_config import BASE

pytestmark = pytest.mark.unit


def _scheduler(role="kv_producer"):
    from connectors.store.scheduler import StoreScheduler

    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16),
        kv_transfer_config=SimpleNamespace(kv_role=role),
        parallel_config=SimpleNamespace(data_parallel_rank=0),
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

    from connectors.store.scheduler import StoreScheduler

    class _Client:
        calls = 0

        def hit_blocks(self, hashes, request_id=""):
            self.calls += 1
            return 2, ""

    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=16),
                                  kv_transfer_config=SimpleNamespace(kv_role="kv_both"),
                                  parallel_config=SimpleNamespace(data_parallel_rank=0))
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
