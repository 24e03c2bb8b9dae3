"""Prometheus counters for a connector's summed stats, shared by both connectors.

Every connector that reports `KVConnectorStats` must also export them: vLLM's MultiConnector (P/D
plus a pool on one prefill node) refuses stats from a child without Prometheus metrics, and that
failure takes the API server's output loop down.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine


class CounterPromMetrics(KVConnectorPromMetrics):
    """One counter per stats key (vLLM appends `_total`), one child per engine.

    Subclasses set `COUNTERS`: stats key -> (metric name, documentation).
    """

    COUNTERS: Mapping[str, tuple[str, str]] = {}

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues,
            )
            for key, (name, doc) in self.COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                per_engine[engine_idx].inc(value)
