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
    shards = all_shards(stages, 4, kvpp=False, replicated=True)
    assert [(s.pp_rank, s.owner) for s in shards] == [(0, 0), (1, 0)]
    assert shards[1].layers == tuple(range(8, 16)) + ("mtp0",)


def test_with_kvpp_each_owner_stores_its_layers_plus_mtp():
    shards = stage_shards(StageLayers(0, tuple(range(5)), mtp_caches=1), 2, kvpp=True, replicated=True)
    assert [(s.owner, s.layers) for s in shards] == [(0, (0, 1, 2, "mtp0")), (1, (3, 4, "mtp0"))]


def test_owners_without_layers_store_nothing():
    shards = stage_shards(StageLayers(0, (0, 1)), 4, kvpp=True, replicated=True)
    assert [(s.owner, s.layers) for s in shards] == [(0, (0,)), (1, (1,))]


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
    keys = shard_keys(layout, all_shards(stages, 2, kvpp=True, replicated=True))
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
    keys = shard_keys(layout, all_shards([StageLayers(0, tuple(range(4)))], 2, kvpp=True, replicated=True))
    with pytest.raises(PoolUnanswered):
        count_pooled(_DictBackend((), answer), keys, block_hashes(list(range(80)), 16))
