"""KVPP placement of caches inside one backing allocation."""

from __future__ import annotations

import pytest

from kvpp_core.allocation import CacheLayer, bytes_per_block, logical_bytes_per_block, place
from kvpp_core.ownership import rank_layout

pytestmark = pytest.mark.unit

PAGE = 36864  # 16 tokens x 576 x fp32


def _mla(num_layers: int, mtp: int = 0) -> list[CacheLayer]:
    layers = [CacheLayer(f"model.layers.{i}.self_attn.attn", PAGE, i) for i in range(num_layers)]
    layers += [CacheLayer(f"model.layers.{num_layers + j}.mtp.attn", PAGE, None) for j in range(mtp)]
    return layers


def test_owned_then_mtp_then_staging_slots_and_foreign_layers_alias_by_parity():
    layers = _mla(16, mtp=1)
    layout = rank_layout(range(16), 2, 1)
    p = place(layers, layout, num_blocks=10)
    region = PAGE * 10
    assert p.persistent == tuple(f"model.layers.{i}.self_attn.attn" for i in range(8, 16)) + (
        "model.layers.16.mtp.attn",
    )
    assert [p.offsets[n] for n in p.persistent] == [i * region for i in range(9)]
    slot0, slot1 = 9 * region, 10 * region
    for i in range(8):
        assert p.offsets[f"model.layers.{i}.self_attn.attn"] == (slot0 if i % 2 == 0 else slot1)
    assert p.staging == (
        tuple(f"model.layers.{i}.self_attn.attn" for i in (0, 2, 4, 6)),
        tuple(f"model.layers.{i}.self_attn.attn" for i in (1, 3, 5, 7)),
    )
    assert p.total_bytes == 11 * region == bytes_per_block(layers, layout) * 10


def test_bundle_of_main_and_indexer_cache_stays_together_in_one_slot():
    layers = []
    for i in range(4):
        layers.append(CacheLayer(f"model.layers.{i}.self_attn.attn", PAGE, i))
        layers.append(CacheLayer(f"model.layers.{i}.self_attn.indexer.k_cache", 2048, i))
    layout = rank_layout(range(4), 2, 0)
    p = place(layers, layout, num_blocks=4)
    bundle = (PAGE + 2048) * 4
    main2, idx2 = "model.layers.2.self_attn.attn", "model.layers.2.self_attn.indexer.k_cache"
    assert p.offsets[main2] == 2 * bundle  # layer 2 is foreign, slot 0 starts after two owned bundles
    assert p.offsets[idx2] == p.offsets[main2] + PAGE * 4
    assert p.offsets["model.layers.3.self_attn.attn"] == 3 * bundle  # slot 1
    assert p.total_bytes == 4 * bundle
    assert p.span(idx2) == slice(2 * bundle + PAGE * 4, 3 * bundle)  # its whole allocation, up to slot 1


def test_group_of_one_has_no_staging_and_matches_the_replicated_layout():
    layers = _mla(5)
    layout = rank_layout(range(5), 1, 0)
    assert layout.staging_slots == 0
    assert bytes_per_block(layers, layout) == logical_bytes_per_block(layers) == 5 * PAGE


def test_rank_owning_nothing_keeps_only_staging():
    layers = _mla(3)
    layout = rank_layout(range(3), 4, 3)
    p = place(layers, layout, num_blocks=2)
    assert p.persistent == ()
    assert p.total_bytes == 2 * PAGE * 2


def test_placement_refuses_a_layout_naming_layers_without_caches():
    with pytest.raises(ValueError, match="no cache"):
        place(_mla(2), rank_layout(range(3), 2, 0), num_blocks=1)


def test_zero_copy_keeps_only_persistent_pages_and_borrows_the_foreign_caches():
    layers = _mla(5) + [CacheLayer("model.layers.5.self_attn.attn", PAGE, None)]  # + an MTP cache
    layout = rank_layout(range(5), 2, 1, staging=0)
    p = place(layers, layout, num_blocks=3)
    assert p.staging == () and p.persistent == tuple(f"model.layers.{i}.self_attn.attn" for i in (3, 4, 5))
    assert p.borrowed == tuple(f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2))
    assert p.total_bytes == 3 * PAGE * 3 == 3 * bytes_per_block(layers, layout)
    assert {p.offsets[n] for n in p.borrowed} == {0}  # placeholders until the runtime rebinds them


def test_zero_copy_rank_owning_nothing_cannot_carve_its_views():
    with pytest.raises(ValueError, match="it must own a layer"):
        place(_mla(3), rank_layout(range(3), 4, 3, staging=0), num_blocks=2)
