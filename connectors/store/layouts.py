"""Whether two engines sharing one pool can ever share a pooled block: the key rule, stated once.

A pool key is `kvpp/<fingerprint>/pp<stage>/[h<heads>/]o<owner>/<block hash>` (connectors.store.keys): the
block hash chains whole blocks of `block_size` tokens, the fingerprint covers model, KV dtype, block size,
page bytes and the layer set of the shard, a GQA key names the KV heads its pages hold, and the shards of a
block follow the KVPP ownership of each PP stage and cache-replica group (connectors.store.shards,
kvpp_core.ownership). Engines whose shard keys differ write
objects the other never looks up: they share the pool's memory but no prefix. `kvpp check` applies
this rule to the instances of a deployment spec; the worker derives its real keys from the same
`all_shards`.
"""

from __future__ import annotations

from dataclasses import dataclass

from connectors.common.kv_caches import Heads
from connectors.store.shards import Shard, StageLayers, all_shards


@dataclass(frozen=True)
class KeyLayout:
    """What an engine's pool keys depend on besides the tokens."""

    model: str
    """vLLM's model (path or name) as the engine is started with it."""
    kv_dtype: str
    """The KV cache's dtype: --kv-cache-dtype, else --dtype ("auto": the model's own)."""
    block_size: int | None
    """None: vLLM's default for the platform."""
    kvpp: bool
    group_size: int
    """The cache-replica group (kvpp_core.topology): TP ranks of a stage (times PCP when PCP is in the group) for
    MLA/SFA, the TP ranks of one KV head for GQA."""
    stages: tuple[StageLayers, ...]
    """Target layers (and MTP caches) of each PP stage."""
    heads: tuple[Heads, ...] = (None,)
    """The KV heads of each cache-replica group of a stage (connectors.common.kv_caches.replica_heads); (None,) for
    MLA/SFA."""

    def shards(self) -> list[Shard]:
        """The objects one block is stored as."""
        return all_shards(self.stages, self.group_size, kvpp=self.kvpp, heads=self.heads)


_FINGERPRINT = ("model", "kv_dtype", "block_size")
"""Fields in every key (block_size also in the hash chain): any difference separates all keys."""
_SHARDING = ("kvpp", "group_size", "heads", "stages")
"""Fields that decide the shard split: a difference separates keys only if the shards differ
(without KVPP an MLA block is one object per stage whatever the TP size, a GQA block one per distinct
set of KV heads a rank holds)."""


def key_differences(a: KeyLayout, b: KeyLayout) -> list[str]:
    """The fields that keep `a` and `b` from finding each other's pooled blocks; empty when every
    key of one is a key of the other."""
    fields = [f for f in _FINGERPRINT if getattr(a, f) != getattr(b, f)]
    if a.shards() != b.shards():
        # The group's size splits the layers over owners with KVPP only.
        fields += [f for f in _SHARDING if getattr(a, f) != getattr(b, f) and (f != "group_size" or a.kvpp or b.kvpp)]
    return fields
