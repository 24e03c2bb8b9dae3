"""Pool counters reported through vLLM's `get_kv_connector_stats` (summed over workers).

Refusals are calls not made because a worker's breaker was open after the pool failed to answer
(connectors.store.backends.backoff): `lookup_refusals` counts lookups, `load_refusals` and `save_refusals`
blocks; they are in `lookup_failures`, `load_failures` and `save_failures` too, as are the blocks whose call
missed its bound (`load_timeouts`, `save_timeouts`) and those a request's pool budget could not cover
(`load_over_budget`). `lookup_over_budget` counts requests that spent their budget before a lookup (served as
misses without asking); `breaker_opens` the times a worker's breaker opened."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from connectors.common.metrics import CounterPromMetrics

COUNTERS = (
    "lookups", "lookup_hit_blocks", "lookup_hit_tokens", "lookup_failures", "lookup_refusals", "lookup_over_budget",
    "unpoolable_requests",
    "saved_blocks", "saved_bytes", "save_skipped_blocks", "save_failures", "save_refusals", "save_timeouts",
    "loaded_blocks", "loaded_bytes", "load_failures", "load_wrong_size", "load_refusals", "load_timeouts",
    "load_over_budget", "breaker_opens",
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
        "breaker_opens": ("vllm:kv_pool_breaker_opens", "Times a worker stopped calling the pool after a call it did "
                          "not answer (its breaker opened); a background check closes it once the pool answers."),
        "lookup_refusals": ("vllm:kv_pool_lookup_refusals", "Lookups not asked while the breaker was open (misses)."),
        "load_refusals": ("vllm:kv_pool_load_refusals", "Blocks not loaded without asking while the breaker was open "
                          "(recomputed)."),
        "save_refusals": ("vllm:kv_pool_save_refusals", "Blocks not saved without asking while the breaker was open."),
        "load_timeouts": ("vllm:kv_pool_load_timeouts", "Blocks whose get missed its bound (recomputed)."),
        "save_timeouts": ("vllm:kv_pool_save_timeouts", "Blocks whose put missed its bound (not pooled)."),
        "lookup_over_budget": ("vllm:kv_pool_lookup_over_budget", "Requests that spent their pool budget "
                               "(request_budget_ms) on lookups: further lookups are misses."),
        "load_over_budget": ("vllm:kv_pool_load_over_budget", "Blocks not loaded because their request's pool budget "
                             "could not cover the call (recomputed)."),
    }
