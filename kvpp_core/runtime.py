"""The KVPP state of one worker process: its layout and its broadcaster.

Connectors read `active_layout()` to learn which caches this rank keeps (and so what to save,
send or load); the vLLM adapter drives the broadcaster from the model's attention layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpp_core.allocation import Placement
from kvpp_core.broadcast import LayerBroadcaster
from kvpp_core.ownership import RankLayout
from kvpp_core.zero_copy import ZeroCopyLayers

if TYPE_CHECKING:
    from kvpp_core.metrics import RecordWriter


@dataclass(frozen=True)
class ActiveLayout:
    rank_layout: RankLayout
    placement: Placement
    layer_ids: Mapping[str, int | None]
    """Every cache name of this rank -> decoder layer id, None for MTP/draft caches."""
    replica_group: int = 0
    """Which of the stage's cache-replica groups this rank is in: a GQA model's KV head (TP ranks holding another
    head form other groups, with kvpp ranks of their own); 0 for MLA/SFA, whose stage is one group."""

    @property
    def kvpp_rank(self) -> int:
        return self.rank_layout.kvpp_rank

    @property
    def group_size(self) -> int:
        return self.rank_layout.group_size

    @property
    def num_blocks(self) -> int:
        return self.placement.num_blocks

    @property
    def persistent_layer_names(self) -> tuple[str, ...]:
        return self.placement.persistent

    @property
    def owned_layer_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.placement.persistent if self.layer_ids[n] is not None)

    @property
    def mtp_layer_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.placement.persistent if self.layer_ids[n] is None)

    def layer_owner(self, name: str) -> int | None:
        """kvpp rank owning a target cache; None for MTP caches, which every rank holds."""
        layer_id = self.layer_ids[name]
        return None if layer_id is None else self.rank_layout.owner_of(layer_id)


def needs_broadcast(new_request_computed_tokens: Iterable[int], num_running_requests: int) -> bool:
    """A step needs history only if some request has any: a running request always does, a new one
    does when part of its prompt came from a prefix hit or a KV load."""
    return num_running_requests > 0 or any(n > 0 for n in new_request_computed_tokens)


class KvppRuntime:
    """A worker's layout and the broadcaster over its allocated caches, created complete once the
    engine has bound them."""

    def __init__(self, layout: ActiveLayout, broadcaster: LayerBroadcaster | ZeroCopyLayers,
                 record: RecordWriter | None = None) -> None:
        self.layout = layout
        self.broadcaster = broadcaster
        self.record = record
        """Where this rank's counters reach /metrics (kvpp_core.metrics); None when no process serves them."""

    def end_step(self) -> None:
        """Close the step's broadcasts, then publish the counters (a failed step's too)."""
        try:
            self.broadcaster.end_step()
        finally:
            if self.record is not None:
                self.record.update(self.broadcaster.stats)

    def report(self) -> dict:
        """What an operator or a test asks a worker: its layout, its KV bytes and its traffic."""
        layout = self.layout.rank_layout
        return {
            "kvpp_rank": layout.kvpp_rank,
            "replica_group": self.layout.replica_group,
            "group_size": layout.group_size,
            "owned_layers": list(layout.owned),
            "mtp_caches": list(self.layout.mtp_layer_names),
            "staging_slots": layout.staging_slots,
            "num_blocks": self.layout.num_blocks,
            "kv_bytes": self.layout.placement.total_bytes,
            "transport": self.broadcaster.transport()[0],
            "pack_buffer_bytes": self.broadcaster.pack_buffer_bytes if isinstance(self.broadcaster, LayerBroadcaster) else 0,
            "broadcast": self.broadcaster.stats.as_dict(),
        }

    def before_layer(self, cache_name: str) -> None:
        layer_id = self.layout.layer_ids.get(cache_name)
        if layer_id is not None:
            self.broadcaster.before_layer(layer_id)

    def write_kv(self, cache_name: str, write: Callable[[], None]) -> None:
        """A layer's new-token KV write: zero-copy leaves a target layer's to its owner; else every rank writes."""
        layer_id = self.layout.layer_ids.get(cache_name)
        if layer_id is None or not isinstance(self.broadcaster, ZeroCopyLayers):
            write()
        else:
            self.broadcaster.write(layer_id, write)

    def before_read(self, cache_name: str) -> None:
        """Before a layer's attention reads its cache: zero-copy waits for a foreign layer's owner."""
        layer_id = self.layout.layer_ids.get(cache_name)
        if layer_id is not None and isinstance(self.broadcaster, ZeroCopyLayers):
            self.broadcaster.before_read(layer_id)


_LAYOUT: ActiveLayout | None = None
_RUNTIME: KvppRuntime | None = None


def publish_layout(layout: ActiveLayout) -> None:
    """Make the layout visible before the caches exist: connectors register them while vLLM allocates."""
    global _LAYOUT
    _LAYOUT = layout


def install(runtime: KvppRuntime) -> None:
    global _LAYOUT, _RUNTIME
    _LAYOUT, _RUNTIME = runtime.layout, runtime


def current() -> KvppRuntime | None:
    return _RUNTIME


def active_layout() -> ActiveLayout | None:
    """The KVPP layout of this worker, or None when KVPP is off (every rank holds every layer)."""
    return _LAYOUT
