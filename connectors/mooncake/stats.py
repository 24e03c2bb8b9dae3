"""Transfer counters of MooncakeConnectorV2: vLLM's KVConnectorStats channel (periodic log line)
and Prometheus counters on /metrics."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from connectors.common.metrics import CounterPromMetrics

_FIELDS = ("bytes", "transfers", "failures", "stalled", "retried", "seconds", "entries", "refused", "malformed",
           "renewed", "lapsed")
_HOSTILE = {"unauthorized": "refused", "unknown_request": "refused", "malformed": "malformed"}

# Where a pulled request's time to first token goes on the decode, phase by phase (seconds summed
# over requests; each phase also counts its requests, so its mean is sum / count):
PHASES = {
    "admit": "arrival in the decode's scheduler -> its load scheduled",
    "dispatch": "load scheduled -> a pull thread starts it",
    "handshake": "fetching the prefill workers' metadata (0 once cached)",
    "notify": "done-notice round trip while the request waits for it",
    "report": "pull finished -> reported to vLLM by get_finished",
    "resume": "scheduler saw the finished pull -> request scheduled to compute",
}


@dataclass
class MooncakeV2Stats(KVConnectorStats):
    """Sums since the last report: bytes pulled, requests pulled, failed pulls (of which `stalled`:
    given up for making no progress within the stall bound), reads issued again after failing at once
    (`retried`), seconds spent in the transfer engine and reads issued (after coalescing).

    A prefill worker also counts side-channel requests it refused: `refused` (no live hold for the
    request, a wrong token, or a CURVE key it does not trust) and `malformed` (undecodable frames, requests without a token),
    and its leases: `renewed` (claims it granted, one per request per heartbeat) and `lapsed` (holds
    freed because no decode claimed or renewed them in time, not because a decode said done).

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
        for phase in PHASES:
            self.data[f"{phase}_s"] = 0.0
            self.data[f"{phase}_n"] = 0

    def record_phase(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.data[f"{phase}_s"] += max(0.0, seconds)
            self.data[f"{phase}_n"] += 1

    def record_transfer(self, nbytes: int, seconds: float, entries: int, retried: int = 0) -> None:
        with self._lock:
            self.data["bytes"] += nbytes
            self.data["transfers"] += 1
            self.data["seconds"] += seconds
            self.data["entries"] += entries
            self.data["retried"] += retried

    def record_failure(self, stalled: bool = False) -> None:
        with self._lock:
            self.data["failures"] += 1
            self.data["stalled"] += stalled

    def record_refusal(self, code: str) -> None:
        """Count a side-channel refusal by its peer-facing code (benign ones, e.g. "expired", are not)."""
        key = _HOSTILE.get(code)
        if key is not None:
            with self._lock:
                self.data[key] += 1

    def record_leases(self, renewed: int = 0, lapsed: int = 0) -> None:
        with self._lock:
            self.data["renewed"] += renewed
            self.data["lapsed"] += lapsed

    def clone_and_reset(self) -> MooncakeV2Stats:
        with self._lock:
            snapshot = MooncakeV2Stats(data=dict(self.data))
            self.reset()
        return snapshot

    def aggregate(self, other: KVConnectorStats) -> MooncakeV2Stats:
        for key in {*self.data, *other.data}:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data["seconds"]
        return {
            "pulled_bytes": self.data["bytes"],
            "pulled_requests": self.data["transfers"],
            "failed_pulls": self.data["failures"],
            "stalled_pulls": self.data.get("stalled", 0),
            "retried_reads": self.data.get("retried", 0),
            "transfer_seconds": round(seconds, 4),
            "batch_entries": self.data["entries"],
            "refused_requests": self.data.get("refused", 0),
            "malformed_frames": self.data.get("malformed", 0),
            "lease_renewals": self.data.get("renewed", 0),
            "lapsed_holds": self.data.get("lapsed", 0),
            "throughput_MBps": round(self.data["bytes"] / seconds / 1e6, 1) if seconds else 0.0,
            "read_ms": round(1000 * seconds / self.data["transfers"], 2) if self.data["transfers"] else 0.0,
            **{f"{phase}_ms": round(1000 * self.data[f"{phase}_s"] / self.data[f"{phase}_n"], 2)
               for phase in PHASES if self.data.get(f"{phase}_n")},
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in (*_FIELDS, *(f"{phase}_n" for phase in PHASES)))


class MooncakeV2PromMetrics(CounterPromMetrics):
    COUNTERS = {
        "bytes": ("vllm:mooncake_v2_pulled_bytes", "KV bytes pulled from prefill workers."),
        "transfers": ("vllm:mooncake_v2_pulls", "Requests whose prompt KV was pulled."),
        "failures": ("vllm:mooncake_v2_failed_pulls", "Pulls that failed (load errors reported)."),
        "stalled": ("vllm:mooncake_v2_stalled_pulls",
                    "Failed pulls given up because their prefill made no progress within the stall bound."),
        "retried": ("vllm:mooncake_v2_retried_reads", "Reads that failed at once and were issued again (each retry counted)."),
        "seconds": ("vllm:mooncake_v2_transfer_seconds", "Seconds spent reading in the transfer engine."),
        **{f"{phase}_s": (f"vllm:mooncake_v2_{phase}_seconds", f"Pulled requests' time in phase: {doc}.")
           for phase, doc in PHASES.items()},
        **{f"{phase}_n": (f"vllm:mooncake_v2_{phase}_requests", f"Requests timed in phase {phase}.")
           for phase in PHASES},
        "refused": ("vllm:mooncake_v2_side_channel_refused",
                    "Side-channel requests refused: wrong token, no live hold, untrusted CURVE key."),
        "malformed": ("vllm:mooncake_v2_side_channel_malformed", "Undecodable side-channel frames (a request without its token included)."),
        "renewed": ("vllm:mooncake_v2_lease_renewals", "Lease claims granted by prefill workers (per request, heartbeat and worker)."),
        "lapsed": ("vllm:mooncake_v2_lapsed_holds",
                   "Held requests a prefill worker freed because their lease lapsed (no decode claimed or renewed them)."),
    }
