"""The pool with the tiny GQA model (Llama, one KV head, fp32 on vLLM's CPU attention, blocks of 32): a TP2 KVPP
engine (staging) saves two prompts into a real Mooncake pool and exits; a fresh TP2 KVPP engine (zero-copy) serves
them again from the pool. Both ranks hold the one KV head and KVPP splits the layers between them, so a block is two
objects keyed `h0/o0` and `h0/o1` (connectors.store.keys). Between the engines one owner shard of one block of the
second prompt is removed: that prompt's hit ends there. The fresh engine answers both like the save engine, which
computed them with the pool empty. Runs on hosts without AMX.
"""

from __future__ import annotations

import pytest

from connectors.store.backends import Status
from connectors.store.keys import CacheLayout, block_hashes
from connectors.store.shards import StageLayers, all_shards, count_pooled, shard_keys
from deploy.services.pool import pool_down, pool_up
from deploy.services.processes import GQA
from testbed.prompts import token_draws
from tests.helpers.pool_runs import POOL_TIMERS, assert_same_output, run_pool_engine, store_client, store_config, \
    worker_stats

pytestmark = pytest.mark.engine

LAYERS = 8
BLOCK = GQA.block_size
PAGE_BYTES = BLOCK * 2 * 32 * 4  # 32 tokens x K and V of the one KV head (32) x fp32
KV_BYTES = 16 << 20


@pytest.fixture(scope="module")
def pooled(tiny_gqa_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool-gqa")
    pool = pool_up("mooncake", tmp / "pool", 64 << 20, **POOL_TIMERS)
    draw = token_draws(tiny_gqa_model, 11)
    prompts = {"prefix_plus": draw(230), "torn": draw(200)}  # 7 and 6 whole blocks

    def run(tag: str, staging: int, actions: list) -> dict:
        return run_pool_engine(tiny_gqa_model, tmp, tag, actions, kernel=GQA.kernel.name, tp=2, kvpp=True,
                               staging=staging, kv_bytes=KV_BYTES, max_model_len=512,
                               kv_transfer_config=store_config(pool, tmp, tag, load_async=True))

    try:
        saved = run("save", 2, [["batch", [[n, ids] for n, ids in prompts.items()]], ["settle", "settled"]])
        backend = store_client(pool.store_config)
        layout = CacheLayout(tiny_gqa_model, "float32", BLOCK, PAGE_BYTES)
        shards = shard_keys(layout, all_shards([StageLayers(0, tuple(range(LAYERS)))], 2, kvpp=True, heads=((0,),)))
        counts = {n: count_pooled(backend, shards, block_hashes(ids, BLOCK)) for n, ids in prompts.items()}
        removed = backend.remove([shards[1].key(block_hashes(prompts["torn"], BLOCK)[2])])
        backend.close()
        fresh = run("fresh", 0, [["gen", n, ids] for n, ids in prompts.items()])
        yield {"tmp": tmp, "saved": saved, "fresh": fresh, "shards": shards, "counts": counts, "removed": removed}
    finally:
        pool_down(tmp / "pool")


def test_each_rank_saves_its_owner_shard_under_the_head_it_holds(pooled):
    assert [s.key("0" * 64).split("/")[3:5] for s in pooled["shards"]] == [["h0", "o0"], ["h0", "o1"]]
    assert pooled["counts"] == {"prefix_plus": 7, "torn": 6}, "every whole block of both prompts, both owners' shards"
    assert pooled["removed"] == [Status.OK]
    for rank in (0, 1):
        s = worker_stats(pooled["tmp"], "save", 0, rank)
        assert (s["saved_blocks"], s.get("save_failures", 0)) == (13, 0), s
        assert s["saved_bytes"] == 13 * LAYERS // 2 * PAGE_BYTES, "each rank its 4 owned layers"


def test_a_fresh_engine_loads_the_pooled_blocks_and_answers_like_the_engine_that_computed_them(pooled):
    saved, fresh = pooled["saved"], pooled["fresh"]
    assert fresh["prefix_plus"]["num_cached_tokens"] == 7 * BLOCK
    # torn: rank 1's shard of block 2 is gone, so only blocks 0-1 are a hit.
    assert fresh["torn"]["num_cached_tokens"] == 2 * BLOCK
    for rank in (0, 1):
        s = worker_stats(pooled["tmp"], "fresh", 0, rank)
        assert (s["loaded_blocks"], s.get("load_failures", 0)) == (7 + 2, 0), s
    for name in ("prefix_plus", "torn"):
        assert_same_output(fresh[name], saved[name])
