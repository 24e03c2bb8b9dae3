"""KVPP's per-rank records read through a real Prometheus registry, as vLLM's /metrics serves them."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpp_core import metrics
from kvpp_core.broadcast import BroadcastStats
from kvpp_core.zero_copy import ZeroCopyStats

pytestmark = pytest.mark.unit


def _scrape(directory, model="tiny-mla") -> dict[str, dict[tuple[str, str, str], float]]:
    """sample name -> {(engine, pp_stage, kvpp_rank): value}, parsed from the exposition text."""
    registry = CollectorRegistry()
    registry.register(metrics.RecordCollector(directory, model))
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            assert sample.labels["model_name"] == model
            out.setdefault(sample.name, {})[(sample.labels["engine"], sample.labels["pp_stage"],
                                             sample.labels["kvpp_rank"])] = sample.value
    return out


def test_records_of_several_ranks_round_trip_through_a_registry(tmp_path):
    rank0 = metrics.RecordWriter(tmp_path, 0, 0, 0, kv_blocks=165, kv_blocks_kvpp_off=107)
    rank1 = metrics.RecordWriter(tmp_path, 0, 1, 1, kv_blocks=165, kv_blocks_kvpp_off=110)
    rank0.update(BroadcastStats(steps=9, broadcast_steps=7, layers=56, bytes=3 << 30, wait_seconds=0.5,
                                flight_seconds=2.0))
    rank1.update(BroadcastStats(steps=9, broadcast_steps=7, layers=56, bytes=5, wait_seconds=0.0, flight_seconds=1.0))
    rank0.update(BroadcastStats(steps=10, broadcast_steps=8, layers=64, bytes=(3 << 30) + 1, wait_seconds=1.0,
                                flight_seconds=4.0))  # in place: the latest totals
    got = _scrape(tmp_path)
    a, b = ("0", "0", "0"), ("0", "1", "1")
    assert got["vllm:kvpp_steps_total"] == {a: 10, b: 9}
    assert got["vllm:kvpp_broadcast_steps_total"] == {a: 8, b: 7}
    assert got["vllm:kvpp_broadcast_layers_total"] == {a: 64, b: 56}
    assert got["vllm:kvpp_broadcast_bytes_total"] == {a: (3 << 30) + 1, b: 5}
    assert got["vllm:kvpp_broadcast_seconds_total"] == {a: 4.0, b: 1.0}
    assert got["vllm:kvpp_broadcast_wait_seconds_total"] == {a: 1.0, b: 0.0}
    assert got["vllm:kvpp_prefetch_hidden_fraction"] == {a: 0.75, b: 1.0}
    assert got["vllm:kvpp_zero_copy_reads_total"] == {a: 0, b: 0}
    assert got["vllm:kvpp_kv_blocks"] == {a: 165, b: 165}
    assert got["vllm:kvpp_kv_blocks_kvpp_off"] == {a: 107, b: 110}
    assert got["vllm:kvpp_capacity_gain"] == {a: pytest.approx(165 / 107), b: pytest.approx(165 / 110)}
    exported = {name for name in got}
    assert exported == {sample for family in metrics.FAMILIES for sample in family.samples}


def test_a_rank_that_has_not_written_is_absent_and_an_empty_directory_exports_no_sample(tmp_path):
    assert _scrape(tmp_path) == {}  # the families exist, without samples
    assert _scrape(tmp_path / "removed") == {}  # the serving process removed it at exit
    metrics.RecordWriter(tmp_path, 0, 0, 0, kv_blocks=10, kv_blocks_kvpp_off=5)
    (tmp_path / "rank-0-0-1.rec").write_bytes(bytes(metrics.RECORD_BYTES))  # being created: no magic yet
    (tmp_path / "rank-0-0-2.rec").write_bytes(b"\1" * 8)  # truncated
    got = _scrape(tmp_path)
    assert got["vllm:kvpp_kv_blocks"] == {("0", "0", "0"): 10}
    assert got["vllm:kvpp_steps_total"] == {("0", "0", "0"): 0}  # created, no step yet


def test_the_hidden_fraction_is_absent_at_zero_flight_time_and_zero_copy_counts_reads(tmp_path):
    writer = metrics.RecordWriter(tmp_path, 1, 0, 0, kv_blocks=10, kv_blocks_kvpp_off=None)
    writer.update(ZeroCopyStats(steps=4, broadcast_steps=3, reads=24, waits=5, wait_seconds=0.25, bytes=0))
    got = _scrape(tmp_path)
    key = ("1", "0", "0")
    assert "vllm:kvpp_prefetch_hidden_fraction" not in got  # no flight time: nothing hidden, nothing to divide
    assert got["vllm:kvpp_broadcast_seconds_total"] == {key: 0} and got["vllm:kvpp_broadcast_bytes_total"] == {key: 0}
    assert got["vllm:kvpp_zero_copy_reads_total"] == {key: 24}
    assert got["vllm:kvpp_zero_copy_waits_total"] == {key: 5}
    assert got["vllm:kvpp_zero_copy_wait_seconds_total"] == {key: 0.25}
    assert got["vllm:kvpp_broadcast_wait_seconds_total"] == {key: 0}  # zero-copy's waits are reads, not broadcasts
    # A worker whose capacity was not planned: no KVPP-off count, so no gain either.
    assert "vllm:kvpp_kv_blocks_kvpp_off" not in got and "vllm:kvpp_capacity_gain" not in got
    assert got["vllm:kvpp_kv_blocks"] == {key: 10}
