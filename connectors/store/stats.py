"""Pool counters reported through vLLM's `get_kv_connector_stats` (summed over workers)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

COUNTERS = (
    "lookups", "lookup_hit_blocks", "lookup_hit_tokens", "lookup_failures",
    "saved_blocks", "saved_bytes", "save_skipped_blocks", "save_failures",
    "loaded_blocks", "loaded_bytes", "load_failures", "load_wrong_size",
)


@dataclass
class StoreStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def add(self, name: str, value: int = 1) -> None:
        self.data[name] += value

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> "StoreStats":
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())
