"""Which objects one pooled block consists of, for every PP stage.

A block is a hit only when every shard listed here exists; ownership comes from
`kvpp_core.ownership`, never re-derived.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpp_core.ownership import assign_owners

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


def stage_shards(stage: StageLayers, group_size: int, *, kvpp: bool, replicated: bool) -> list[Shard]:
    """The shards one stage stores per block.

    kvpp: one shard per owner rank holding its owned layers plus the MTP caches; a rank with neither
    stores nothing. Off and `replicated` (MLA: every TP rank holds identical caches): one shard for the
    group (owner 0). Off and not replicated (per-rank heads): one shard per TP rank, all layers.
    """
    mtp = tuple(f"{MTP}{i}" for i in range(stage.mtp_caches))
    if kvpp:
        owners = assign_owners(stage.target_layers, group_size)
        shards = []
        for rank in range(group_size):
            layers = tuple(sorted(l for l, o in owners.items() if o == rank)) + mtp
            if layers:
                shards.append(Shard(stage.pp_rank, rank, layers))
        return shards
    layers = tuple(sorted(stage.target_layers)) + mtp
    if replicated:
        return [Shard(stage.pp_rank, 0, layers)]
    return [Shard(stage.pp_rank, rank, layers) for rank in range(group_size)]


def all_shards(
    stages: Sequence[StageLayers], group_size: int, *, kvpp: bool, replicated: bool
) -> list[Shard]:
    return [s for st in stages for s in stage_shards(st, group_size, kvpp=kvpp, replicated=replicated)]


def shard_keys(layout: CacheLayout, shards: Sequence[Shard]) -> list[ShardKey]:
    return [ShardKey(layout.fingerprint(s.layers), s.pp_rank, s.owner) for s in shards]


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
