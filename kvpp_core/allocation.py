"""Where each KV cache of a rank lives inside its single backing allocation under KVPP.

The runtime turns this placement into vLLM `KVCacheTensor`s; the capacity plan and the memory
budget use `bytes_per_block` from here, so the bytes the engine is told about, the bytes the
planner predicts and the bytes actually allocated are the same computation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvpp_core.ownership import RankLayout, rank_bytes_per_block


@dataclass(frozen=True)
class CacheLayer:
    """One attention cache of the model as vLLM names it, with the bytes one block of it takes."""

    name: str
    page_bytes: int
    layer_id: int | None
    """Decoder layer index for a target layer; None for MTP/draft caches, which are never sharded."""


def bundles(layers: Iterable[CacheLayer]) -> dict[int, list[CacheLayer]]:
    """Target caches grouped by decoder layer (main + indexer cache travel and are owned together)."""
    grouped: dict[int, list[CacheLayer]] = {}
    for layer in sorted(layers, key=lambda c: c.name):
        if layer.layer_id is not None:
            grouped.setdefault(layer.layer_id, []).append(layer)
    return grouped


def bundle_bytes(layers: Iterable[CacheLayer]) -> dict[int, int]:
    return {lid: sum(c.page_bytes for c in caches) for lid, caches in bundles(layers).items()}


def bytes_per_block(layers: Sequence[CacheLayer], layout: RankLayout) -> int:
    mtp = [c.page_bytes for c in layers if c.layer_id is None]
    return rank_bytes_per_block(layout, bundle_bytes(layers), mtp)


def logical_bytes_per_block(layers: Iterable[CacheLayer]) -> int:
    """Bytes per block of the replicated layout: what the engine's scheduler believes it holds."""
    return sum(c.page_bytes for c in layers)


@dataclass(frozen=True)
class Placement:
    """Byte offset of block 0 of every cache; pages of a cache are contiguous (block stride = page)."""

    num_blocks: int
    offsets: Mapping[str, int]
    page_bytes: Mapping[str, int]
    total_bytes: int
    persistent: tuple[str, ...]
    """Owned target caches, then MTP caches: what this rank keeps, saves and sends."""
    staging: tuple[tuple[str, ...], ...]
    """Per staging slot, the foreign caches bound to it (they alias each other)."""
    borrowed: tuple[str, ...] = ()
    """Zero-copy: the foreign caches, read in place from their owner's persistent pages. Their offset
    here (0) only gives vLLM a view to carve; the runtime rebinds it onto the owner's segment before
    anything reads it (kvpp_core.zero_copy)."""

    def region(self, name: str) -> tuple[int, int]:
        """(offset, nbytes) of a cache's whole allocation for `num_blocks` blocks."""
        return self.offsets[name], self.page_bytes[name] * self.num_blocks

    def span(self, name: str) -> slice:
        """A cache's whole allocation as a slice of the rank's flat KV bytes."""
        offset, nbytes = self.region(name)
        return slice(offset, offset + nbytes)


def place(layers: Sequence[CacheLayer], layout: RankLayout, num_blocks: int) -> Placement:
    """Persistent region first (owned bundles in layer order, then MTP), then the staging slots.

    A foreign bundle lands at the start of its slot, its caches in name order, so every layer that
    shares a slot reuses the same bytes. Zero-copy has no slots: foreign caches are `borrowed`.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    grouped = bundles(layers)
    missing = set(layout.target_layers) - set(grouped)
    if missing:
        raise ValueError(f"layout names target layers {sorted(missing)} that have no cache")
    offsets: dict[str, int] = {}
    persistent: list[str] = []
    cursor = 0
    owned_caches = [c for lid in layout.owned for c in grouped[lid]]
    mtp_caches = sorted((c for c in layers if c.layer_id is None), key=lambda c: c.name)
    for cache in owned_caches + mtp_caches:
        offsets[cache.name] = cursor
        persistent.append(cache.name)
        cursor += cache.page_bytes * num_blocks
    staging: list[list[str]] = [[] for _ in range(layout.staging_slots)]
    borrowed = [c for lid in layout.foreign for c in grouped[lid]] if layout.zero_copy else []
    total = cursor
    for cache in borrowed:  # placeholders at offset 0, rebound at startup; they must fit (each rank owns a layer)
        if cache.page_bytes * num_blocks > cursor:
            raise ValueError(f"zero-copy: kvpp rank {layout.kvpp_rank} keeps {cursor} bytes, less than foreign cache "
                             f"{cache.name}'s {cache.page_bytes * num_blocks}; it must own a layer")
        offsets[cache.name] = 0
    if not layout.zero_copy:
        slot_bytes = max((sum(c.page_bytes for c in grouped[lid]) for lid in layout.foreign), default=0)
        for lid in layout.foreign:
            slot = layout.slot_of(lid)
            inner = cursor + slot * slot_bytes * num_blocks
            for cache in grouped[lid]:
                offsets[cache.name] = inner
                staging[slot].append(cache.name)
                inner += cache.page_bytes * num_blocks
        total = cursor + layout.staging_slots * slot_bytes * num_blocks
    return Placement(
        num_blocks=num_blocks,
        offsets=offsets,
        page_bytes={c.name: c.page_bytes for c in layers},
        total_bytes=total,
        persistent=tuple(persistent),
        staging=tuple(tuple(s) for s in staging),
        borrowed=tuple(c.name for c in borrowed),
    )
