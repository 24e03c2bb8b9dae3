"""MooncakeConnectorV2's stats: aggregation across workers, pickling, and the counters Prometheus reads."""

from __future__ import annotations

import pickle

import pytest

from connectors.mooncake.stats import MooncakeV2Stats

pytestmark = pytest.mark.unit


def test_stats_aggregate_reduce_and_pickle():
    a = MooncakeV2Stats()
    assert a.is_empty()
    a.record_transfer(1_000_000, 0.5, 3)
    a.record_failure()
    snap = a.clone_and_reset()
    assert a.is_empty()
    b = pickle.loads(pickle.dumps(snap))
    b.aggregate(MooncakeV2Stats(data={"bytes": 1_000_000, "transfers": 1, "failures": 0, "seconds": 0.5, "entries": 1}))
    red = b.reduce()
    assert red["pulled_bytes"] == 2_000_000 and red["pulled_requests"] == 2 and red["failed_pulls"] == 1
    assert red["throughput_MBps"] == 2.0 and red["batch_entries"] == 4


def test_refusals_and_leases_are_counted_in_stats_and_prometheus_keys():
    from connectors.mooncake.stats import MooncakeV2PromMetrics

    stats = MooncakeV2Stats()
    for code in ("unauthorized", "unknown_request", "malformed", "malformed", "expired", "internal"):
        stats.record_refusal(code)
    stats.record_leases(renewed=3)
    stats.record_leases(lapsed=1)
    assert not stats.is_empty()
    out = stats.clone_and_reset().reduce()
    assert (out["refused_requests"], out["malformed_frames"]) == (2, 2)
    assert (out["lease_renewals"], out["lapsed_holds"]) == (3, 1)
    assert {"refused", "malformed", "renewed", "lapsed"} <= set(MooncakeV2PromMetrics.COUNTERS)


def test_given_up_pulls_and_reissued_reads_are_counted_in_stats_and_prometheus_keys():
    from connectors.mooncake.stats import MooncakeV2PromMetrics

    stats = MooncakeV2Stats()
    stats.record_failure(stalled=True)
    stats.record_failure()  # a refused or reset connection: failed, not stalled
    stats.record_transfer(4096, 0.01, 2, retried=1)
    out = stats.clone_and_reset().reduce()
    assert (out["failed_pulls"], out["stalled_pulls"], out["retried_reads"], out["pulled_requests"]) == (2, 1, 1, 1)
    counters = MooncakeV2PromMetrics.COUNTERS
    assert counters["stalled"][0] == "vllm:mooncake_v2_stalled_pulls" and counters["retried"][0] == "vllm:mooncake_v2_retried_reads"
