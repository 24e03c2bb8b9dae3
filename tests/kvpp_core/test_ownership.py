"""Ownership: contiguous, lower ranks take the extra layer, empty owners, deterministic."""

import random

import pytest

from kvpp_core.ownership import assign_owners, layer_index, owner_ranges, rank_bytes_per_block, rank_layout

pytestmark = pytest.mark.unit


def test_owner_ranges_contiguous_with_extra_layer_on_low_ranks():
    ranges = owner_ranges(78, 8)
    assert [len(r) for r in ranges] == [10] * 6 + [9] * 2
    assert ranges[0] == range(0, 10) and ranges[-1] == range(69, 78)
    assert [pos for r in ranges for pos in r] == list(range(78))


def test_fewer_layers_than_ranks_leaves_empty_owners():
    ranges = owner_ranges(3, 8)
    assert [len(r) for r in ranges] == [1, 1, 1, 0, 0, 0, 0, 0]
    layout = rank_layout([5, 6, 7], 8, 6)
    assert layout.owned == () and layout.foreign == (5, 6, 7)
    assert layout.staging_slots == 2
    assert [layout.slot_of(l) for l in (5, 6, 7)] == [0, 1, 0]


def test_assign_owners_independent_of_input_order_and_duplicates():
    ids = list(range(38, 78))  # stage 1 of a 38/40 split
    expected = assign_owners(ids, 8)
    shuffled = ids * 2
    random.Random(7).shuffle(shuffled)
    assert assign_owners(shuffled, 8) == expected
    assert assign_owners(set(ids), 8) == expected
    assert expected[38] == 0 and expected[42] == 0 and expected[43] == 1 and expected[77] == 7


def test_rank_layout_is_deterministic_and_partitions_the_stage():
    ids = [3, 1, 2, 0, 4]
    layouts = [rank_layout(ids, 2, rank) for rank in range(2)]
    assert layouts == [rank_layout(sorted(ids), 2, rank) for rank in range(2)]
    assert layouts[0].owned == (0, 1, 2) and layouts[1].owned == (3, 4)
    assert layouts[1].foreign == (0, 1, 2)


def test_staging_slots_follow_execution_position():
    layout = rank_layout(range(10), 4, 1)  # owns 3-5
    assert layout.owned == (3, 4, 5)
    assert [layout.slot_of(l) for l in layout.foreign] == [0, 1, 0, 0, 1, 0, 1]
    assert layout.prefetch_depth == 1
    with pytest.raises(ValueError, match="owned by rank 1"):
        layout.slot_of(4)


def test_single_rank_group_needs_no_staging():
    layout = rank_layout(range(16), 1, 0, staging=2)
    assert layout.owned == tuple(range(16)) and layout.staging_slots == 0 and layout.prefetch_depth == 0


def test_staging_capped_by_foreign_count():
    layout = rank_layout(range(2), 2, 0, staging=3)
    assert layout.staging_slots == 1


def test_rank_bytes_per_block_uses_largest_foreign_bundle_for_staging():
    layout = rank_layout(range(4), 2, 0)  # owns 0,1; foreign 2,3
    sizes = {0: 10, 1: 10, 2: 30, 3: 20}
    assert rank_bytes_per_block(layout, sizes) == 10 + 10 + 2 * 30
    assert rank_bytes_per_block(layout, sizes, [7]) == 10 + 10 + 7 + 2 * 30


@pytest.mark.parametrize(
    "name, index",
    [
        ("model.layers.7.self_attn.attn", 7),
        ("model.layers.12.self_attn.indexer.k_cache", 12),
        ("layers.0.attn", 0),
        ("model.layers.78.mtp_block.attn", 78),
    ],
)
def test_layer_index(name, index):
    assert layer_index(name) == index


def test_layer_index_without_index_is_an_error():
    with pytest.raises(ValueError, match="cannot find a decoder layer index"):
        layer_index("model.embed_tokens")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: owner_ranges(4, 0), "group size must be >= 1"),
        (lambda: owner_ranges(-1, 2), "number of layers must be >= 0"),
        (lambda: rank_layout(range(4), 2, 2), "outside a group of 2"),
        (lambda: rank_layout(range(4), 2, 0, staging=-1), "staging buffer count must be >= 0"),
    ],
)
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_zero_copy_layout_has_no_slot_and_costs_only_owned_bundles():
    layout = rank_layout(range(10), 4, 3, staging=0)
    assert layout.zero_copy and layout.staging_slots == 0 and layout.prefetch_depth == 0
    assert layout.owned == (8, 9) and layout.foreign == tuple(range(8))
    with pytest.raises(ValueError, match="read in place from kvpp rank 0"):
        layout.slot_of(0)
    assert rank_bytes_per_block(layout, {l: 100 for l in range(10)}, [100]) == 3 * 100  # 2 owned + MTP


def test_zero_copy_is_moot_in_a_group_of_one():
    assert not rank_layout(range(4), 1, 0, staging=0).zero_copy
