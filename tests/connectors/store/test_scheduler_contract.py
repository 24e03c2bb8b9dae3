"""AscendStoreConnector under vLLM's own Scheduler (no engine, no workers; worker rank 0's lookup
server answers from what the first node saved): whole prompt blocks are saved and held until the
workers report the saves, a second node finds them through the lookup, loads and resumes, and a
preempted request with saves in flight makes the workers drain them. The same tests run against every
supported vLLM (`make test` runs them again on vLLM 0.33.0)."""

from __future__ import annotations

import pytest

from connectors.store.lookup import LookupChannel, LookupReply, LookupServer
from tests.helpers import vllm_scheduler as vs
from tests.helpers.store_config import BASE

pytestmark = pytest.mark.unit

PROMPT = list(range(1, 51))  # 50 tokens: three whole blocks and a partial one


@pytest.fixture
def pool(runtime_dir, free_port):
    """The pooled block hashes, as worker rank 0's lookup server counts them."""
    pooled: set[str] = set()

    def leading_hits(hashes):
        return LookupReply(next((i for i, h in enumerate(hashes) if h not in pooled), len(hashes)))

    server = LookupServer(LookupChannel(free_port, 0), leading_hits)
    yield free_port, pooled
    server.close()


def _scheduler(model, port, num_blocks=64, **transfer):
    return vs.scheduler(model, {
        "kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**BASE, "lookup_rpc_port": port, "load_async": True}, **transfer},
        num_blocks=num_blocks)


def _saved(model, port, pooled):
    """The first node prefills PROMPT; its saves land in the pool once the workers report them."""
    node = _scheduler(model, port)
    total = vs.free_blocks(node)
    node.add_request(vs.request("r", PROMPT))
    out, _ = vs.step(node)
    saves = out.kv_connector_metadata.saves
    assert [list(job.block_ids) for job in saves] == [vs.block_ids(node, "r")[:3]], "whole blocks only"
    vs.step(node)
    assert vs.free_blocks(node) < total, "held while the saves run"
    vs.step(node, finished_sending={"r"})
    assert vs.free_blocks(node) == total
    pooled.update(h for job in saves for h in job.block_hashes)


def _loading(model, pool):
    """A second node asked for PROMPT after the first saved it: its scheduler and first step."""
    port, pooled = pool
    _saved(model, port, pooled)
    other = _scheduler(model, port)
    other.add_request(vs.request("r2", PROMPT, max_tokens=2))
    out, _ = vs.step(other)
    assert out.num_scheduled_tokens == {}, "the request waits for its pool load"
    return other, out


def test_saved_blocks_are_found_loaded_and_resumed_on_another_node(tiny_model, pool):
    other, out = _loading(tiny_model, pool)
    (load,) = out.kv_connector_metadata.loads
    assert list(load.block_ids) == vs.block_ids(other, "r2")[:3] and len(load.block_hashes) == 3
    vs.step(other, finished_recving={"r2"})
    out, _ = vs.step(other)
    assert out.num_scheduled_tokens == {"r2": len(PROMPT) - 48}, "resumed after the three loaded blocks"


def test_a_failed_pool_load_is_recomputed_and_not_looked_up_again(tiny_model, pool):
    other, out = _loading(tiny_model, pool)
    first = out.kv_connector_metadata.loads[0].block_ids[0]
    vs.step(other, finished_recving={"r2"}, invalid_block_ids={first})
    out, _ = vs.step(other)
    assert out.num_scheduled_tokens == {"r2": len(PROMPT)} and out.kv_connector_metadata.loads == []


def test_preempting_a_request_with_saves_in_flight_drains_them(tiny_model, pool):
    port, _ = pool
    node = _scheduler(tiny_model, port, num_blocks=7)  # 6 usable: two 50-token prompts cannot both decode
    node.add_request(vs.request("a", PROMPT, max_tokens=60))
    node.add_request(vs.request("b", [t + 100 for t in PROMPT], max_tokens=60))
    drained = False
    for _ in range(80):
        out, _ = vs.step(node)
        if out.preempted_req_ids:
            drained = out.kv_connector_metadata.drain_saves
            break
    assert out.preempted_req_ids and drained
