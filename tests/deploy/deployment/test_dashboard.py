"""The Grafana dashboard queries only what the code exports, covers every KVPP family and connector counter,
and `kvpp render --format k8s` ships it as a ConfigMap Grafana's sidecar loads."""

import json
import re

import pytest
import yaml

from connectors.mooncake.stats import MooncakeV2PromMetrics
from connectors.store.stats import StorePromMetrics
from deploy.cli.main import main
from deploy.deployment import dashboard
from kvpp_core import metrics
from tests.helpers.paths import REPO

pytestmark = pytest.mark.unit

EXAMPLE = REPO / "deploy" / "deployment" / "examples" / "pd-one-host.yaml"


def _exported() -> set[str]:
    """Every sample name KVPP and the connectors put on /metrics (vLLM appends `_total` to a counter)."""
    connectors = {f"{name}_total" for cls in (MooncakeV2PromMetrics, StorePromMetrics) for name, _ in cls.COUNTERS.values()}
    return connectors | {sample for family in metrics.FAMILIES for sample in family.samples}


def _queries(board: dict) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    return exprs + [v["definition"] for v in board["templating"]["list"] if "definition" in v]


def _queried(board: dict) -> set[str]:
    return {name for expr in _queries(board) for name in re.findall(r"vllm:[A-Za-z0-9_:]+", expr)}


def test_every_query_reads_an_exported_metric_and_every_kvpp_family_has_a_panel():
    board = json.loads(dashboard.dashboard_json())
    queried = _queried(board)
    assert queried <= _exported(), f"queried but not exported: {sorted(queried - _exported())}"
    assert queried == _exported(), f"exported without a panel: {sorted(_exported() - queried)}"
    # Each panel reads from the dashboard's Prometheus datasource variable.
    assert board["templating"]["list"][0] == {"name": "datasource", "label": "Prometheus", "type": "datasource",
                                              "query": "prometheus"}
    assert all(t["datasource"]["uid"] == "${datasource}" for p in board["panels"] for t in p.get("targets", []))


def _apart(board: dict) -> list[str]:
    """The KVPP per-rank queries and legends that would merge ranks of different cache-replica groups: a GQA stage
    has one group per KV head, each with kvpp ranks 0..G-1, told apart only by the replica_group label."""
    merged = []
    for target in (t for p in board["panels"] for t in p.get("targets", []) if "vllm:kvpp_" in t["expr"]):
        for by in re.findall(r"\bby \(([^)]*)\)", target["expr"]):
            if "kvpp_rank" in by and {label.strip() for label in by.split(",")} != set(metrics.LABELS):
                merged.append(target["expr"])
        if "{{kvpp_rank}}" in target["legendFormat"] and "{{replica_group}}" not in target["legendFormat"]:
            merged.append(target["legendFormat"])
    return merged


def test_per_rank_kvpp_panels_keep_each_replica_groups_ranks_apart():
    board = json.loads(dashboard.dashboard_json())
    assert _apart(board) == []
    broken = json.loads(dashboard.dashboard_json().replace("pp_stage, replica_group, kvpp_rank", "pp_stage, kvpp_rank"))
    assert len(_apart(broken)) > 5, "the check catches a sum that adds two heads' ranks together"


def test_the_check_catches_a_panel_querying_a_metric_nobody_exports():
    board = json.loads(dashboard.dashboard_json())
    board["panels"][1]["targets"][0]["expr"] = "rate(vllm:kvpp_broadcast_byte_total[5m])"  # a typo
    assert not _queried(board) <= _exported()


def test_render_ships_the_dashboard_as_a_configmap_with_the_sidecar_label(tmp_path):
    assert main(["render", str(EXAMPLE), "--format", "k8s", "--out", str(tmp_path)]) == 0
    (configmap,) = yaml.safe_load_all((tmp_path / "grafana-dashboard.yaml").read_text())
    assert configmap["kind"] == "ConfigMap" and configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["kvpp.json"]) == json.loads(dashboard.dashboard_json())
