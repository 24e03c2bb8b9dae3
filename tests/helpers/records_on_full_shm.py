"""Workers' metrics records made in a small tmpfs that fills up, and in a read-only one; run by
tests/kvpp_core/test_metrics.py inside a mount namespace of its own, the tmpfs mounted at argv[1] and the
read-only one at argv[2].

Rank 0 makes its record while there is room; the tmpfs is then filled to the last byte (as zero-copy KV
or another engine may fill /dev/shm), rank 0 keeps updating its record, and rank 1 makes its own; rank 2
makes its own in the read-only tmpfs. Prints, as JSON, what each rank got, the warnings logged, the files
left and what a collector reads. A SIGBUS kills this process instead.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from kvpp_core import metrics
from kvpp_core.broadcast import BroadcastStats


def _fill(directory: Path) -> int:
    """Write into the tmpfs until it is full; the bytes written."""
    written = 0
    with open(directory / "fill", "wb", buffering=0) as f:
        try:
            while True:
                written += f.write(b"\0" * 4096)
        except OSError:
            pass
    return written


def main() -> None:
    directory = Path(sys.argv[1])
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    metrics.logger.addHandler(Keep(logging.WARNING))
    out: dict = {"warnings": warnings}

    def open_rank(rank: int, where: Path = directory) -> metrics.RecordWriter | None:
        return metrics.open_record(where, 0, 0, rank, kv_blocks=165, kv_blocks_kvpp_off=107)

    rank0 = open_rank(0)
    out["filled_bytes"] = _fill(directory)
    out["free_bytes"] = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
    rank0.update(BroadcastStats(steps=7, broadcast_steps=5))
    out["rank1"] = open_rank(1) is not None
    out["rank2"] = open_rank(2, Path(sys.argv[2])) is not None
    rank0.update(BroadcastStats(steps=8, broadcast_steps=6))
    out["files"] = sorted(os.listdir(directory))
    registry = CollectorRegistry()
    registry.register(metrics.RecordCollector(directory, "tiny-mla"))
    out["exposition"] = generate_latest(registry).decode()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
