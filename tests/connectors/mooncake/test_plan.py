"""Read planning: which prefill worker each layer is read from, compatibility, copy descriptors."""

from __future__ import annotations

import pytest

from connectors.mooncake.plan import IncompatiblePeerError, block_runs, build_descs, check_compatible, choose_sources
from connectors.mooncake.transfer import Desc, coalesce
from tests.helpers.mooncake_wire import BLOCK, layer, meta, names

pytestmark = pytest.mark.unit


def test_block_runs_follow_both_sides():
    assert block_runs([4, 5, 6, 9, 10, 11], [1, 2, 9, 10, 11, 3]) == [(4, 1, 2), (6, 9, 1), (9, 10, 2), (11, 3, 1)]
    assert block_runs([], []) == []
    # descending on both sides (blocks vLLM freed in reverse order) is one range each
    assert block_runs([9, 8, 7, 3, 4], [20, 19, 18, 5, 6]) == [(7, 18, 3), (3, 5, 2)]
    assert block_runs([9, 8, 7], [18, 19, 20]) == [(9, 18, 1), (8, 19, 1), (7, 20, 1)]  # opposite ways
    with pytest.raises(ValueError, match="2 local blocks for 1 remote"):
        block_runs([1, 2], [1])


def test_kvpp_layers_come_from_their_owner_and_mtp_is_spread():
    target = names(4)
    mtp = ["model.layers.4.mtp_block.attn", "model.layers.5.mtp_block.attn"]
    # KVPP on the prefill, TP=2: rank 0 owns layers 0-1, rank 1 layers 2-3, both hold the MTP caches.
    r0 = meta(0, [layer(target[0], 1 << 20, 0), layer(target[1], 2 << 20, 0),
                  layer(mtp[0], 3 << 20), layer(mtp[1], 4 << 20)], kvpp=True)
    r1 = meta(1, [layer(target[2], 5 << 20, 1), layer(target[3], 6 << 20, 1),
                  layer(mtp[0], 7 << 20), layer(mtp[1], 8 << 20)], kvpp=True)
    local = meta(0, [layer(n, (i + 10) << 20) for i, n in enumerate(target + mtp)], tp_size=1)
    src = choose_sources(local, [r1, r0])
    assert {n: src[n][0].tp_rank for n in target} == {target[0]: 0, target[1]: 0, target[2]: 1, target[3]: 1}
    assert {src[n][0].tp_rank for n in mtp} == {0, 1}  # spread, not all from one rank
    assert src[target[2]][1].base_addr == 5 << 20


def test_kvpp_off_prefill_spreads_layers_over_ranks():
    target = names(4)
    r = [meta(t, [layer(n, (t * 8 + i + 1) << 20) for i, n in enumerate(target)]) for t in range(2)]
    local = meta(0, [layer(n, (i + 20) << 20) for i, n in enumerate(target)], tp_size=1)
    src = choose_sources(local, r)
    assert [src[n][0].tp_rank for n in target] == [0, 1, 0, 1]


def test_missing_layer_is_refused_with_kvpp_hint():
    target = names(2)
    r0 = meta(0, [layer(target[0], 1 << 20, 0)], kvpp=True)
    local = meta(0, [layer(n, (i + 1) << 24) for i, n in enumerate(target)], tp_size=1)
    with pytest.raises(IncompatiblePeerError, match=r"layers\.1\..*KVPP on the prefill"):
        choose_sources(local, [r0])


def test_gqa_heads_split_over_tp_read_the_same_tp_rank():
    # 8 KV heads over TP 2: rank 0 holds heads 0-3, rank 1 heads 4-7; a TP2 decode's rank 1 reads rank 1 only.
    target = names(2)
    r = [meta(t, [layer(n, (t * 8 + i + 1) << 20) for i, n in enumerate(target)], kv_heads=list(range(4 * t, 4 * t + 4)))
         for t in range(2)]
    local = meta(1, [layer(n, (i + 20) << 20) for i, n in enumerate(target)], tp_size=2, kv_heads=[4, 5, 6, 7])
    check_compatible(local, r)
    src = choose_sources(local, r)
    assert {src[n][0].tp_rank for n in target} == {1}


def test_a_replicated_gqa_head_is_read_from_every_rank_holding_it():
    # One KV head over TP 2, KVPP off: both prefill ranks hold it; a TP1 decode spreads its reads over both.
    target = names(4)
    r = [meta(t, [layer(n, (t * 8 + i + 1) << 20) for i, n in enumerate(target)], kv_heads=[0]) for t in range(2)]
    local = meta(0, [layer(n, (i + 20) << 20) for i, n in enumerate(target)], tp_size=1, kv_heads=[0])
    check_compatible(local, r)
    assert [choose_sources(local, r)[n][0].tp_rank for n in target] == [0, 1, 0, 1]


def test_a_gqa_kvpp_layer_comes_from_its_owner_in_the_decode_rank_s_head_group():
    # 2 KV heads over TP 4, KVPP on: ranks 0-1 hold head 0, ranks 2-3 head 1, each pair one replica group whose
    # first rank owns layers 0-1 and second layers 2-3. Every layer is published twice, once per head.
    target = names(4)
    r = [meta(t, [layer(n, (t * 8 + i + 1) << 20, owner=t) for i, n in enumerate(target) if i // 2 == t % 2],
              tp_size=4, kvpp=True, kv_heads=[t // 2]) for t in range(4)]
    decode = [meta(d, [layer(n, (i + 40) << 20) for i, n in enumerate(target)], tp_size=2, kv_heads=[d])
              for d in range(2)]
    for d, local in enumerate(decode):
        check_compatible(local, r)
        src = choose_sources(local, r)
        assert [src[n][0].tp_rank for n in target] == [2 * d, 2 * d, 2 * d + 1, 2 * d + 1]
        assert src[target[2]][1].base_addr == ((2 * d + 1) * 8 + 3) << 20


def test_a_decode_rank_holding_heads_no_prefill_rank_holds_is_refused_naming_the_tp_sizes_that_map():
    # 2 KV heads: a TP2 prefill holds one per rank, a TP1 decode both.
    r = [meta(t, [layer(names(1)[0], 1 << 20)], kv_heads=[t]) for t in range(2)]
    local = meta(0, [layer(names(1)[0], 2 << 20)], tp_size=1, kv_heads=[0, 1])
    with pytest.raises(IncompatiblePeerError, match=r"decode tp_rank 0 \(TP 1\) holds KV heads 0-1, but no rank of the "
                       r"TP 2 prefill holds exactly those \(they hold 0, 1\).*feeds decodes of TP 2 or 4 \(any "
                       r"multiple of 2\)"):
        check_compatible(local, r)
    assert choose_sources(meta(0, [], tp_size=1, kv_heads=[0, 1]), r) == {}


def test_an_mla_decode_is_refused_by_a_gqa_prefill():
    r = [meta(t, [layer(names(1)[0], 1 << 20)], kv_heads=[0]) for t in range(2)]
    with pytest.raises(IncompatiblePeerError, match="one side runs an MLA/SFA model, the other a GQA one"):
        check_compatible(meta(0, [layer(names(1)[0], 2 << 20)], tp_size=1), r)


@pytest.mark.parametrize("key, value", [("model", "LlamaForCausalLM/layers=4"), ("dtype", "bfloat16"),
                                        ("block_size", 32)])
def test_incompatible_prefill_is_refused(key, value):
    local = meta(0, [layer(names(1)[0], 1 << 20)], tp_size=1)
    with pytest.raises(IncompatiblePeerError, match=f"serves {key}="):
        check_compatible(local, [meta(0, [layer(names(1)[0], 1 << 20)], **{key: value})])


def test_block_geometry_mismatch_is_refused():
    local = meta(0, [layer(names(1)[0], 1 << 20)], tp_size=1)
    peer = meta(0, [layer(names(1)[0], 1 << 20, block_len=BLOCK // 2, stride=BLOCK // 2)])
    with pytest.raises(IncompatiblePeerError, match="bytes per block"):
        check_compatible(local, [peer])


def test_build_descs_addresses_and_coalescing():
    name = names(1)[0]
    peer = meta(0, [layer(name, 1 << 20, stride=2 * BLOCK)])  # interleaved remote pages
    local = {name: layer(name, 8 << 20)}
    per_peer = build_descs(local, {name: (peer, peer.layers[0])}, [4, 5, 6], [1, 2, 9])
    descs = per_peer["127.0.0.1:20000"]
    assert descs == [Desc((8 << 20) + b * BLOCK, (1 << 20) + r * 2 * BLOCK, BLOCK) for b, r in ((4, 1), (5, 2), (6, 9))]
    assert len(coalesce(descs)) == 3  # remote stride leaves gaps: nothing may merge
    dense = meta(0, [layer(name, 1 << 20)])
    merged = coalesce(build_descs(local, {name: (dense, dense.layers[0])}, [4, 5, 6], [1, 2, 3])["127.0.0.1:20000"])
    assert merged == [Desc((8 << 20) + 4 * BLOCK, (1 << 20) + BLOCK, 3 * BLOCK)]
    # dense pages: one copy per run before any coalescing
    assert build_descs(local, {name: (dense, dense.layers[0])}, [4, 5, 6], [1, 2, 3])["127.0.0.1:20000"] == merged


def test_build_descs_rejects_out_of_range_blocks():
    name = names(1)[0]
    peer = meta(0, [layer(name, 1 << 20, num_blocks=8)])
    with pytest.raises(IncompatiblePeerError, match="remote block 8"):
        build_descs({name: layer(name, 8 << 20)}, {name: (peer, peer.layers[0])}, [0], [8])
