"""Which objects one pooled block consists of, for every PP stage and cache-replica group.

A block is a hit only when every shard listed here exists; ownership comes from
`kvpp_core.ownership`, never re-derived, and the replica groups (the KV heads each holds) from
`kvpp_core.topology` (connectors.common.kv_caches.replica_heads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpp_core.ownership import assign_owners

from connectors.common.kv_caches import Heads
from connectors.store.backends.base import Backend, Status
from connectors.store.keys import CacheLayout, ShardKey

MTP = "mtp"
"""Layer-set tag for MTP/draft caches: every rank keeps them in full, so every shard carries them."""


@dataclass(frozen=True)
class StageLayers:
    """One PP stage's caches as the pool sees them."""

    pp_rank: int
    target_layers: tuple[int, ...]
    mtp_caches: int = 0
    """Number of MTP/draft caches of this stage (tagged, not indexed: their ids are not target ids)."""


@dataclass(frozen=True)
class Shard:
    pp_rank: int
    owner: int
    layers: tuple[int | str, ...]
    heads: Heads = None
    """The KV heads the shard's pages hold (a GQA replica group's); None: an MLA/SFA cache."""


def stage_shards(stage: StageLayers, group_size: int, *, kvpp: bool, heads: Sequence[Heads] = (None,)) -> list[Shard]:
    """The shards one stage stores per block, for each of its cache-replica groups (`heads`: the KV heads of each,
    (None,) for MLA/SFA, whose stage is one group) of `group_size` ranks holding the same cache.

    kvpp: one shard per owner rank of each group, holding its owned layers plus the MTP caches; a rank with
    neither stores nothing. Off: one shard per group (owner 0), every layer: one copy of each distinct cache.
    """
    mtp = tuple(f"{MTP}{i}" for i in range(stage.mtp_caches))
    if not kvpp:
        layers = tuple(sorted(stage.target_layers)) + mtp
        return [Shard(stage.pp_rank, 0, layers, group) for group in heads]
    owners = assign_owners(stage.target_layers, group_size)
    shards = []
    for group in heads:
        for rank in range(group_size):
            layers = tuple(sorted(l for l, o in owners.items() if o == rank)) + mtp
            if layers:
                shards.append(Shard(stage.pp_rank, rank, layers, group))
    return shards


def all_shards(
    stages: Sequence[StageLayers], group_size: int, *, kvpp: bool, heads: Sequence[Heads] = (None,)
) -> list[Shard]:
    return [s for st in stages for s in stage_shards(st, group_size, kvpp=kvpp, heads=heads)]


def shard_keys(layout: CacheLayout, shards: Sequence[Shard]) -> list[ShardKey]:
    return [ShardKey(layout.fingerprint(s.layers), s.pp_rank, s.owner, s.heads) for s in shards]


def hit_blocks(exists: Mapping[ShardKey, Sequence[bool]]) -> int:
    """Length of the block prefix for which every shard exists (a missing shard ends the prefix)."""
    count = None
    for flags in exists.values():
        run = next((i for i, ok in enumerate(flags) if not ok), len(flags))
        count = run if count is None else min(count, run)
    return count or 0


class PoolUnanswered(RuntimeError):
    """The pool did not say which blocks it holds: a lookup that proves nothing, neither a hit nor a loss."""

    def __init__(self, status: Status) -> None:
        super().__init__({Status.TIMEOUT: "the store did not answer within its bound",
                          Status.REFUSED: "not asked: the pool failed to answer a recent call (the breaker is open)",
                          }.get(status, "the store failed"))
        self.status = status


def count_pooled(backend: Backend, shards: Sequence[ShardKey], hashes: Sequence[str]) -> int:
    """Leading blocks of `hashes` whose every shard is in the pool; PoolUnanswered unless the pool said, for
    every key, whether it holds it (an answer with any key unanswered is no answer)."""
    keys = [k for shard in shards for k in shard.keys(hashes)]
    status = backend.exists(keys)
    unanswered = next((s for s in status if not s.answered), None)
    if unanswered is not None:
        raise PoolUnanswered(unanswered)
    if len(status) != len(keys):
        raise PoolUnanswered(Status.FAILED)
    n = len(hashes)
    return hit_blocks({shard: [s is Status.OK for s in status[i * n:(i + 1) * n]] for i, shard in enumerate(shards)})
