"""Pool counters reported through vLLM's `get_kv_connector_stats` (summed over workers).

`lookup_refusals` counts the lookups that failed at once, without asking, while the pool backed off after a
failure (connectors.store.backends.backoff); they are in `lookup_failures` too."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from connectors.common.metrics import CounterPromMetrics

COUNTERS = (
    "lookups", "lookup_hit_blocks", "lookup_hit_tokens", "lookup_failures", "lookup_refusals", "unpoolable_requests",
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


class StorePromMetrics(CounterPromMetrics):
    COUNTERS = {
        "lookups": ("vllm:kv_pool_lookups", "Prefix lookups the scheduler asked the pool."),
        "lookup_hit_tokens": ("vllm:kv_pool_hit_tokens", "Prompt tokens found in the pool (whole blocks, every shard)."),
        "lookup_failures": ("vllm:kv_pool_lookup_failures", "Lookups the pool could not answer (counted as misses)."),
        "saved_blocks": ("vllm:kv_pool_saved_blocks", "Blocks this instance saved to the pool."),
        "saved_bytes": ("vllm:kv_pool_saved_bytes", "Bytes this instance saved to the pool."),
        "save_failures": ("vllm:kv_pool_save_failures", "Saves dropped because the pool failed."),
        "loaded_blocks": ("vllm:kv_pool_loaded_blocks", "Blocks loaded from the pool."),
        "loaded_bytes": ("vllm:kv_pool_loaded_bytes", "Bytes loaded from the pool."),
        "load_failures": ("vllm:kv_pool_load_failures", "Loads that failed; the request recomputed them."),
        "load_wrong_size": ("vllm:kv_pool_load_wrong_size", "Pooled objects refused for their size."),
    }
