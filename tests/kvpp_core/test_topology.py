"""Cache-replica groups: an MLA stage's TP ranks, or the TP ranks of one GQA KV head."""

import pytest

from kvpp_core.topology import Topology

pytestmark = pytest.mark.unit


def test_mla_group_is_the_stage_tp_ranks():
    topo = Topology(tp=8)
    assert (topo.group_size, topo.groups_per_stage) == (8, 1)
    assert [topo.kvpp_rank(0, r) for r in range(8)] == list(range(8))
    assert {topo.replica_group(r) for r in range(8)} == {0} and topo.kv_heads_of(3) is None


def test_gqa_groups_are_the_ranks_of_one_kv_head():
    """vLLM gives rank r KV head r // (TP / n_kv): TP8 over 4 heads makes 4 groups of 2 contiguous ranks."""
    topo = Topology(tp=8, kv_heads=4)
    assert (topo.group_size, topo.groups_per_stage) == (2, 4)
    assert [topo.replica_group(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [topo.kvpp_rank(0, r) for r in range(8)] == [0, 1] * 4
    assert [list(topo.kv_heads_of(r)) for r in (0, 1, 2, 7)] == [[0], [0], [1], [3]]
    assert "4 per PP stage, one per KV head: its 2 TP ranks (ranks 0-1, 2-3, 4-5, 6-7)" in topo.describe_group()


def test_gqa_without_replication_has_groups_of_one():
    topo = Topology(tp=2, kv_heads=8)
    assert (topo.group_size, topo.groups_per_stage) == (1, 2)
    assert [list(topo.kv_heads_of(r)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert topo.describe_group().startswith("none: TP 2 does not exceed the 8 KV heads")


def test_one_kv_head_on_every_rank_is_one_group():
    topo = Topology(tp=4, pp=2, kv_heads=1)
    assert (topo.group_size, topo.groups_per_stage) == (4, 1) and topo.kvpp_rank(0, 3) == 3


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_kv_heads_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="kv_heads must be an integer >= 1"):
        Topology(tp=2, kv_heads=bad)
