"""Which prefill workers can feed a decode worker: MooncakeConnectorV2's KV-head rule, stated once.

An MLA/SFA cache is the same on every TP rank, so any prefill rank feeds any decode rank. A GQA cache is split
by KV heads: vLLM gives TP rank r the heads `kvpp_core.topology.Topology.kv_heads_of(r)`, and a decode rank
reads each layer's blocks whole, so it reads them from a prefill rank that holds exactly its KV heads. Where TP
exceeds the model's KV heads several ranks hold each head, identically (a TP1 decode of a one-KV-head model
reads from either rank of a TP2 prefill); where a decode rank holds heads that no single prefill rank holds
(a TP2 prefill of a model with 4 KV heads, 2 per rank, and a TP1 decode holding all 4) there is nothing to read.

The handshake applies `pairing_problem` to the heads each worker publishes (connectors.mooncake.plan); `kvpp
check` applies `tp_pairing_problem` to the TP sizes of a deployment's prefill and decode instances. Both come
down to `unfed_rank`.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpp_core.topology import Topology

from connectors.common.kv_caches import Heads, heads_of, heads_text


def rank_heads(num_kv_heads: int | None, tp: int) -> list[Heads]:
    """Every TP rank's KV heads, as vLLM splits them (None each for an MLA/SFA model: `num_kv_heads` None)."""
    topology = Topology(tp=tp, kv_heads=num_kv_heads)
    return [heads_of(topology, rank) for rank in range(tp)]


def head_sources(wanted: Heads, held: Mapping[int, Heads]) -> list[int]:
    """The prefill TP ranks among `held` (rank -> its KV heads) that can feed a decode rank holding `wanted`."""
    return sorted(rank for rank, heads in held.items() if heads == wanted)


def unfed_rank(decode: Mapping[int, Heads], prefill: Mapping[int, Heads]) -> int | None:
    """The first decode TP rank (rank -> its KV heads) that no prefill rank can feed; None when every one has a
    source."""
    return next((rank for rank, wanted in sorted(decode.items()) if not head_sources(wanted, prefill)), None)


def feeds(num_kv_heads: int | None, prefill_tp: int, decode_tp: int) -> bool:
    """Whether a prefill of TP `prefill_tp` can feed every rank of a decode of TP `decode_tp`."""
    decode = dict(enumerate(rank_heads(num_kv_heads, decode_tp)))
    return unfed_rank(decode, dict(enumerate(rank_heads(num_kv_heads, prefill_tp)))) is None


def runnable_tps(num_kv_heads: int, up_to: int) -> list[int]:
    """The TP sizes up to `up_to` vLLM shards a model of `num_kv_heads` KV heads at: one divides the other."""
    return [tp for tp in range(1, up_to + 1) if num_kv_heads % tp == 0 or tp % num_kv_heads == 0]


def fed_tps(num_kv_heads: int, prefill_tp: int) -> str:
    """The decode TP sizes a prefill of TP `prefill_tp` feeds, in words."""
    candidates = sorted({*runnable_tps(num_kv_heads, 2 * max(prefill_tp, num_kv_heads)), prefill_tp})
    shown = [tp for tp in candidates if feeds(num_kv_heads, prefill_tp, tp)]
    words = ", ".join(map(str, shown[:-1])) + f" or {shown[-1]}" if len(shown) > 1 else str(shown[0])
    if prefill_tp < num_kv_heads:
        return words
    return words + (" (any TP)" if num_kv_heads == 1 else f" (any multiple of {num_kv_heads})")


def pairing_problem(decode_tp: int, decode: Mapping[int, Heads], prefill_tp: int,
                    prefill: Mapping[int, Heads]) -> str | None:
    """Why some rank of a decode of TP `decode_tp` (its ranks' KV heads, all or some) has no rank of a prefill of
    TP `prefill_tp` (its ranks' KV heads) to read from, with the fix; None when every one has."""
    rank = unfed_rank(decode, prefill)
    if rank is None:
        return None
    wanted = decode[rank]
    kinds = {heads is None for heads in (*decode.values(), *prefill.values())}
    if len(kinds) > 1:
        return (f"decode tp_rank {rank} holds {_held(wanted)} but the prefill ranks hold {_held(prefill[min(prefill)])}: "
                "one side runs an MLA/SFA model, the other a GQA one; run the same model on prefill and decode")
    num_kv_heads = 1 + max(h for heads in (*decode.values(), *prefill.values()) for h in heads)
    held = sorted(set(prefill.values()))
    return (f"decode tp_rank {rank} (TP {decode_tp}) holds {_held(wanted)}, but no rank of the TP {prefill_tp} prefill "
            f"holds exactly those (they hold {', '.join(map(heads_text, held))}): MooncakeConnectorV2 reads each layer "
            f"whole from one prefill rank holding the same KV heads. A TP {prefill_tp} prefill of this model "
            f"({num_kv_heads} KV heads) feeds decodes of TP {fed_tps(num_kv_heads, prefill_tp)}: set the decode's TP "
            "to one of them, or the prefill's TP to the decode's")


def tp_pairing_problem(num_kv_heads: int | None, prefill_tp: int, decode_tp: int) -> str | None:
    """`pairing_problem` of a prefill and a decode of a model with `num_kv_heads` KV heads (None: MLA/SFA), by
    their TP sizes (`kvpp check`)."""
    return pairing_problem(decode_tp, dict(enumerate(rank_heads(num_kv_heads, decode_tp))), prefill_tp,
                           dict(enumerate(rank_heads(num_kv_heads, prefill_tp))))


def _held(heads: Heads) -> str:
    if heads is None:
        return "an MLA/SFA cache"
    return f"KV head{'s' * (len(heads) > 1)} {heads_text(heads)}"
