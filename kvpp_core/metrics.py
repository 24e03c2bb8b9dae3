"""KVPP's own metrics on vLLM's `/metrics`: per-rank records in shared memory, read at scrape time.

KVPP's counters live in the worker processes (grandchildren of the API server, which serves `/metrics`).
Each worker keeps one record: a small file of float64 slots (`SLOTS`), mmap'ed and updated in place at
every step's end (a handful of stores, no syscall). The API server owns the directory the records are in
(named to its children by `METRICS_DIR_ENV`) and a Prometheus collector (`RecordCollector`) that reads
them when `/metrics` is scraped. `FAMILIES` is the one list of what is exported: the collector and the
Grafana dashboard's check (tests/deploy/deployment/test_dashboard.py) read it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvpp_core.broadcast import BroadcastStats
from kvpp_core.zero_copy import ZeroCopyStats

logger = logging.getLogger("vllm.kvpp.metrics")  # the logger vLLM's init_logger hands out

METRICS_DIR_ENV = "KVPP_METRICS_DIR"
"""The directory of this engine's records; set by the process that serves `/metrics`, inherited by its workers."""
RECORDS_PARENT = "/dev/shm" if os.path.isdir("/dev/shm") else None
"""Where record directories are made (memory-backed; None: the system's temporary directory)."""

LABELS = ("model_name", "engine", "pp_stage", "replica_group", "kvpp_rank")
"""`engine` is vLLM's engine index (the data-parallel rank), as on vLLM's own metrics; `replica_group` the stage's
cache-replica group (a GQA model's KV head when TP replicates several; 0 for MLA/SFA)."""

_MAGIC = float(0x4B565050)  # "KVPP", exact as a float64; written last when a record is created
SLOTS = (
    "magic", "engine", "pp_stage", "replica_group", "kvpp_rank", "kv_blocks", "kv_blocks_kvpp_off",
    "steps", "broadcast_steps", "broadcast_layers", "broadcast_bytes", "broadcast_seconds",
    "broadcast_wait_seconds", "zero_copy_reads", "zero_copy_waits", "zero_copy_wait_seconds",
)
_INDEX = {name: i for i, name in enumerate(SLOTS)}
_FORMAT = f"<{len(SLOTS)}d"
RECORD_BYTES = struct.calcsize(_FORMAT)


@dataclass(frozen=True)
class Family:
    name: str
    """As exposed, without the `_total` a counter gets."""
    kind: str
    """counter or gauge"""
    doc: str

    @property
    def samples(self) -> tuple[str, ...]:
        """The sample names a query reads (a counter's `_total`, and `_created` vLLM's counters do not use)."""
        return (f"{self.name}_total",) if self.kind == "counter" else (self.name,)


def _counter(slot: str, doc: str) -> tuple[str, Family]:
    return slot, Family(f"vllm:kvpp_{slot}", "counter", doc)


COUNTERS = dict((
    _counter("steps", "Forward steps this rank ran with KVPP."),
    _counter("broadcast_steps", "Steps whose batch had history a foreign layer needed (the others broadcast nothing)."),
    _counter("broadcast_layers", "Target layers delivered (received, or sent and read by every peer)."),
    _counter("broadcast_bytes", "KV bytes broadcast into this rank's staging buffers (received; 0 for zero-copy)."),
    _counter("broadcast_seconds", "Per layer, seconds it was in flight (moved by a backend from its issue on, or "
                                  "by a forward) until this rank saw it in place, summed."),
    _counter("broadcast_wait_seconds", "Seconds the forward spent on broadcasts instead of computing: issuing, "
                                       "copying and waiting for layers (what prefetch did not hide)."),
    _counter("zero_copy_reads", "Zero-copy: foreign layers read in their owner's pages."),
    _counter("zero_copy_waits", "Zero-copy: waits on a peer: reads for the owner's write of the step, a step's "
                                "start for the peers' previous step, an owner's first write for their forward."),
    _counter("zero_copy_wait_seconds", "Zero-copy: seconds the forward spent in those waits."),
))
GAUGES = {
    "kv_blocks": Family("vllm:kvpp_kv_blocks", "gauge", "KV blocks this engine holds with KVPP (the engine's count)."),
    "kv_blocks_kvpp_off": Family("vllm:kvpp_kv_blocks_kvpp_off", "gauge",
                                 "KV blocks this rank's budget holds with KVPP off (every layer replicated)."),
    "capacity_gain": Family("vllm:kvpp_capacity_gain", "gauge", "kv_blocks / kv_blocks_kvpp_off."),
    "prefetch_hidden_fraction": Family(
        "vllm:kvpp_prefetch_hidden_fraction", "gauge",
        "1 - broadcast_wait_seconds / broadcast_seconds since start: at most the part of the broadcasts' flight "
        "the forward did not wait for (absent before any flight time, and for zero-copy)."),
}
FAMILIES: tuple[Family, ...] = (*COUNTERS.values(), *GAUGES.values())


def stats_values(stats: BroadcastStats) -> dict[str, float]:
    """The record's counter slots from a broadcaster's stats (zero-copy's waits are on peers, not broadcasts)."""
    common = {"steps": stats.steps, "broadcast_steps": stats.broadcast_steps}
    if isinstance(stats, ZeroCopyStats):
        return {**common, "zero_copy_reads": stats.reads, "zero_copy_waits": stats.waits + stats.step_waits,
                "zero_copy_wait_seconds": stats.wait_seconds + stats.step_wait_seconds}
    return {**common, "broadcast_layers": stats.layers, "broadcast_bytes": stats.bytes,
            "broadcast_seconds": stats.flight_seconds, "broadcast_wait_seconds": stats.wait_seconds}


class RecordWriter:
    """One worker's record, created at start (labels and block counts) and updated at each step's end."""

    def __init__(self, directory: Path, engine: int, pp_stage: int, kvpp_rank: int, kv_blocks: int,
                 kv_blocks_kvpp_off: int | None, replica_group: int = 0) -> None:
        """Raises OSError when the record cannot be created, its page included: after that, every store
        into it lands in memory that exists."""
        path = directory / f"rank-{engine}-{pp_stage}-{replica_group}-{kvpp_rank}.rec"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            # Reserve the page now. A file only ftruncate'd is sparse: on a full /dev/shm (a tight
            # --shm-size or sizeLimit) the first store into its mapping is a SIGBUS that kills the worker.
            os.posix_fallocate(fd, 0, RECORD_BYTES)
            self._map = mmap.mmap(fd, RECORD_BYTES, mmap.MAP_SHARED)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)  # an empty file is no record; the collector would skip it, but leave none
            raise
        finally:
            os.close(fd)
        self._slots = memoryview(self._map).cast("d")
        for name, value in (("engine", engine), ("pp_stage", pp_stage), ("replica_group", replica_group),
                            ("kvpp_rank", kvpp_rank),
                            ("kv_blocks", kv_blocks),
                            ("kv_blocks_kvpp_off", float("nan") if kv_blocks_kvpp_off is None else kv_blocks_kvpp_off)):
            self._slots[_INDEX[name]] = value
        self._slots[_INDEX["magic"]] = _MAGIC  # last: a reader that sees it sees the labels

    def update(self, stats: BroadcastStats) -> None:
        for name, value in stats_values(stats).items():
            self._slots[_INDEX[name]] = value


def open_record(directory: Path, engine: int, pp_stage: int, kvpp_rank: int, kv_blocks: int,
                kv_blocks_kvpp_off: int | None, replica_group: int = 0) -> RecordWriter | None:
    """This rank's record, or None (warned once) where it cannot be made: the rank then serves without
    metrics, since no failure of KVPP's metrics may stop or kill an engine."""
    try:
        return RecordWriter(directory, engine, pp_stage, kvpp_rank, kv_blocks, kv_blocks_kvpp_off, replica_group)
    except OSError as exc:
        logger.warning(
            "KVPP engine %d stage %d rank %d: its metrics are off, /metrics lacks its vllm:kvpp_* samples "
            "(collective_rpc('kvpp_stats') still has them); its record cannot be created in %s=%s: %s. "
            "Enlarge /dev/shm (docker run --shm-size, a Kubernetes emptyDir sizeLimit) or free it",
            engine, pp_stage, kvpp_rank, METRICS_DIR_ENV, directory, exc.strerror or exc)
        return None


def read_records(directory: Path) -> list[dict[str, float]]:
    """Every complete record in `directory`, sorted by label; a rank that has not created its record yet,
    or whose creation is under way, is not among them."""
    records = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return records
    for name in names:
        try:
            data = (directory / name).read_bytes()
        except OSError:
            continue
        if len(data) != RECORD_BYTES:
            continue
        values = dict(zip(SLOTS, struct.unpack(_FORMAT, data)))
        if values["magic"] == _MAGIC:
            records.append(values)
    return records


def derived(record: dict[str, float]) -> dict[str, float]:
    """The gauges a record implies (a gauge whose inputs are missing or zero is left out)."""
    out = {"kv_blocks": record["kv_blocks"]}
    off = record["kv_blocks_kvpp_off"]
    if off == off and off > 0:  # NaN: the worker did not plan its capacity
        out["kv_blocks_kvpp_off"] = off
        out["capacity_gain"] = record["kv_blocks"] / off
    if record["broadcast_seconds"] > 0:
        out["prefetch_hidden_fraction"] = 1.0 - record["broadcast_wait_seconds"] / record["broadcast_seconds"]
    return out


class RecordCollector:
    """A Prometheus collector over one engine's record directory (read at every scrape)."""

    def __init__(self, directory: Path, model_name: str) -> None:
        self.directory = directory
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # registered before any record exists; nothing to check for clashes

    def collect(self) -> Iterator[Metric]:
        records = read_records(self.directory)
        labelled = [((self.model_name, *(str(int(r[k])) for k in LABELS[1:])), r) for r in records]
        for slot, family in COUNTERS.items():
            metric = CounterMetricFamily(family.name, family.doc, labels=LABELS)
            for labels, record in labelled:
                metric.add_metric(labels, record[slot])
            yield metric
        gauges = {slot: GaugeMetricFamily(family.name, family.doc, labels=LABELS) for slot, family in GAUGES.items()}
        for labels, record in labelled:
            for slot, value in derived(record).items():
                gauges[slot].add_metric(labels, value)
        yield from gauges.values()
