"""Which rank of a cache-replica group persistently owns which target layer.

This is the single source of truth for ownership: the runtime, both connectors, the planner and
`kvpp check` all call it, so a layer's owner can never be computed two different ways.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_index(layer_name: str) -> int:
    """Index of the decoder layer a vLLM cache name belongs to (`model.layers.7.self_attn.attn` -> 7).

    Every cache of one layer (MLA latent cache, SFA indexer cache) shares the index, which is what
    makes them one bundle with one owner.
    """
    found = _LAYER_INDEX.findall(layer_name)
    if not found:
        raise ValueError(f"cannot find a decoder layer index in cache name {layer_name!r}")
    return int(found[-1])


def target_layer(layer_name: str, num_target_layers: int) -> int | None:
    """The decoder layer a cache belongs to; None for caches past the decoder stack (MTP heads, EAGLE),
    which are never sharded."""
    idx = layer_index(layer_name)
    return idx if idx < num_target_layers else None


def owner_ranges(num_layers: int, group_size: int) -> list[range]:
    """Contiguous positions (in the sorted target-layer list) owned by each kvpp rank.

    `base, rem = divmod(L, G)`; ranks below `rem` take one extra layer. Ranks may own nothing when
    L < G.
    """
    if group_size < 1:
        raise ValueError(f"group size must be >= 1, got {group_size}")
    if num_layers < 0:
        raise ValueError(f"number of layers must be >= 0, got {num_layers}")
    base, rem = divmod(num_layers, group_size)
    ranges, start = [], 0
    for rank in range(group_size):
        count = base + (1 if rank < rem else 0)
        ranges.append(range(start, start + count))
        start += count
    return ranges


def assign_owners(layer_ids: Iterable[int], group_size: int) -> dict[int, int]:
    """Map each target layer id to its owner rank; independent of the input order."""
    ordered = sorted(set(layer_ids))
    owners: dict[int, int] = {}
    for rank, positions in enumerate(owner_ranges(len(ordered), group_size)):
        for pos in positions:
            owners[ordered[pos]] = rank
    return owners


@dataclass(frozen=True)
class RankLayout:
    """The KV layout of one kvpp rank: what it keeps persistently and where foreign layers land."""

    kvpp_rank: int
    group_size: int
    target_layers: tuple[int, ...]
    """Sorted ids of the stage's target layers (MTP/draft layers are never target layers)."""
    owners: Mapping[int, int] = field(repr=False)
    staging_slots: int
    """Number of staging buffers this rank allocates (0 when it owns every target layer, or zero-copy)."""
    zero_copy: bool = False
    """Foreign layers are read in place from their owner's persistent pages: no staging slot, no copy."""

    @property
    def owned(self) -> tuple[int, ...]:
        return tuple(l for l in self.target_layers if self.owners[l] == self.kvpp_rank)

    @property
    def foreign(self) -> tuple[int, ...]:
        return tuple(l for l in self.target_layers if self.owners[l] != self.kvpp_rank)

    def owner_of(self, layer_id: int) -> int:
        return self.owners[layer_id]

    def position(self, layer_id: int) -> int:
        return self.target_layers.index(layer_id)

    def slot_of(self, layer_id: int) -> int:
        """Staging buffer of a foreign layer: its execution position modulo the slot count."""
        if self.owners[layer_id] == self.kvpp_rank:
            raise ValueError(f"layer {layer_id} is owned by rank {self.kvpp_rank}; it has no staging slot")
        if self.zero_copy:
            raise ValueError(f"layer {layer_id} is read in place from kvpp rank {self.owners[layer_id]} (zero-copy); "
                             "it has no staging slot")
        return self.position(layer_id) % self.staging_slots

    @property
    def prefetch_depth(self) -> int:
        """How many layers ahead a broadcast may run without overwriting a slot still being read."""
        return max(self.staging_slots - 1, 0)


def rank_layout(layer_ids: Iterable[int], group_size: int, kvpp_rank: int, staging: int = 2) -> RankLayout:
    """This rank's layout; `staging` 0 is the zero-copy mode (kvpp_core.config.ZERO_COPY)."""
    if not 0 <= kvpp_rank < group_size:
        raise ValueError(f"kvpp rank {kvpp_rank} outside a group of {group_size}")
    if staging < 0:
        raise ValueError(f"staging buffer count must be >= 0 (0: zero-copy), got {staging}")
    owners = assign_owners(layer_ids, group_size)
    targets = tuple(sorted(owners))
    foreign = sum(1 for l in targets if owners[l] != kvpp_rank)
    return RankLayout(
        kvpp_rank=kvpp_rank,
        group_size=group_size,
        target_layers=targets,
        owners=owners,
        staging_slots=min(staging, foreign),
        zero_copy=staging == 0 and group_size > 1,
    )


def rank_bytes_per_block(
    layout: RankLayout, bundle_bytes: Mapping[int, int], mtp_bundle_bytes: Iterable[int] = ()
) -> int:
    """Bytes one logical block costs on this rank: owned bundles + MTP bundles + staging slots.

    A staging slot must hold any foreign bundle, so it is sized by the largest one. Zero-copy has no
    slot: a block costs the owned and MTP bundles alone, the layer-granular limit L / ceil(L/G).
    """
    owned = sum(bundle_bytes[l] for l in layout.owned)
    largest_foreign = max((bundle_bytes[l] for l in layout.foreign), default=0)
    return owned + sum(mtp_bundle_bytes) + layout.staging_slots * largest_foreign
