"""What both connectors read of an engine's KV caches: which KV heads each TP rank holds, and whether the caches
are of a kind and layout they can move.

Both move a layer's block as one contiguous page at `cache[block_id]`, and take a KV cache group's block ids as
every layer's. MLA/SFA caches are such pages on every backend; a GQA cache is one where the attention kernel keeps
a block's K and V heads together (vLLM's CPU attention: [num_blocks, kv_heads, block_size, 2 x head_size]), not
where it keeps all K before all V ([2, num_blocks, ...]), and only while every layer is plain full attention in
one KV cache group.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvpp_core.topology import Topology

Heads = tuple[int, ...] | None
"""The KV heads (global indices, a run) one TP rank holds; None: an MLA/SFA cache, which every rank holds whole."""


def heads_text(heads: tuple[int, ...]) -> str:
    """A run of KV heads as keys and messages name it: `3`, `0-3`."""
    return f"{heads[0]}" if len(heads) == 1 else f"{heads[0]}-{heads[-1]}"


def heads_of(topology: Topology, tp_rank: int) -> Heads:
    """The KV heads TP rank `tp_rank` holds (kvpp_core.topology); None for MLA/SFA."""
    heads = topology.kv_heads_of(tp_rank)
    return None if heads is None else tuple(heads)


def replica_heads(topology: Topology) -> tuple[Heads, ...]:
    """The KV heads of each of a stage's cache-replica groups, in group order: (None,) for MLA/SFA, one run per group
    of TP ranks holding the same heads for GQA (one group per rank where no head is replicated)."""
    return tuple(heads_of(topology, g * topology.group_size) for g in range(topology.groups_per_stage))


def kv_topology(vllm_config) -> Topology:
    """The engine's TP split of its KV caches: a GQA model's KV heads over TP ranks (kvpp_core.topology), one cache
    the same on every rank for MLA/SFA."""
    model = vllm_config.model_config
    return Topology(tp=vllm_config.parallel_config.tensor_parallel_size,
                    kv_heads=None if model.use_mla else model.get_total_num_kv_heads())


def rank_kv_heads(vllm_config, tp_rank: int) -> Heads:
    """The KV heads (global indices) TP rank `tp_rank` of the engine holds; None for an MLA/SFA model."""
    return heads_of(kv_topology(vllm_config), tp_rank)


def cache_groups_problem(vllm_config, kv_cache_config, connector: str) -> str | None:
    """Why `connector` cannot move this model's KV cache groups (one group, and for a GQA model plain full attention
    in it); None when it can, or when vLLM gave no cache config."""
    if kv_cache_config is None:
        return None
    groups = kv_cache_config.kv_cache_groups
    if len(groups) > 1:
        return (f"{connector} moves models with one KV cache group (MLA/SFA, or GQA with full attention in every "
                f"layer); this model has {len(groups)} (a hybrid of attention kinds): serve it without {connector}")
    if vllm_config.model_config.use_mla or not groups:
        return None
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec:
        return (f"{connector} moves GQA caches of plain full attention; this model's are {type(spec).__name__} "
                f"(sliding-window, chunked-local and sink caches keep blocks {connector} does not move whole): serve "
                f"it without {connector}")
    return None


def block_pages_problem(vllm_config, kv_caches: Mapping[str, torch.Tensor], connector: str) -> str | None:
    """Why the caches are not block-major pages `connector` can move (a GQA cache whose backend keeps all K before all
    V); None when each `cache[block_id]` is one block's whole page."""
    model = vllm_config.model_config
    if model.use_mla:
        return None
    page = (vllm_config.cache_config.block_size * model.get_num_kv_heads(vllm_config.parallel_config)
            * 2 * model.get_head_size())
    for name, cache in kv_caches.items():
        if cache[0].numel() != page or not cache[0].is_contiguous():
            return (f"{connector} moves a GQA cache as one page per block ([num_blocks, ...], a block's K and V "
                    f"together: {page} elements); layer {name}'s cache has shape {tuple(cache.shape)}, strides "
                    f"{cache.stride()}: its attention backend keeps K and V apart. Serve it on vLLM's CPU attention "
                    f"(CPU_ATTN), or without {connector}")
    return None
