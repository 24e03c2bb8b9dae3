"""bench/gqa_capacity.py: the committed results are the planner's figures today, and docs/gqa.md shows them."""

import json

import pytest

from bench.gqa_capacity import RESULTS, markdown, report
from tests.helpers.paths import REPO

pytestmark = pytest.mark.unit


def test_the_committed_figures_are_the_planners():
    committed = json.loads(RESULTS.read_text())
    assert committed == json.loads(json.dumps(report(committed["memory_gib_per_rank"])))


def test_the_docs_table_is_the_results_file():
    assert markdown(json.loads(RESULTS.read_text())) in (REPO / "docs" / "gqa.md").read_text()


def test_each_kv_head_group_holds_its_layers_once():
    """Qwen3-235B-A22B at TP8 and Llama-3.1-405B at TP16: each KV head on 2 ranks, each rank owning half the layers;
    Qwen3-235B at TP4 and the hybrids are refused."""
    rows = {(r["model"], r["tp"]): r for r in report(32.0)["rows"]}
    for key, layers in ((("qwen3-235b-a22b", 8), 94), (("llama-3.1-405b", 16), 126)):
        modes = {m["name"]: m["ratio"] for m in rows[key]["modes"]}
        owned = layers // 2
        assert rows[key]["group_ranks"] == 2 and modes == pytest.approx(
            {"KVPP off": 1.0, "staging 2": layers / (owned + 2), "staging 1": layers / (owned + 1),
             "zero-copy": 2.0}, rel=2e-3)
    assert "no KV head of qwen3-235b-a22b is replicated at TP 4" in rows["qwen3-235b-a22b", 4]["refused"]
    assert "is a hybrid model" in rows["qwen3.5-397b-a17b", 16]["refused"]
