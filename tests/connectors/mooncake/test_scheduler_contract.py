"""MooncakeConnectorV2 under vLLM's own Scheduler (no engine, no workers): a producer holds a finished
request's blocks until the decode reports its pull, a consumer maps the handle's remote blocks onto
its own, waits for the pull and resumes, and a failed block under `recompute` is computed again.
The same tests run against every supported vLLM (`make test` runs them again on vLLM 0.33.0)."""

from __future__ import annotations

import pytest

from tests.helpers import vllm_scheduler as vs

pytestmark = pytest.mark.unit

PROMPT = list(range(1, 41))  # 40 tokens: two whole blocks and a partial one


def _scheduler(model, role, port, **transfer):
    return vs.scheduler(model, {
        "kv_connector": "MooncakeConnectorV2", "kv_role": role, "kv_port": port, "engine_id": role,
        "kv_connector_extra_config": {"handshake_timeout_s": 0.2, "hold_timeout_s": 30}, **transfer})


def _prefilled(model, port):
    """A producer that prefilled PROMPT for a decode: its scheduler, the handle, the blocks held."""
    producer = _scheduler(model, "kv_producer", port)
    producer.add_request(vs.request("r", PROMPT, kv_transfer_params={"do_remote_decode": True}))
    out, engine = vs.step(producer)
    held = vs.block_ids(producer, "r")
    (finished,) = engine[0].outputs
    return producer, finished.kv_transfer_params, held


def test_producer_holds_the_blocks_until_the_decode_has_pulled(tiny_model, free_port):
    producer, params, held = _prefilled(tiny_model, free_port)
    total = vs.free_blocks(producer) + len(held)
    assert params["remote_block_ids"] == held and params["remote_num_tokens"] == len(PROMPT) and len(held) == 3
    out, _ = vs.step(producer)
    assert out.kv_connector_metadata.holds == {"r": 30.0}, "the workers learn of the hold and its timeout"
    for _ in range(3):  # finished (length-capped) but held: the blocks stay allocated
        vs.step(producer)
        assert vs.free_blocks(producer) == total - 3
    vs.step(producer, finished_sending={"r"})  # the workers saw the decode's "done"
    assert vs.free_blocks(producer) == total


def test_producer_frees_an_aborted_request_at_once(tiny_model, free_port):
    from vllm.v1.request import RequestStatus

    producer = _scheduler(tiny_model, "kv_producer", free_port)
    total = vs.free_blocks(producer)
    producer.add_request(vs.request("r", PROMPT + PROMPT, kv_transfer_params={"do_remote_decode": True}))
    producer.schedule()
    assert vs.free_blocks(producer) < total
    producer.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert vs.free_blocks(producer) == total and "r" not in producer.requests


def test_consumer_maps_the_remote_blocks_waits_for_the_pull_and_resumes(tiny_model, free_port):
    _, params, held = _prefilled(tiny_model, free_port)
    consumer = _scheduler(tiny_model, "kv_consumer", free_port + 10)
    consumer.add_request(vs.request("r", PROMPT, max_tokens=3, kv_transfer_params=params))
    keeper = consumer.connector._scheduler.leases
    assert "r" in keeper, "the lease is claimed on arrival"
    out, _ = vs.step(consumer)
    assert out.num_scheduled_tokens == {}, "nothing runs while the KV is pulled"
    (load,) = out.kv_connector_metadata.loads
    local = vs.block_ids(consumer, "r")
    assert (list(load.local_block_ids), list(load.remote_block_ids)) == (local, held)
    assert "r" in keeper, "renewed while the pull runs"
    vs.step(consumer, finished_recving={"r"})
    assert "r" not in keeper
    out, _ = vs.step(consumer)
    request = consumer.requests["r"]
    assert out.num_scheduled_tokens["r"] == 1, "only the last prompt token is computed locally"
    assert vs.block_ids(consumer, "r")[:3] == local and request.num_output_tokens == 1


def test_a_failed_block_under_recompute_is_computed_again(tiny_model, free_port):
    _, params, _ = _prefilled(tiny_model, free_port)
    consumer = _scheduler(tiny_model, "kv_consumer", free_port + 10, kv_load_failure_policy="recompute")
    consumer.add_request(vs.request("r", PROMPT, max_tokens=2, kv_transfer_params=params))
    out, _ = vs.step(consumer)
    local = list(out.kv_connector_metadata.loads[0].local_block_ids)
    vs.step(consumer, finished_recving={"r"}, invalid_block_ids={local[1]})  # the second block failed
    out, _ = vs.step(consumer)
    assert out.num_scheduled_tokens["r"] == len(PROMPT) - 16, "recomputed from the last good block"
    assert "r" not in consumer.connector._scheduler.leases
