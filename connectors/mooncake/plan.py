"""Deciding what a decode worker reads from which prefill worker, and at which addresses.

With KVPP on the prefill, a target layer is published only by its owner rank in each cache-replica group; MTP
layers and, with KVPP off, every layer are published by every rank of the group. A decode worker takes each layer
from a prefill worker holding exactly its KV heads (connectors.mooncake.heads: any rank for an MLA cache, the ranks
of its KV head for a GQA one), so a decode of another TP size reads wherever the heads map.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from connectors.mooncake.heads import head_sources, pairing_problem
from connectors.mooncake.messages import LayerDesc, WorkerMeta
from connectors.mooncake.transfer import Desc


class IncompatiblePeerError(ValueError):
    """The prefill's published layout cannot feed this decode worker; the message says why."""


def _heads_by_rank(remote: Sequence[WorkerMeta]) -> dict[int, tuple[int, ...] | None]:
    return {peer.tp_rank: peer.heads for peer in remote}


def check_compatible(local: WorkerMeta, remote: Sequence[WorkerMeta]) -> None:
    """Refuse a prefill whose model, dtype, block size or layer geometry differ from ours, or none of whose
    workers holds exactly this worker's KV heads."""
    for peer in remote:
        where = f"prefill engine {peer.engine_id} tp_rank {peer.tp_rank}"
        for key in ("model", "dtype", "block_size"):
            if getattr(peer, key) != getattr(local, key):
                raise IncompatiblePeerError(
                    f"{where} serves {key}={getattr(peer, key)!r} but this decode has "
                    f"{getattr(local, key)!r}; prefill and decode must run the same model, dtype "
                    "and block size"
                )
        mine = {layer.name: layer for layer in local.layers}
        for layer in peer.layers:
            ours = mine.get(layer.name)
            if ours is not None and ours.block_len != layer.block_len:
                raise IncompatiblePeerError(
                    f"{where}: layer {layer.name} has {layer.block_len} bytes per block, this "
                    f"decode {ours.block_len}"
                )
    if remote:
        problem = pairing_problem(local.tp_size, {local.tp_rank: local.heads}, remote[0].tp_size,
                                  _heads_by_rank(remote))
        if problem is not None:
            raise IncompatiblePeerError(f"prefill engine {remote[0].engine_id}: {problem}")


def choose_sources(local: WorkerMeta, remote: Sequence[WorkerMeta]) -> dict[str, tuple[WorkerMeta, LayerDesc]]:
    """For each local layer, the prefill worker (and its layer record) to read it from: one holding exactly
    this worker's KV heads.

    Among several holders (MTP layers, KVPP off, a GQA head several ranks hold) the choice is spread by
    layer position so the reads of one request fan out over those prefill workers.
    """
    sources = set(head_sources(local.heads, _heads_by_rank(remote)))
    holders: dict[str, list[tuple[WorkerMeta, LayerDesc]]] = {}
    for peer in sorted(remote, key=lambda m: (m.pp_rank, m.tp_rank)):
        if peer.tp_rank not in sources:
            continue
        for layer in peer.layers:
            holders.setdefault(layer.name, []).append((peer, layer))
    chosen = {}
    for position, layer in enumerate(local.layers):
        options = holders.get(layer.name)
        if not options:
            kvpp = any(peer.kvpp for peer in remote)
            raise IncompatiblePeerError(
                f"no prefill worker publishes layer {layer.name}"
                + (" (KVPP on the prefill: its owner rank did not publish it)" if kvpp else "")
                + "; prefill and decode must serve the same model with the same layers"
            )
        owners = {peer.tp_rank for peer, desc in options if desc.owner is not None}
        if len(owners) > 1:
            raise IncompatiblePeerError(
                f"layer {layer.name} is claimed by several KVPP owners {sorted(owners)}"
            )
        chosen[layer.name] = options[position % len(options)]
    return chosen


def block_runs(local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local start, remote start, count) of runs where both block ids go up, or both go down, by
    one together. vLLM frees a request's blocks in reverse order, so the next request is often
    given descending ids: such a run still covers one contiguous range on each side."""
    if len(local_blocks) != len(remote_blocks):
        raise ValueError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote blocks")
    runs: list[list[int]] = []  # [local start, remote start, count, direction (+1, -1, 0: unknown)]
    for lb, rb in zip(local_blocks, remote_blocks):
        if runs:
            start_l, start_r, count, direction = runs[-1]
            if direction >= 0 and (lb, rb) == (start_l + count, start_r + count):
                runs[-1] = [start_l, start_r, count + 1, 1]
                continue
            if direction <= 0 and (lb, rb) == (start_l - 1, start_r - 1):
                runs[-1] = [lb, rb, count + 1, -1]
                continue
        runs.append([lb, rb, 1, 0])
    return [(start_l, start_r, count) for start_l, start_r, count, _ in runs]


def build_descs(
    local_layers: Mapping[str, LayerDesc],
    sources: Mapping[str, tuple[WorkerMeta, LayerDesc]],
    local_blocks: Sequence[int],
    remote_blocks: Sequence[int],
) -> dict[str, list[Desc]]:
    """Copies per prefill transfer-engine session, layer by layer: one copy per run of consecutive
    blocks where pages are dense, else one per block (the engine coalesces adjacent copies)."""
    runs = block_runs(local_blocks, remote_blocks)
    if not runs:
        return {}
    lo_l, hi_l, lo_r, hi_r = min(local_blocks), max(local_blocks), min(remote_blocks), max(remote_blocks)
    per_peer: dict[str, list[Desc]] = {}
    for name, mine in local_layers.items():
        peer, theirs = sources[name]
        if lo_l < 0 or hi_l >= mine.num_blocks:
            raise ValueError(f"local block {lo_l if lo_l < 0 else hi_l} outside layer {name}'s {mine.num_blocks} blocks")
        if lo_r < 0 or hi_r >= theirs.num_blocks:
            raise IncompatiblePeerError(
                f"remote block {lo_r if lo_r < 0 else hi_r} outside layer {name}'s {theirs.num_blocks} blocks on "
                f"prefill tp_rank {peer.tp_rank}"
            )
        out = per_peer.setdefault(peer.te_session, [])
        dense = mine.block_stride == mine.block_len and theirs.block_stride == theirs.block_len
        for ls, rs, count in runs:
            if dense:
                out.append(Desc(mine.base_addr + ls * mine.block_stride, theirs.base_addr + rs * theirs.block_stride,
                                count * mine.block_len))
            else:
                out.extend(
                    Desc(mine.base_addr + (ls + i) * mine.block_stride, theirs.base_addr + (rs + i) * theirs.block_stride,
                         mine.block_len)
                    for i in range(count)
                )
    return per_peer
