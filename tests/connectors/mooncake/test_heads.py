"""MooncakeConnectorV2's KV-head rule: which prefill ranks feed which decode ranks, and which TP pairs map."""

from __future__ import annotations

import pytest

from connectors.mooncake.heads import (fed_tps, feeds, head_sources, pairing_problem, rank_heads, runnable_tps,
                                       tp_pairing_problem)
from kvpp_core.topology import Topology

pytestmark = pytest.mark.unit


def test_rank_heads_are_vllm_s_split():
    assert rank_heads(None, 4) == [None] * 4
    assert rank_heads(1, 2) == [(0,), (0,)]
    assert rank_heads(4, 8) == [(0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,)]
    assert rank_heads(8, 2) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    for n, tp in ((2, 8), (8, 16), (4, 4)):
        assert rank_heads(n, tp) == [tuple(Topology(tp=tp, kv_heads=n).kv_heads_of(r)) for r in range(tp)]


def test_a_decode_rank_reads_from_every_prefill_rank_holding_exactly_its_heads():
    prefill = dict(enumerate(rank_heads(4, 8)))
    assert head_sources((1,), prefill) == [2, 3]
    assert head_sources((1, 2), prefill) == []
    assert head_sources(None, dict(enumerate(rank_heads(None, 2)))) == [0, 1]
    assert head_sources(None, prefill) == []


# (KV heads, prefill TP, decode TP, maps): the cases and the rule's edges.
PAIRS = [
    (None, 2, 1, True), (None, 1, 8, True), (None, 8, 3, True),  # MLA: any TP sizes
    (1, 2, 1, True), (1, 2, 2, True), (1, 2, 4, True), (1, 1, 2, True),  # the tiny model's one head
    (4, 8, 4, True), (4, 8, 16, True), (4, 4, 8, True),  # Qwen3-235B: one head per rank on both sides
    (4, 8, 2, False), (4, 8, 1, False),  # the decode rank holds 2 (4) heads, each prefill rank 1
    (8, 2, 2, True), (8, 2, 4, False), (8, 2, 1, False), (8, 4, 2, False),  # heads split, not replicated
    (8, 16, 8, True), (8, 8, 16, True), (2, 8, 2, True), (2, 8, 1, False),
]


@pytest.mark.parametrize("heads, prefill_tp, decode_tp, maps", PAIRS)
def test_which_tp_pairs_map(heads, prefill_tp, decode_tp, maps):
    assert feeds(heads, prefill_tp, decode_tp) is maps
    assert (tp_pairing_problem(heads, prefill_tp, decode_tp) is None) is maps


def test_equal_tp_always_maps_and_the_rule_is_by_heads_held():
    for heads in (1, 2, 4, 8):
        for tp in runnable_tps(heads, 16):
            assert feeds(heads, tp, tp)
            # Both sides replicate (TP >= heads): any pair of such TP sizes maps; else only equal TP does.
            for other in runnable_tps(heads, 16):
                assert feeds(heads, tp, other) is (other == tp or min(tp, other) >= heads)


def test_the_refusal_names_the_ranks_heads_and_the_tp_sizes_that_map():
    problem = tp_pairing_problem(4, 8, 2)
    assert problem == (
        "decode tp_rank 0 (TP 2) holds KV heads 0-1, but no rank of the TP 8 prefill holds exactly those (they hold "
        "0, 1, 2, 3): MooncakeConnectorV2 reads each layer whole from one prefill rank holding the same KV heads. A "
        "TP 8 prefill of this model (4 KV heads) feeds decodes of TP 4, 8, 12 or 16 (any multiple of 4): set the "
        "decode's TP to one of them, or the prefill's TP to the decode's")
    assert "feeds decodes of TP 2:" in tp_pairing_problem(8, 2, 4)
    assert fed_tps(8, 4) == "4"
    assert fed_tps(1, 2) == "1, 2, 3 or 4 (any TP)"


def test_the_handshake_sees_only_its_own_rank():
    prefill = dict(enumerate(rank_heads(2, 4)))
    assert pairing_problem(2, {1: (1,)}, 4, prefill) is None
    assert "decode tp_rank 0 (TP 1) holds KV heads 0-1" in pairing_problem(1, {0: (0, 1)}, 4, prefill)
    assert "one side runs an MLA/SFA model" in pairing_problem(1, {0: None}, 4, prefill)
