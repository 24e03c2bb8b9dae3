"""The pool's stored/removed decision table (connectors.store.events): shards landing over several steps, a failed
shard, a lookup finding a shorter prefix than was announced, and the tables' bounds."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from connectors.store.events import LOCALITY, MEDIUM, BlockFacts, PoolEvents
from connectors.store.keys import block_hashes
from connectors.store.metadata import SavedShards, ShardReport

pytestmark = pytest.mark.unit

TOKENS = list(range(16 * 6))
HASHES = block_hashes(TOKENS, 16)
"""Pool hashes of six blocks."""


def _facts(i: int) -> BlockFacts:
    """Block i as vLLM's events name it (here: bytes standing for vLLM's hash)."""
    return BlockFacts(b"v%d" % i, b"v%d" % (i - 1) if i else None, tuple(TOKENS[16 * i:16 * (i + 1)]))


def _expect(table: PoolEvents, blocks) -> None:
    for i in blocks:
        table.expect(HASHES[i], HASHES[i - 1] if i else None, _facts(i))


def _report(table: PoolEvents, worker: int, landed=(), failed=()) -> list:
    table.report(SavedShards((ShardReport(worker, tuple(HASHES[i] for i in landed), tuple(HASHES[i] for i in failed)),)))
    return list(table.take())


def _stored(events) -> list[bytes]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def test_a_block_is_stored_only_once_every_worker_landed_its_share_over_several_steps():
    table = PoolEvents(workers=2)
    _expect(table, range(3))
    assert _report(table, 0, landed=[0, 1, 2]) == [], "rank 1's shards are not in the pool yet"
    assert _stored(_report(table, 1, landed=[0])) == [b"v0"]
    assert _report(table, 0, landed=[1, 2]) == [], "a worker's second report of the same shards counts once"
    events = _report(table, 1, landed=[1, 2])
    assert _stored(events) == [b"v1", b"v2"]
    first = events[0]
    assert (first.parent_block_hash, first.token_ids, first.block_size) == (b"v0", TOKENS[16:32], 16)
    assert (first.medium, first.locality, first.group_idx, first.extra_keys) == (MEDIUM, LOCALITY, 0, [None])
    assert _report(table, 1, landed=[0, 1, 2]) == [], "stored once, not per confirming save"


def test_a_failed_shard_means_never_stored_for_that_save():
    table = PoolEvents(workers=2)
    _expect(table, range(2))
    assert _report(table, 0, landed=[0, 1]) == []
    assert _stored(_report(table, 1, landed=[0], failed=[1])) == [b"v0"]
    assert _report(table, 1, landed=[1]) == [], "the failed save is dropped, a late success of it is not news"
    _expect(table, [1])  # a later request saves the block again: every share must land anew
    assert _report(table, 0, landed=[1]) == []
    assert _stored(_report(table, 1, landed=[1])) == [b"v1"]


def test_without_kvpp_one_worker_writes_and_a_block_is_stored_when_it_landed():
    table = PoolEvents(workers=1)
    _expect(table, range(2))
    assert _stored(_report(table, 0, landed=[0, 1])) == [b"v0", b"v1"]


def test_landed_shards_of_blocks_never_asked_for_are_ignored():
    table = PoolEvents(workers=1)
    assert _report(table, 0, landed=[0]) == []


def _announced(workers=1, blocks=range(6), **bounds) -> PoolEvents:
    table = PoolEvents(workers=workers, **bounds)
    _expect(table, blocks)
    for w in range(workers):
        _report(table, w, landed=blocks)
    return table


def test_a_lookup_finding_a_shorter_prefix_removes_the_lost_block_and_every_one_after_it():
    table = _announced()
    table.lookup(HASHES, 6)
    assert list(table.take()) == [], "everything announced was found"
    table.lookup(HASHES[:5], 3)  # block 3 lost a shard; the lookup does not reach block 5
    (removed,) = table.take()
    assert isinstance(removed, BlockRemoved)
    assert (removed.block_hashes, removed.medium, removed.locality) == ([b"v3", b"v4", b"v5"], MEDIUM, LOCALITY), \
        "block 5 is unusable too: its chain runs through block 3"
    table.lookup(HASHES, 3)
    assert list(table.take()) == [], "removed once"
    _expect(table, range(3, 6))  # recomputed and saved again
    assert _stored(_report(table, 0, landed=range(6))) == [b"v3", b"v4", b"v5"]


def test_a_lookup_that_finds_nothing_removes_the_whole_chain():
    table = _announced(blocks=range(3))
    table.lookup(HASHES[:1], 0)
    (removed,) = table.take()
    assert removed.block_hashes == [b"v0", b"v1", b"v2"]


def test_the_announced_table_forgets_its_oldest_block_first():
    table = _announced(blocks=range(3), max_announced=2)
    table.lookup(HASHES[:3], 0)
    (removed,) = table.take()
    assert removed.block_hashes == [b"v1", b"v2"], "block 0 was forgotten, so it is never reported removed"


def test_a_hit_keeps_its_blocks_from_being_forgotten_first():
    table = _announced(blocks=range(2), max_announced=2)
    table.lookup(HASHES[:1], 1)  # block 0 in use: block 1 is now the oldest
    _expect(table, [2])
    _report(table, 0, landed=[2])
    table.lookup(HASHES[:3], 0)
    (removed,) = table.take()
    assert removed.block_hashes == [b"v0", b"v2"]


def test_the_pending_table_forgets_its_oldest_block_first():
    table = PoolEvents(workers=1, max_pending=1)
    _expect(table, range(2))
    assert _stored(_report(table, 0, landed=[0, 1])) == [b"v1"], "block 0's save was forgotten: never announced"


def test_bounds_and_workers_must_be_positive():
    with pytest.raises(ValueError, match="must be >= 1"):
        PoolEvents(workers=0)
