"""The Grafana dashboard of KVPP's and the connectors' metrics (grafana/kvpp.json), as `kvpp render` ships it.

Its queries read only metrics this package exports, and its per-rank KVPP panels keep each cache-replica group's
ranks apart by every label of kvpp_core.metrics.LABELS (a GQA stage has one group per KV head, each with kvpp ranks
0..G-1); tests/deploy/deployment/test_dashboard.py checks both."""

from __future__ import annotations

from importlib import resources
from typing import Any

DASHBOARD_FILE = "kvpp.json"
CONFIGMAP = "kvpp-grafana-dashboard"
SIDECAR_LABEL = "grafana_dashboard"
"""The label Grafana's dashboard sidecar (the Helm chart's `sidecar.dashboards`) collects ConfigMaps by."""


def dashboard_json() -> str:
    return (resources.files("deploy.deployment") / "grafana" / DASHBOARD_FILE).read_text()


def configmap(namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    """The dashboard as a ConfigMap Grafana's sidecar loads."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": CONFIGMAP, "namespace": namespace, "labels": {**labels, SIDECAR_LABEL: "1"}},
            "data": {DASHBOARD_FILE: dashboard_json()}}
