"""Store shards and the hit rule: which objects a block is stored as, and when a prefix is a hit."""

from __future__ import annotations

import pytest

from connectors.store.backends.base import Status
from connectors.store.keys import CacheLayout, block_hashes
from connectors.store.shards import (PoolUnanswered, StageLayers, all_shards, count_pooled, hit_blocks, shard_keys,
                                     stage_shards)

pytestmark = pytest.mark.unit


def test_without_kvpp_an_mla_block_is_one_object_per_stage():
    stages = [StageLayers(0, tuple(range(8))), StageLayers(1, tuple(range(8, 16)), mtp_caches=1)]
    shards = all_shards(stages, 4, kvpp=False)
    assert [(s.pp_rank, s.owner) for s in shards] == [(0, 0), (1, 0)]
    assert shards[1].layers == tuple(range(8, 16)) + ("mtp0",)


def test_with_kvpp_each_owner_stores_its_layers_plus_mtp():
    shards = stage_shards(StageLayers(0, tuple(range(5)), mtp_caches=1), 2, kvpp=True)
    assert [(s.owner, s.layers) for s in shards] == [(0, (0, 1, 2, "mtp0")), (1, (3, 4, "mtp0"))]


def test_owners_without_layers_store_nothing():
    shards = stage_shards(StageLayers(0, (0, 1)), 4, kvpp=True)
    assert [(s.owner, s.layers) for s in shards] == [(0, (0,)), (1, (1,))]


def test_a_gqa_stage_stores_each_replica_group_s_kv_heads_apart():
    stage = StageLayers(0, tuple(range(4)), mtp_caches=1)
    # 2 KV heads over TP 4, KVPP: ranks 0-1 hold head 0, ranks 2-3 head 1; each group's owners split the layers.
    shards = stage_shards(stage, 2, kvpp=True, heads=((0,), (1,)))
    assert [(s.heads, s.owner, s.layers) for s in shards] == [
        ((0,), 0, (0, 1, "mtp0")), ((0,), 1, (2, 3, "mtp0")), ((1,), 0, (0, 1, "mtp0")), ((1,), 1, (2, 3, "mtp0"))]
    # Without KVPP one copy per distinct cache: per KV head where TP replicates them, per rank where it splits them.
    assert [(s.heads, s.owner) for s in stage_shards(stage, 2, kvpp=False, heads=((0,), (1,)))] == [((0,), 0), ((1,), 0)]
    assert [s.heads for s in stage_shards(stage, 1, kvpp=False, heads=((0, 1, 2, 3), (4, 5, 6, 7)))] == [
        (0, 1, 2, 3), (4, 5, 6, 7)]


def test_gqa_ranks_of_any_tp_holding_the_same_heads_share_a_block():
    from connectors.common.kv_caches import replica_heads
    from kvpp_core.topology import Topology

    stage = StageLayers(0, tuple(range(8)))
    def shards(tp, heads, kvpp=False):
        topology = Topology(tp=tp, kv_heads=heads)
        return stage_shards(stage, topology.group_size, kvpp=kvpp, heads=replica_heads(topology))

    assert replica_heads(Topology(tp=2, kv_heads=1)) == ((0,),)
    assert replica_heads(Topology(tp=8, kv_heads=4)) == ((0,), (1,), (2,), (3,))
    assert replica_heads(Topology(tp=2, kv_heads=8)) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert replica_heads(Topology(tp=4)) == (None,)
    assert shards(1, 1) == shards(2, 1) == shards(4, 1)  # the tiny model's one head, whatever the TP
    assert shards(4, 4) == shards(8, 4) and shards(2, 8) != shards(4, 8)
    assert shards(2, 1, kvpp=True) != shards(1, 1, kvpp=True)  # owner shards follow the group


def test_a_gqa_block_is_a_hit_only_with_every_owner_shard_of_every_head():
    layout = CacheLayout("m", "float32", 32, 8192)
    keys = shard_keys(layout, all_shards([StageLayers(0, tuple(range(4)))], 2, kvpp=True, heads=((0,), (1,))))
    assert len(keys) == 4 and len({k.key("0" * 64) for k in keys}) == 4
    hashes = block_hashes(list(range(96)), 32)
    stored = {k.key(h) for k in keys for h in hashes}
    assert count_pooled(_DictBackend(stored), keys, hashes) == 3
    stored.discard(keys[2].key(hashes[1]))  # head 1, owner 0, block 1 evicted
    assert count_pooled(_DictBackend(stored), keys, hashes) == 1


def test_hit_needs_every_shard_of_every_stage():
    assert hit_blocks({"a": [True, True, True], "b": [True, True, True]}) == 3
    assert hit_blocks({"a": [True, True, True], "b": [True, False, True]}) == 1, "a missing shard ends the prefix"
    assert hit_blocks({"a": [False, True], "b": [True, True]}) == 0
    assert hit_blocks({}) == 0


class _DictBackend:
    """Narrow in-memory stand-in for exists(); the real backends are covered by integration tests."""

    def __init__(self, keys, answer=None):
        self.keys, self.answer = set(keys), answer

    def exists(self, keys):
        if self.answer is not None:
            return self.answer(keys)
        return [Status.OK if k in self.keys else Status.MISSING for k in keys]


def test_count_pooled_with_a_missing_owner_shard():
    layout = CacheLayout("m", "float32", 16, 36864)
    stages = [StageLayers(0, tuple(range(4))), StageLayers(1, tuple(range(4, 8)))]
    keys = shard_keys(layout, all_shards(stages, 2, kvpp=True))
    assert len(keys) == 4
    hashes = block_hashes(list(range(80)), 16)
    stored = {k.key(h) for k in keys for h in hashes}
    assert count_pooled(_DictBackend(stored), keys, hashes) == 5
    stored.discard(keys[3].key(hashes[2]))  # stage 1, owner 1, block 2 evicted
    assert count_pooled(_DictBackend(stored), keys, hashes) == 2


@pytest.mark.parametrize("answer", [
    lambda keys: [Status.FAILED] * len(keys),  # the master could not be reached
    lambda keys: [Status.TIMEOUT] * len(keys),  # it did not answer within the bound
    lambda keys: [Status.REFUSED] * len(keys),  # not asked: the client's breaker is open
    lambda keys: [Status.OK] * (len(keys) - 1) + [Status.FAILED],  # one key errored: a partial answer
    lambda keys: [Status.OK] * (len(keys) - 1),  # fewer statuses than keys
], ids=["failed", "timeout", "refused", "partial", "short"])
def test_a_pool_that_did_not_answer_for_every_key_gives_no_count(answer):
    """Not 0 (which would announce every pooled block of the prefix removed), nor a count from the keys it answered."""
    layout = CacheLayout("m", "float32", 16, 36864)
    keys = shard_keys(layout, all_shards([StageLayers(0, tuple(range(4)))], 2, kvpp=True))
    with pytest.raises(PoolUnanswered):
        count_pooled(_DictBackend((), answer), keys, block_hashes(list(range(80)), 16))
