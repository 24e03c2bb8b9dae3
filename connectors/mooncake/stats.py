"""Transfer counters of MooncakeConnectorV2: vLLM's KVConnectorStats channel (periodic log line)
and Prometheus counters on /metrics."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from connectors.metrics import CounterPromMetrics

_FIELDS = ("bytes", "transfers", "failures", "seconds", "entries", "refused", "malformed")
_HOSTILE = {"unauthorized": "refused", "unknown_request": "refused", "malformed": "malformed"}


@dataclass
class MooncakeV2Stats(KVConnectorStats):
    """Sums since the last report: bytes pulled, requests pulled, failed pulls, seconds spent in
    the transfer engine and batch entries issued (after coalescing).

    A prefill worker also counts side-channel requests it refused: `refused` (no live hold for the
    request, a wrong token, or a CURVE key it does not trust) and `malformed` (undecodable frames, requests without a token).

    Plain sums (not per-transfer lists) keep the payload constant-size however busy the step was.
    """

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        if not self.data:
            self.reset()

    # The lock is process-local; vLLM ships stats between processes.
    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.data = state["data"]
        self._lock = threading.Lock()

    def reset(self) -> None:
        self.data = dict.fromkeys(_FIELDS, 0)
        self.data["seconds"] = 0.0

    def record_transfer(self, nbytes: int, seconds: float, entries: int) -> None:
        with self._lock:
            self.data["bytes"] += nbytes
            self.data["transfers"] += 1
            self.data["seconds"] += seconds
            self.data["entries"] += entries

    def record_failure(self) -> None:
        with self._lock:
            self.data["failures"] += 1

    def record_refusal(self, code: str) -> None:
        """Count a side-channel refusal by its peer-facing code (benign ones, e.g. "expired", are not)."""
        key = _HOSTILE.get(code)
        if key is not None:
            with self._lock:
                self.data[key] += 1

    def clone_and_reset(self) -> MooncakeV2Stats:
        with self._lock:
            snapshot = MooncakeV2Stats(data=dict(self.data))
            self.reset()
        return snapshot

    def aggregate(self, other: KVConnectorStats) -> MooncakeV2Stats:
        for key in _FIELDS:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data["seconds"]
        return {
            "pulled_bytes": self.data["bytes"],
            "pulled_requests": self.data["transfers"],
            "failed_pulls": self.data["failures"],
            "transfer_seconds": round(seconds, 4),
            "batch_entries": self.data["entries"],
            "refused_requests": self.data.get("refused", 0),
            "malformed_frames": self.data.get("malformed", 0),
            "throughput_MBps": round(self.data["bytes"] / seconds / 1e6, 1) if seconds else 0.0,
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in _FIELDS)


class MooncakeV2PromMetrics(CounterPromMetrics):
    COUNTERS = {
        "bytes": ("vllm:mooncake_v2_pulled_bytes", "KV bytes pulled from prefill workers."),
        "transfers": ("vllm:mooncake_v2_pulls", "Requests whose prompt KV was pulled."),
        "failures": ("vllm:mooncake_v2_failed_pulls", "Pulls that failed (load errors reported)."),
        "seconds": ("vllm:mooncake_v2_transfer_seconds", "Seconds spent in batch_transfer_sync_read."),
        "refused": ("vllm:mooncake_v2_side_channel_refused",
                    "Side-channel requests refused: wrong token, no live hold, untrusted CURVE key."),
        "malformed": ("vllm:mooncake_v2_side_channel_malformed", "Undecodable side-channel frames (a request without its token included)."),
    }
