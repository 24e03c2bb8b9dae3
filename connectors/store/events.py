"""The pool's KV cache events: when a pooled block may be announced stored, and when removed.

A pooled block is usable only when every object it consists of is in the pool: with KVPP one owner shard
per rank that owns layers, on every PP stage (connectors.store.shards). Ranks finish their puts at
different steps, so "stored" is decided here, on the scheduler side, across steps: a block the scheduler
asked to save is announced once every worker of the engine reported its share landed (a worker without a
shard of its own has nothing to land and says so). A failed share means the block is never announced for
that save. Which worker writes which shard stays the worker's business (its layout code); this table only
counts workers, so it cannot disagree with it.

"Removed" is detected where the pool is asked: a lookup that finds fewer leading blocks than were announced
for that prefix announces the first lost block and every announced block after it in its chain removed
(a chain is unusable past its first missing block). Eviction, removal and a holder's expiry are all seen
this way, the next time a request asks for the prefix; nothing is detected in between.

Both tables are bounded: the oldest entries are forgotten first. A forgotten pending block is never
announced; a forgotten announced block is never announced removed (its announced descendants still are,
when a lookup reaches them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent

from connectors.store.metadata import SavedShards

MEDIUM = MEDIUM_CPU
"""The pool keeps blocks in host memory (Mooncake store segments, memcache): vLLM's CPU medium, as its own
CPU offloading connectors report, so a consumer tells them apart from an engine's own "GPU" blocks."""
LOCALITY = "REMOTE"
"""The pool is not this engine's memory: it is shared by every engine on the pool and read through the store
client, so its blocks are REMOTE relative to the publisher (vLLM's own CPU offload is LOCAL)."""
GROUP = 0
"""The pool saves the first KV cache group's blocks (the MLA cache, MTP's riding with it)."""
MAX_PENDING = 1 << 16
"""Blocks asked to save whose shards have not all landed yet."""
MAX_ANNOUNCED = 1 << 18
"""Blocks announced stored and not yet removed."""


@dataclass(frozen=True)
class BlockFacts:
    """What a BlockStored event says of one block, as vLLM's own events say it of the same tokens: vLLM's block
    hash (so a consumer correlates it with the engine's local events), its parent's, the tokens, the extra keys
    and the LoRA adapter."""

    block_hash: Any
    parent_block_hash: Any
    token_ids: tuple[int, ...]
    extra_keys: tuple[Any, ...] | None = None
    """The block's extra keys in the untagged form vLLM's events publish (None: none)."""
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass
class _Pending:
    facts: BlockFacts
    parent: str | None
    """The parent block's pool hash."""
    workers: set[int] = field(default_factory=set)


@dataclass
class _Announced:
    block_hash: Any
    """vLLM's hash, which the removal names."""
    parent: str | None


class PoolEvents:
    """The stored/removed decision table of one scheduler (one DP rank's engine, `workers` workers)."""

    def __init__(self, workers: int, max_pending: int = MAX_PENDING, max_announced: int = MAX_ANNOUNCED) -> None:
        if workers < 1 or max_pending < 1 or max_announced < 1:
            raise ValueError(f"workers {workers}, max_pending {max_pending}, max_announced {max_announced} must be >= 1")
        self._workers = workers
        self._max_pending, self._max_announced = max_pending, max_announced
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._announced: OrderedDict[str, _Announced] = OrderedDict()
        self._children: dict[str, set[str]] = {}
        """Announced block -> its announced children (pool hashes)."""
        self._events: list[KVCacheEvent] = []

    def expect(self, pool_hash: str, parent: str | None, facts: BlockFacts) -> None:
        """The scheduler asked the workers to save this block (`parent`: the previous block's pool hash)."""
        if pool_hash in self._announced or pool_hash in self._pending:
            return
        self._pending[pool_hash] = _Pending(facts, parent)
        if len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)

    def report(self, shards: SavedShards) -> None:
        """The workers' outcomes of one step: blocks whose every share landed are announced stored; a failed
        share drops the block (the save that asked for it is never announced)."""
        for report in shards.reports:
            for pool_hash in report.failed:
                self._pending.pop(pool_hash, None)
            for pool_hash in report.landed:
                pending = self._pending.get(pool_hash)
                if pending is None:
                    continue
                pending.workers.add(report.worker)
                if len(pending.workers) == self._workers:
                    del self._pending[pool_hash]
                    self._announce(pool_hash, pending)

    def _announce(self, pool_hash: str, pending: _Pending) -> None:
        facts = pending.facts
        self._events.append(BlockStored(
            block_hashes=[facts.block_hash], parent_block_hash=facts.parent_block_hash,
            token_ids=list(facts.token_ids), block_size=len(facts.token_ids), lora_id=facts.lora_id,
            medium=MEDIUM, lora_name=facts.lora_name,
            extra_keys=[facts.extra_keys],
            group_idx=GROUP, locality=LOCALITY))
        self._announced[pool_hash] = _Announced(facts.block_hash, pending.parent)
        if pending.parent in self._announced:
            self._children.setdefault(pending.parent, set()).add(pool_hash)
        if len(self._announced) > self._max_announced:
            oldest, entry = self._announced.popitem(last=False)
            self._forget(oldest, entry)

    def _forget(self, pool_hash: str, entry: _Announced) -> None:
        self._children.pop(pool_hash, None)
        siblings = self._children.get(entry.parent)
        if siblings is not None:
            siblings.discard(pool_hash)

    def lookup(self, hashes: Sequence[str], hit: int) -> None:
        """A lookup of `hashes` found its first `hit` blocks pooled: announced blocks from `hit` on are lost (the
        block at `hit` lost a shard, or one before it did) and announced removed with their descendants."""
        for pool_hash in hashes[:hit]:
            if pool_hash in self._announced:
                self._announced.move_to_end(pool_hash)  # in use: forgotten last
        lost = [h for h in hashes[hit:] if h in self._announced]
        removed: list[Any] = []
        while lost:
            pool_hash = lost.pop(0)
            entry = self._announced.pop(pool_hash, None)
            if entry is None:
                continue
            removed.append(entry.block_hash)
            lost.extend(sorted(self._children.get(pool_hash, ())))
            self._forget(pool_hash, entry)
        if removed:
            self._events.append(BlockRemoved(block_hashes=removed, medium=MEDIUM, group_idx=GROUP, locality=LOCALITY))

    def take(self) -> Iterable[KVCacheEvent]:
        """The events decided since the last call, in order."""
        events, self._events = self._events, []
        return events
