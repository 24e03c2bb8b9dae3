"""The KV pool (AscendStoreConnector on a real Mooncake store) under KVPP with pipeline parallelism:
TP2 x PP2, the tiny model split 7 + 9. Every stage's owners store their own shard of each block, and a
block hits only when every stage's shards are there.

Two engines run one after the other: the first serves two prompts and saves them (its answers are the
reference); between them one stage-1 shard of the second prompt's first block is removed; the fresh
engine then loads the first prompt from the pool (all four shards per block) and must recompute the
second from scratch (a miss), with the reference tokens both times.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

from connectors.store.backends import Status, open_backend
from connectors.store.keys import CacheLayout, block_hashes
from connectors.store.shards import StageLayers, shard_keys, stage_shards
from deploy.services.pool import pool_down, pool_up
from deploy.services.processes import run_in_group

pytestmark = pytest.mark.engine

SCRIPT = REPO / "tests" / "helpers" / "pool_engine.py"
SPLIT = (7, 9)
BLOCK = 16
PAGE_BYTES = BLOCK * 576 * 4
PROMPT_TOKENS = 120  # 7 whole blocks + 8 tokens
LOGPROB_TOL = 2e-5  # loaded KV vs one whole-prompt forward: same tokens, last-bit logprob differences
POOL_ENV = {"MC_LOG_LEVEL": "ERROR", "MC_RPC_TIMEOUT_MS": "2000", "MC_STORE_CLIENT_SETUP_RETRIES": "1"}


def _stage_keys(model: str):
    """Per stage, the two owners' shard keys: stage 0 owns 0-3 | 4-6, stage 1 owns 7-11 | 12-15."""
    layout = CacheLayout(model, "float32", BLOCK, PAGE_BYTES)
    stages, start = [], 0
    for pp_rank, count in enumerate(SPLIT):
        stage = StageLayers(pp_rank, tuple(range(start, start + count)))
        stages.append(shard_keys(layout, stage_shards(stage, 2, kvpp=True, replicated=True)))
        start += count
    return stages


@pytest.fixture(scope="module")
def pooled(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pool-pp")
    rng = random.Random(11)
    vocab = json.loads(Path(tiny_model, "config.json").read_text())["vocab_size"]
    prompts = {name: [rng.randrange(5, vocab) for _ in range(PROMPT_TOKENS)] for name in ("first", "second")}
    os.environ.update(POOL_ENV)
    pool = pool_up("mooncake", tmp / "pool", 128 << 20, lease_ttl_ms=500, client_ttl_s=2)

    def engine(tag: str) -> dict:
        extra = {**pool.kv_connector_extra_config, "load_async": True, "lookup_timeout_ms": 5000,
                 "backend_timeout_ms": 4000, "stats_file": str(tmp / f"stats-{tag}")}
        cfg = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": extra}
        actions = tmp / f"{tag}.json"
        actions.write_text(json.dumps([["gen", name, ids] for name, ids in prompts.items()]))
        env = {**os.environ, **POOL_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1|0|1",
               "VLLM_PP_LAYER_PARTITION": ",".join(map(str, SPLIT))}
        cmd = [sys.executable, str(SCRIPT), "--model", tiny_model, "--tp", "2", "--pp", "2", "--kvpp",
               "--actions", str(actions), "--kv-transfer-config", json.dumps(cfg)]
        proc = run_in_group(cmd, timeout=900, env=env)
        (tmp / f"{tag}.log").write_text(proc.stdout + proc.stderr)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line.removeprefix("RESULT "))
        raise AssertionError(f"engine run {tag} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")

    try:
        saved = engine("save")
        backend = open_backend(pool.store_config, call_timeout_s=4)
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


def _stats(tmp: Path, tag: str, pp: int, tp: int) -> dict:
    return json.loads((tmp / f"stats-{tag}.pp{pp}.tp{tp}.json").read_text())


def test_every_stage_saves_its_owner_shards(pooled):
    assert pooled["present"] == {name: [Status.OK] * (4 * 7) for name in ("first", "second")}
    owned = {(0, 0): 4, (0, 1): 3, (1, 0): 5, (1, 1): 4}
    for (pp, tp), layers in owned.items():
        s = _stats(pooled["tmp"], "save", pp, tp)
        assert s["saved_blocks"] == 2 * 7 and s["saved_bytes"] == 2 * 7 * layers * PAGE_BYTES, (pp, tp)


def test_a_hit_loads_every_stages_shards_and_gives_the_reference_tokens(pooled):
    saved, fresh = pooled["saved"], pooled["fresh"]
    assert fresh["first"]["num_cached_tokens"] == 7 * BLOCK
    for pp, tp in ((0, 0), (0, 1), (1, 0), (1, 1)):
        assert _stats(pooled["tmp"], "fresh", pp, tp)["loaded_blocks"] == 7, (pp, tp)
    assert fresh["first"]["tokens"] == saved["first"]["tokens"]
    assert max(abs(a - b) for a, b in zip(fresh["first"]["logprobs"], saved["first"]["logprobs"])) <= LOGPROB_TOL


def test_one_missing_stage_shard_makes_the_block_a_miss(pooled):
    saved, fresh = pooled["saved"], pooled["fresh"]
    assert fresh["second"]["num_cached_tokens"] == 0
    assert fresh["second"]["tokens"] == saved["second"]["tokens"]
    assert max(abs(a - b) for a, b in zip(fresh["second"]["logprobs"], saved["second"]["logprobs"])) <= LOGPROB_TOL
