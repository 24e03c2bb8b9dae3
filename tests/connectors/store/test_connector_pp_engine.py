"""The KV pool (AscendStoreConnector on a real Mooncake store) under KVPP with pipeline parallelism:
TP2 x PP2, the tiny model split 7 + 9. Every stage's owners store their own shard of each block, and a
block hits only when every stage's shards are there.

Two engines run one after the other: the first serves two prompts and saves them (its answers are the
reference); between them one stage-1 shard of the second prompt's first block is removed; the fresh
engine then loads the first prompt from the pool (all four shards per block) and must recompute the
second from scratch (a miss), with the reference tokens both times.
"""

from __future__ import annotations

import os

import pytest

from connectors.store.backends import Status
from connectors.store.keys import CacheLayout, block_hashes
from connectors.store.shards import StageLayers, shard_keys, stage_shards
from deploy.services.pool import pool_down, pool_up
from testbed.prompts import token_draws
from tests.helpers.pool_runs import BLOCK, PAGE_BYTES, POOL_ENV, POOL_TIMERS, assert_same_output, run_pool_engine, \
    store_client, store_config, worker_stats

pytestmark = pytest.mark.engine

SPLIT = (7, 9)
PROMPT_TOKENS = 120  # 7 whole blocks + 8 tokens


def _stage_keys(model: str):
    """Per stage, the two owners' shard keys: stage 0 owns 0-3 | 4-6, stage 1 owns 7-11 | 12-15."""
    layout = CacheLayout(model, "float32", BLOCK, PAGE_BYTES)
    stages, start = [], 0
    for pp_rank, count in enumerate(SPLIT):
        stage = StageLayers(pp_rank, tuple(range(start, start + count)))
        stages.append(shard_keys(layout, stage_shards(stage, 2, kvpp=True)))
        start += count
    return stages


@pytest.fixture(scope="module")
def pooled(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool-pp")
    draw = token_draws(tiny_model, 11)
    prompts = {name: draw(PROMPT_TOKENS) for name in ("first", "second")}
    os.environ.update(POOL_ENV)
    pool = pool_up("mooncake", tmp / "pool", 128 << 20, **POOL_TIMERS)

    def engine(tag: str) -> dict:
        actions = [["gen", name, ids] for name, ids in prompts.items()]
        cfg = store_config(pool, tmp, tag, load_async=True)
        return run_pool_engine(tiny_model, tmp, tag, actions, tp=2, pp=2, kvpp=True, staging=2, kv_transfer_config=cfg,
                               env={"VLLM_PP_LAYER_PARTITION": ",".join(map(str, SPLIT))})

    try:
        saved = engine("save")
        backend = store_client(pool.store_config)
        stages = _stage_keys(tiny_model)
        hashes = {name: block_hashes(ids, BLOCK) for name, ids in prompts.items()}
        present = {name: backend.exists([k.key(h) for shards in stages for k in shards for h in hs])
                   for name, hs in hashes.items()}
        assert backend.remove([stages[1][1].key(hashes["second"][0])]) == [Status.OK]
        backend.close()
        fresh = engine("fresh")
        yield {"tmp": tmp, "saved": saved, "fresh": fresh, "present": present}
    finally:
        pool_down(tmp / "pool")


def test_every_stage_saves_its_owner_shards(pooled):
    assert pooled["present"] == {name: [Status.OK] * (4 * 7) for name in ("first", "second")}
    owned = {(0, 0): 4, (0, 1): 3, (1, 0): 5, (1, 1): 4}
    for (pp, tp), layers in owned.items():
        s = worker_stats(pooled["tmp"], "save", pp, tp)
        assert s["saved_blocks"] == 2 * 7 and s["saved_bytes"] == 2 * 7 * layers * PAGE_BYTES, (pp, tp)


def test_a_hit_loads_every_stages_shards_and_gives_the_reference_tokens(pooled):
    saved, fresh = pooled["saved"], pooled["fresh"]
    assert fresh["first"]["num_cached_tokens"] == 7 * BLOCK
    for pp, tp in ((0, 0), (0, 1), (1, 0), (1, 1)):
        assert worker_stats(pooled["tmp"], "fresh", pp, tp)["loaded_blocks"] == 7, (pp, tp)
    assert_same_output(fresh["first"], saved["first"])


def test_one_missing_stage_shard_makes_the_block_a_miss(pooled):
    saved, fresh = pooled["saved"], pooled["fresh"]
    assert fresh["second"]["num_cached_tokens"] == 0
    assert_same_output(fresh["second"], saved["second"])
