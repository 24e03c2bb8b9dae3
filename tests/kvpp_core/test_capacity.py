"""Capacity plan: the anchors' structural figures and per-rank bytes from the shared ownership."""

from dataclasses import replace

import pytest

from kvpp_core.capacity import plan_capacity
from kvpp_core.model import PRESETS, ModelSpec
from kvpp_core.topology import Topology

pytestmark = pytest.mark.unit

GIB = 1 << 30
GLM = PRESETS["glm-5.2"].with_overrides(mtp_layers=0)  # the anchors ran without MTP
PAGE = GLM.page_bytes(128)


def test_glm_tp8_gives_78_over_12():
    plan = plan_capacity(GLM, Topology(tp=8), 60 * GIB)
    assert plan.ratio == pytest.approx(78 / 12, rel=1e-3)
    assert plan.memory_saving == pytest.approx(1 - 12 / 78, rel=1e-3)
    assert plan.tokens_on == plan.blocks_on * 128 and plan.tokens_off == plan.blocks_off * 128


def test_glm_tp8_one_staging_slot_gives_78_over_11():
    assert plan_capacity(GLM, Topology(tp=8), 60 * GIB, staging=1).ratio == pytest.approx(78 / 11, rel=1e-3)


def test_glm_tp8_pp2_equal_memory_gives_40_over_7():
    plan = plan_capacity(GLM, Topology(tp=8, pp=2, pp_layers=(38, 40)), 60 * GIB)
    assert plan.ratio == pytest.approx(40 / 7, rel=1e-3)
    assert plan.binding_stages_off == (1,)  # 40 replicated layers bind without KVPP
    assert plan.binding_stages_on == (0, 1)  # both stages need 5 owned + 2 staging


def test_glm_tp8_pp2_stage0_with_less_memory_gives_38_over_7():
    plan = plan_capacity(GLM, Topology(tp=8, pp=2, pp_layers=(38, 40)), [55 * GIB, 60 * GIB])
    assert plan.ratio == pytest.approx(38 / 7, rel=1e-3)
    assert plan.binding_stage_off == 0 and plan.binding_stages_on == (0,)


def test_per_rank_bytes_come_from_ownership():
    plan = plan_capacity(GLM, Topology(tp=8), 60 * GIB)
    (stage,) = plan.stages
    assert [len(r.owned) for r in stage.ranks] == [10] * 6 + [9] * 2
    assert [r.owned_range for r in stage.ranks][:2] == ["0-9", "10-19"]
    assert all(r.bytes_per_block_off == 78 * PAGE for r in stage.ranks)
    assert [r.bytes_per_block_on for r in stage.ranks] == [12 * PAGE] * 6 + [11 * PAGE] * 2
    assert [r.blocks_on for r in stage.ranks] == [60 * GIB // (12 * PAGE)] * 6 + [60 * GIB // (11 * PAGE)] * 2
    assert plan.blocks_on == min(r.blocks_on for r in stage.ranks)
    owned = sorted(l for r in stage.ranks for l in r.owned)
    assert owned == list(range(78))  # every layer exactly once


def test_mtp_is_replicated_on_the_last_stage_only():
    model = PRESETS["glm-5.2"]  # ships 1 MTP layer
    plan = plan_capacity(model, Topology(tp=8, pp=2, pp_layers=(38, 40)), 60 * GIB)
    first, last = plan.stages
    assert first.mtp_layers == () and last.mtp_layers == (78,)
    assert first.ranks[0].bytes_per_block_off == 38 * PAGE
    assert last.ranks[0].bytes_per_block_off == 41 * PAGE
    assert last.ranks[0].bytes_per_block_on == (5 + 1 + 2) * PAGE
    assert plan_capacity(model, Topology(tp=8), 60 * GIB).ratio == pytest.approx(79 / 13, rel=1e-3)


def test_tp1_without_pcp_is_inert():
    plan = plan_capacity(GLM, Topology(tp=1), 60 * GIB)
    assert plan.ratio == 1.0
    assert plan.stages[0].ranks[0].staging_slots == 0


def test_pcp_joins_the_group_only_on_runner_v2():
    v2 = plan_capacity(GLM, Topology(tp=8, pcp=2, runner="v2"), 60 * GIB)
    assert len(v2.stages[0].ranks) == 16
    assert v2.ratio == pytest.approx(78 / (5 + 2), rel=1e-3)
    v1 = plan_capacity(GLM, Topology(tp=8, pcp=2, runner="v1"), 60 * GIB)
    assert len(v1.stages[0].ranks) == 8


def test_more_ranks_than_layers_on_a_stage():
    tiny = PRESETS["kvpp-tiny"]
    plan = plan_capacity(tiny, Topology(tp=4, pp=8), 256 << 20, block_size=16)
    stage = plan.stages[0]
    assert [len(r.owned) for r in stage.ranks] == [1, 1, 0, 0]
    # owners keep 1 layer + 1 staging slot (one foreign layer); empty owners keep 2 staging slots
    assert [r.bytes_per_block_on for r in stage.ranks] == [2 * tiny.page_bytes(16)] * 4
    assert plan.ratio == 1.0


def test_tiny_model_block_size_16():
    tiny = PRESETS["kvpp-tiny"]
    plan = plan_capacity(tiny, Topology(tp=2), 64 << 20, block_size=16)
    assert tiny.page_bytes(16) == 16 * 576 * 4
    assert plan.stages[0].ranks[0].bytes_per_block_on == (8 + 2) * tiny.page_bytes(16)
    assert plan.ratio == pytest.approx(16 / 10, rel=1e-2)


def test_to_json_has_the_documented_keys():
    data = plan_capacity(GLM, Topology(tp=8, pp=2, pp_layers=(38, 40)), 60 * GIB).to_json()
    for key in ("ratio", "tokens_off", "tokens_on", "blocks_off", "blocks_on", "memory_saving",
                "binding_stage_off", "binding_stage_on", "stages", "model", "topology"):
        assert key in data
    assert data["stages"][1]["layers"] == [38, 77]
    assert data["stages"][0]["ranks"][0]["owned"] == [0, 1, 2, 3, 4]
    assert data["topology"]["pp_layers"] == [38, 40] and data["topology"]["group_size"] == 8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(model=GLM, topo=Topology(tp=3), memory_bytes=GIB), "TP 3 does not divide the 64 attention heads"),
        (dict(model=GLM, topo=Topology(tp=8, pp=2, pp_layers=(38, 39)), memory_bytes=GIB), "sums to 77"),
        (dict(model=GLM, topo=Topology(tp=8, pp=2), memory_bytes=[GIB] * 3), "one per PP stage"),
        (dict(model=GLM, topo=Topology(tp=8), memory_bytes=-1), "positive number of bytes"),
        (dict(model=GLM, topo=Topology(tp=8), memory_bytes=1000), "less than one block without KVPP"),
        (dict(model=ModelSpec("llama", 32, 0, 0, 0, attention="mha"), topo=Topology(tp=8), memory_bytes=GIB),
         "uses mha attention; KVPP plans MLA/SFA and GQA models"),
    ],
)
def test_bad_plans_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_capacity(**kwargs)


@pytest.mark.parametrize("layers, pp", [(78, 2), (78, 4), (61, 2), (61, 4), (10, 3), (27, 8), (16, 16)])
def test_even_pp_split_matches_vllm(layers, pp, monkeypatch):
    utils = pytest.importorskip("vllm.distributed.utils")
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    expected = [range(*utils.get_pp_indices(layers, rank, pp)) for rank in range(pp)]
    assert Topology(tp=1, pp=pp).stage_layers(layers) == expected


def test_topology_groups_and_ranks():
    assert Topology(tp=8).group_size == 8
    assert Topology(tp=4, pcp=2, runner="v2").group_size == 8
    assert Topology(tp=4, pcp=2, runner="v2").kvpp_rank(pcp_rank=1, tp_rank=3) == 7
    assert Topology(tp=4, pcp=2, runner="v1").kvpp_rank(pcp_rank=1, tp_rank=3) == 3
    assert Topology(tp=8, dp=4).group_size == 8  # never spans DP replicas
    assert Topology(tp=2, pp=2, pp_layers=[38, 40]).stage_layers(78) == [range(0, 38), range(38, 78)]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: Topology(tp=0), "tp must be an integer >= 1"),
        (lambda: Topology(tp=2, runner="v3"), "runner must be one of v1, v2"),
        (lambda: Topology(tp=2, pp=3, pp_layers=(38, 40)), "has 2 stages but pp is 3"),
        (lambda: Topology(tp=2, pp=2, pp_layers=(78, 0)), "every PP stage needs at least one layer"),
        (lambda: Topology(tp=2, pp=4).stage_layers(3), "pp 4 exceeds the model's 3 layers"),
        (lambda: Topology(tp=2).kvpp_rank(0, 2), "tp_rank 2 outside 0..1"),
    ],
)
def test_bad_topologies(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_zero_copy_reaches_the_layer_granular_limit():
    plan = plan_capacity(GLM, Topology(tp=8), 60 * GIB, staging=0)
    assert plan.ratio == pytest.approx(78 / 10, rel=1e-3)
    assert plan.zero_copy and plan.to_json()["mode"] == "zero-copy" and "one x86-64 CPU host" in plan.mode
    assert {r.staging_slots for r in plan.stages[0].ranks} == {0}
    even = plan_capacity(replace(PRESETS["deepseek-v2-lite"], num_layers=26), Topology(tp=2), 8 * GIB, staging=0)
    assert even.ratio == pytest.approx(2.0, rel=1e-3)


def test_zero_copy_with_pp_and_mtp_counts_each_stage_alone():
    plan = plan_capacity(GLM.with_overrides(mtp_layers=1), Topology(tp=8, pp=2, pp_layers=(38, 40)), 60 * GIB,
                         staging=0)
    # stage 1: 40 layers + MTP replicated -> 41 / (5 + 1); stage 0: 38 / 5.
    assert plan.binding_stages_on == (1,)
    assert plan.ratio == pytest.approx(41 / 6, rel=1e-3)


def test_zero_copy_refuses_a_stage_with_fewer_layers_than_ranks():
    with pytest.raises(ValueError, match="kvpp_staging_buffers 0 .* stage 1 \\(3 layers\\).*set kvpp_staging_buffers"):
        plan_capacity(GLM, Topology(tp=4, pp=2, pp_layers=(75, 3)), 60 * GIB, staging=0)


def test_gqa_plan_shards_within_each_kv_heads_ranks():
    """Qwen3-235B-A22B on TP8: 4 KV heads, each on 2 ranks; 94 layers over a group of 2 (47 each) plus 2 staging
    slots against 94 replicated layers: 94 / 49 = 1.92x, and zero-copy's layer-granular limit 94 / 47 = 2x."""
    model = PRESETS["qwen3-235b-a22b"]
    plan = plan_capacity(model, Topology(tp=8), GIB, 128)
    assert plan.topology.kv_heads == 4 and plan.topology.group_size == 2
    assert [len(r.owned) for r in plan.stages[0].ranks] == [47, 47]
    page = model.page_bytes(128, 8)
    assert page == 128 * 2 * 128 * 2
    assert plan.stages[0].ranks[0].bytes_per_block_on == 49 * page and plan.stages[0].ranks[0].bytes_per_block_off == 94 * page
    assert plan.ratio == pytest.approx((GIB // (49 * page)) / (GIB // (94 * page)))
    assert plan_capacity(model, Topology(tp=8), GIB, 128, staging=0).ratio == pytest.approx(2.0, abs=0.01)
    assert "one per KV head" in plan.to_json()["replica_group"]


def test_gqa_plan_is_refused_where_no_head_is_replicated():
    with pytest.raises(ValueError, match="no KV head of qwen3-235b-a22b is replicated at TP 4"):
        plan_capacity(PRESETS["qwen3-235b-a22b"], Topology(tp=4), GIB)
    with pytest.raises(ValueError, match="is hybrid: 36 of its 48 layers are linear_attention"):
        plan_capacity(PRESETS["qwen3-next-80b-a3b"], Topology(tp=8), GIB)
