"""KVPP's metrics: what the broadcasters count as waited and in flight, and the per-rank records read
through a real Prometheus registry, as vLLM's /metrics serves them."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpp_core import broadcast, metrics, shm_broadcast, zero_copy
from kvpp_core.broadcast import BroadcastStats
from kvpp_core.ownership import rank_layout
from kvpp_core.zero_copy import ZeroCopyStats
from tests.helpers.clock import Clock

COPY_S, COMPUTE_S, NAP_S = 0.010, 0.004, 0.005
"""What one layer's copy and one layer's compute take on the test's clock, and one nap of a rank polling a
peer's flag."""


def _peer_acting_while_polled(monkeypatch) -> tuple[Clock, list]:
    """The broadcasters' clock, moved by hand, and the actions a peer takes while this rank polls its flags:
    each nap of a poll takes NAP_S and lets the peer take its next action."""
    clock, peer_acts = Clock(), []

    def nap(_seconds: float) -> None:
        clock.now += NAP_S
        peer_acts.pop(0)()

    monkeypatch.setattr(broadcast, "time", SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(zero_copy, "time", SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(shm_broadcast, "time", SimpleNamespace(perf_counter=clock, monotonic=clock, sleep=nap))
    return clock, peer_acts


def _control_segments(layout) -> list[memoryview]:
    """Both ranks' control segments, as plain arrays."""
    return [memoryview(bytearray(8 * shm_broadcast.layer_flag(len(layout.target_layers)))).cast("q")
            for _ in range(layout.group_size)]


def _sets(flags: memoryview, slot: int):
    return lambda: flags.__setitem__(slot, 1)


def _shm_rank1(monkeypatch, published: set[int], read: set[int]):
    """Kvpp rank 1 of 2 over 4 layers (owns 2 and 3; two staging slots, so one layer of prefetch) as
    ShmLayerBroadcaster runs it, every copy taking COPY_S. Its peer has published the layers in `published`
    and copied rank 1's layers in `read`. Returns the broadcaster, the peer's flags, the clock and the
    peer's actions while polled."""
    clock, peer_acts = _peer_acting_while_polled(monkeypatch)
    layout = rank_layout(range(4), 2, 1, 2)
    flags = _control_segments(layout)
    for lid in published:
        flags[0][shm_broadcast.layer_flag(layout.position(lid))] = 1  # the peer's ready flag of step 1
    for lid in read:
        flags[0][shm_broadcast.layer_flag(layout.position(lid)) + 1] = 1  # its read flag of step 1
    blocks, page = 4, 16
    regions = {lid: [torch.zeros(blocks, page, dtype=torch.uint8)] for lid in layout.target_layers}
    sources = {lid: [torch.full((blocks, page), lid + 1, dtype=torch.uint8)] for lid in layout.foreign}
    group = SimpleNamespace(flags=flags, pids=[None, None], kv=[None, None])
    bc = shm_broadcast.ShmLayerBroadcaster(layout, regions, sources, blocks, group, timeout=5.0)
    copy = bc._copy

    def timed_copy(*args):
        copy(*args)
        clock.now += COPY_S

    monkeypatch.setattr(bc, "_copy", timed_copy)
    return bc, flags[0], clock, peer_acts


def _forward(bc, clock, between=lambda lid: None) -> None:
    """One step's forward: each target layer, then its compute."""
    bc.begin_step(True)
    for lid in bc.layout.target_layers:
        bc.before_layer(lid)
        clock.now += COMPUTE_S
        between(lid)
    bc.end_step()


def _hidden(stats) -> float:
    record = {**dict.fromkeys(metrics.SLOTS, 0.0), **metrics.stats_values(stats), "kv_blocks_kvpp_off": 0.0}
    return metrics.derived(record)["prefetch_hidden_fraction"]


@pytest.mark.unit
def test_a_copy_made_at_its_issue_is_waited_for(monkeypatch):
    """The owner published before the receiver got there, so the receiver copies layers 0 and 1 when it
    issues them (layer 1 as layer 0's prefetch), on its forward's thread: both copies are waited for, and
    in flight only while they are made. Its own layers were copied by the peer already: no wait, and no
    flight either (it moves nothing). Nothing is hidden (before the fix: wait 0, hidden fraction 1)."""
    bc, _, clock, _ = _shm_rank1(monkeypatch, published={0, 1}, read={2, 3})
    _forward(bc, clock)
    assert all(torch.equal(bc._blocks[lid][0], bc._sources[lid][0]) for lid in bc.layout.foreign)
    assert bc.stats.layers == 4
    assert bc.stats.wait_seconds == pytest.approx(2 * COPY_S)
    assert bc.stats.flight_seconds == bc.stats.wait_seconds
    assert _hidden(bc.stats) == 0


@pytest.mark.unit
def test_a_copy_deferred_to_its_wait_and_an_owners_wait_for_its_reader_are_waited_for(monkeypatch):
    """Layer 1 is issued (layer 0's prefetch) before its owner published it, which happens while rank 1
    computes layer 0: nothing moves it until rank 1's forward copies it at its wait, so that compute is not
    flight. Rank 1's layer 3 is copied by its reader while rank 1 polls for it, one nap: waited."""
    bc, peer, clock, peer_acts = _shm_rank1(monkeypatch, published={0}, read={2})
    peer_acts.append(_sets(peer, shm_broadcast.layer_flag(3) + 1))

    def publish(lid):
        if lid == 0:
            peer[shm_broadcast.layer_flag(1)] = 1

    _forward(bc, clock, publish)
    assert peer_acts == []
    assert bc.stats.wait_seconds == pytest.approx(2 * COPY_S + NAP_S)
    assert bc.stats.flight_seconds == bc.stats.wait_seconds
    assert _hidden(bc.stats) == 0


@pytest.mark.unit
def test_zero_copy_counts_every_wait_on_a_peer_the_step_edges_too(monkeypatch):
    """Kvpp rank 0 of 2 over 4 layers (owns 0 and 1) in zero-copy. It waits for its peer's forward to begin
    before its first write, for the peer's write of layer 2 before reading it, and at the next step's start
    for the peer to finish the step: three waits of one nap each, all the forward's."""
    clock, peer_acts = _peer_acting_while_polled(monkeypatch)
    layout = rank_layout(range(4), 2, 0, 0)
    flags = _control_segments(layout)
    zc = zero_copy.ZeroCopyLayers(layout, SimpleNamespace(flags=flags, pids=[None, None], kv=[None, None]), 5.0)
    peer = flags[1]
    written: list[int] = []
    zc.begin_step(True)  # step 1: nothing to wait for at its start
    peer_acts.append(_sets(peer, shm_broadcast.STARTED))  # the peer's forward begins while rank 0 waits
    for lid in layout.target_layers:
        zc.write(lid, lambda lid=lid: written.append(lid))
        if lid == 2:
            peer_acts.append(_sets(peer, shm_broadcast.layer_flag(2)))  # the peer writes it while rank 0 waits
        if lid == 3:
            peer[shm_broadcast.layer_flag(3)] = 1  # written before rank 0 reads it: no wait
        if lid in layout.foreign:
            zc.before_read(lid)
    zc.end_step()
    peer_acts.append(_sets(peer, shm_broadcast.FINISHED))
    zc.begin_step(True)  # step 2 waits for the peer to finish step 1
    assert peer_acts == [] and written == [0, 1]
    assert (zc.stats.reads, zc.stats.waits, zc.stats.step_waits) == (2, 1, 2)
    assert zc.stats.wait_seconds == pytest.approx(NAP_S) and zc.stats.step_wait_seconds == pytest.approx(2 * NAP_S)
    record = metrics.stats_values(zc.stats)
    assert record["zero_copy_waits"] == 3 and record["zero_copy_wait_seconds"] == pytest.approx(3 * NAP_S)


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


@pytest.mark.unit
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


@pytest.mark.unit
def test_a_rank_that_has_not_written_is_absent_and_an_empty_directory_exports_no_sample(tmp_path):
    assert _scrape(tmp_path) == {}  # the families exist, without samples
    assert _scrape(tmp_path / "removed") == {}  # the serving process removed it at exit
    metrics.RecordWriter(tmp_path, 0, 0, 0, kv_blocks=10, kv_blocks_kvpp_off=5)
    (tmp_path / "rank-0-0-0-1.rec").write_bytes(bytes(metrics.RECORD_BYTES))  # being created: no magic yet
    (tmp_path / "rank-0-0-2.rec").write_bytes(b"\1" * 8)  # truncated
    got = _scrape(tmp_path)
    assert got["vllm:kvpp_kv_blocks"] == {("0", "0", "0"): 10}
    assert got["vllm:kvpp_steps_total"] == {("0", "0", "0"): 0}  # created, no step yet


@pytest.mark.unit
def test_the_hidden_fraction_is_absent_at_zero_flight_time_and_zero_copy_counts_reads(tmp_path):
    writer = metrics.RecordWriter(tmp_path, 1, 0, 0, kv_blocks=10, kv_blocks_kvpp_off=None)
    writer.update(ZeroCopyStats(steps=4, broadcast_steps=3, reads=24, waits=5, wait_seconds=0.25, step_waits=2,
                                step_wait_seconds=0.5, bytes=0))
    got = _scrape(tmp_path)
    key = ("1", "0", "0")
    assert "vllm:kvpp_prefetch_hidden_fraction" not in got  # no flight time: nothing hidden, nothing to divide
    assert got["vllm:kvpp_broadcast_seconds_total"] == {key: 0} and got["vllm:kvpp_broadcast_bytes_total"] == {key: 0}
    assert got["vllm:kvpp_zero_copy_reads_total"] == {key: 24}
    assert got["vllm:kvpp_zero_copy_waits_total"] == {key: 7}  # the reads' waits and the step edges'
    assert got["vllm:kvpp_zero_copy_wait_seconds_total"] == {key: 0.75}
    assert got["vllm:kvpp_broadcast_wait_seconds_total"] == {key: 0}  # zero-copy's waits are reads, not broadcasts
    # A worker whose capacity was not planned: no KVPP-off count, so no gain either.
    assert "vllm:kvpp_kv_blocks_kvpp_off" not in got and "vllm:kvpp_capacity_gain" not in got
    assert got["vllm:kvpp_kv_blocks"] == {key: 10}


@pytest.mark.integration
def test_a_full_or_read_only_shm_turns_a_ranks_metrics_off_with_one_warning_never_a_sigbus(tmp_path):
    """A small tmpfs in a mount namespace of the test's own, as a tight `--shm-size` or emptyDir sizeLimit
    makes /dev/shm: filled up, a rank's record cannot be made (a sparse record would be a SIGBUS at its
    first store), and read-only, neither; each such rank warns once and serves without metrics, and a
    rank whose record was made before keeps updating it."""
    full, read_only = tmp_path / "shm", tmp_path / "shm-ro"
    full.mkdir()
    read_only.mkdir()
    mount = ('mount -t tmpfs -o size=16k,mode=0700 wt-metrics-shm "$1" && '
             'mount -t tmpfs -o ro,size=16k wt-metrics-shm-ro "$2"')
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare (a mount namespace) to mount a small tmpfs")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", mount, "sh", full, read_only], capture_output=True,
                           text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here (root needed): {probe.stderr.strip()}")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'{mount} && exec "$3" -m tests.helpers.records_on_full_shm "$1" "$2"', "sh",
         full, read_only, sys.executable],
        capture_output=True, text=True, timeout=120, cwd=root,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))})
    assert proc.returncode == 0, f"the ranks' process died (rc {proc.returncode}; -7 is SIGBUS): {proc.stderr[-2000:]}"
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["filled_bytes"] > 0 and got["free_bytes"] == 0
    assert got["rank1"] is False and got["rank2"] is False
    assert len(got["warnings"]) == 2, got["warnings"]  # one per rank whose metrics are off
    no_space, no_write = got["warnings"]
    assert "rank 1: its metrics are off" in no_space and "No space left on device" in no_space
    assert "--shm-size" in no_space
    assert "rank 2: its metrics are off" in no_write and "Read-only file system" in no_write
    assert got["files"] == ["fill", "rank-0-0-0-0.rec"], "a rank without a record leaves no file behind"
    steps = {s.labels["kvpp_rank"]: s.value for f in text_string_to_metric_families(got["exposition"])
             for s in f.samples if s.name == "vllm:kvpp_steps_total"}
    assert steps == {"0": 8}
    assert list(full.iterdir()) == [] == list(read_only.iterdir()), "the tmpfs lived in the test's namespace only"


@pytest.mark.integration
@pytest.mark.vllm
def test_an_engine_says_at_start_which_ranks_its_metrics_leave_out(tiny_model, monkeypatch, tmp_path):
    """vLLM's own config building, as `vllm serve` runs it on each node: records travel through one host's
    shared memory, so the head of a two-node engine says its /metrics lacks the other node's ranks, the
    headless node says its ranks reach no /metrics (and its workers write no record), and an API server
    that cannot make the records' directory says the engine's metrics are off, and serves on."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    from connectors.plugin import register
    from kvpp_core import vllm_adapter

    register()
    monkeypatch.setattr(vllm_adapter, "_metrics_collector", None)
    monkeypatch.setattr(metrics, "RECORDS_PARENT", str(tmp_path))
    monkeypatch.delenv(metrics.METRICS_DIR_ENV, raising=False)

    def start(headless: bool = False, **nodes) -> list[str]:
        """The warnings KVPP logs while vLLM builds this node's config, as records of its logger (where vLLM's own
        handler prints them depends on what configured it first, in a whole test session)."""
        records: list[logging.LogRecord] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = records.append
        logger = logging.getLogger("vllm.kvpp.adapter")
        logger.addHandler(handler)
        try:
            EngineArgs(model=tiny_model, enforce_eager=True, tensor_parallel_size=2, max_model_len=1024,
                       additional_config={"enable_kvpp": True}, **nodes).create_engine_config(headless=headless)
        finally:
            logger.removeHandler(handler)
        return [r.getMessage() for r in records if "KVPP" in r.getMessage()]

    assert start() == []  # one node: every rank is served
    directory = Path(os.environ[metrics.METRICS_DIR_ENV])
    assert directory.parent == tmp_path
    two_nodes = {"nnodes": 2, "master_addr": "127.0.0.1"}
    (head,) = start(**two_nodes, node_rank=0)
    assert "/metrics carries the vllm:kvpp_* samples of this node's ranks only" in head
    assert "1 of each engine's 2 ranks (on its 1 other node)" in head and "kvpp_stats" in head
    assert os.environ[metrics.METRICS_DIR_ENV] == str(directory)  # the head's own ranks still are
    (worker_node,) = start(headless=True, **two_nodes, node_rank=1)
    assert "this node runs headless (no API server)" in worker_node and "reach no /metrics" in worker_node
    assert metrics.METRICS_DIR_ENV not in os.environ, "a headless node's workers write no record"
    get_prometheus_registry().unregister(vllm_adapter._metrics_collector)

    monkeypatch.setattr(vllm_adapter, "_metrics_collector", None)
    monkeypatch.setattr(metrics, "RECORDS_PARENT", str(tmp_path / "gone"))
    (off,) = start()
    assert "metrics (vllm:kvpp_*) are off for this engine" in off and str(tmp_path / "gone") in off
    assert metrics.METRICS_DIR_ENV not in os.environ and vllm_adapter._metrics_collector is None


def test_ranks_of_two_gqa_replica_groups_keep_records_of_their_own(tmp_path):
    """A GQA stage holds one group per KV head, each with its kvpp ranks 0..G-1: kvpp rank 0 of head 0 and of head 1
    are two ranks, two records, told apart by the replica_group label."""
    metrics.RecordWriter(tmp_path, 0, 0, 0, kv_blocks=512, kv_blocks_kvpp_off=256, replica_group=0)
    metrics.RecordWriter(tmp_path, 0, 0, 0, kv_blocks=512, kv_blocks_kvpp_off=250, replica_group=1)
    registry = CollectorRegistry()
    registry.register(metrics.RecordCollector(tmp_path, "tiny-gqa"))
    gains = {s.labels["replica_group"]: s.value for family in text_string_to_metric_families(
        generate_latest(registry).decode()) for s in family.samples if s.name == "vllm:kvpp_capacity_gain"}
    assert gains == {"0": 2.0, "1": 512 / 250}
