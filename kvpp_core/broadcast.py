"""Per-layer broadcast of KV caches from their owner to the cache-replica group.

Pure torch.distributed, no vLLM: the same object runs inside the engine and in the multi-process
tests. Collectives are asynchronous so that the next layer's transfer overlaps this layer's
compute; every rank issues them in the same order (execution order of the target layers), which
is what keeps owners and receivers matched without any extra coordination.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvpp_core.ownership import RankLayout


class KvppBroadcastError(RuntimeError):
    """A layer could not be delivered; the step must fail rather than attend over stale KV."""


@dataclass
class BroadcastStats:
    steps: int = 0
    broadcast_steps: int = 0
    layers: int = 0
    bytes: int = 0
    wait_seconds: float = 0.0
    """Time the forward's thread spent on layers' broadcasts instead of computing: issuing them, copying them
    (a copy on the forward's thread is waited for, whenever it runs) and waiting for them. The part not hidden."""
    flight_seconds: float = 0.0
    """Per layer, the time it was in flight until this rank saw it in place (at its wait: an upper bound),
    summed: from its issue on where a backend moves it while the forward computes (a collective), only while
    a forward moves it or waits for it otherwise (shared memory). 1 - wait_seconds / flight_seconds is at
    most the part prefetch hid."""

    def as_dict(self) -> dict[str, float | int]:
        return dict(vars(self))


MAX_RANGES = 16
"""Collectives per layer and region: past this, the smallest gaps between ranges are sent too, since
one more small collective costs more than a few unneeded blocks."""


def coalesce(block_ids: Sequence[int], max_ranges: int = MAX_RANGES) -> list[range]:
    """Sorted, de-duplicated block ids as contiguous ranges (one collective each), at most max_ranges."""
    ranges: list[range] = []
    for b in sorted(set(block_ids)):
        if ranges and ranges[-1].stop == b:
            ranges[-1] = range(ranges[-1].start, b + 1)
        else:
            ranges.append(range(b, b + 1))
    if len(ranges) > max_ranges:
        gaps = sorted(range(1, len(ranges)), key=lambda i: (ranges[i].start - ranges[i - 1].stop, i))
        bridged = set(gaps[: len(ranges) - max_ranges])
        merged = [ranges[0]]
        for i in range(1, len(ranges)):
            if i in bridged:
                merged[-1] = range(merged[-1].start, ranges[i].stop)
            else:
                merged.append(ranges[i])
        ranges = merged
    return ranges


class LayerBroadcaster:
    """Delivers each target layer's cache to every rank of the group just before it is used.

    `regions[layer_id]` are the tensors this rank sends (it owns the layer: its persistent
    buffers) or receives into (a staging slot). Each is viewed as `[num_blocks, page_bytes]`
    bytes so that a step may send all blocks (the anchor's behaviour) or only some ranges.
    """

    def __init__(
        self,
        layout: RankLayout,
        regions: Mapping[int, Sequence[torch.Tensor]],
        num_blocks: int,
        group: dist.ProcessGroup | None,
        group_ranks: Sequence[int],
        timeout: float = 60.0,
    ) -> None:
        if len(group_ranks) != layout.group_size:
            raise ValueError(f"group has {len(group_ranks)} ranks, layout expects {layout.group_size}")
        missing = set(layout.target_layers) - set(regions)
        if missing:
            raise ValueError(f"no broadcast region for target layers {sorted(missing)}")
        self.layout = layout
        self.group = group
        self.group_ranks = list(group_ranks)
        self.timeout = timedelta(seconds=timeout)
        self._blocks = {
            lid: [t.view(torch.uint8).reshape(num_blocks, -1) for t in tensors]
            for lid, tensors in regions.items()
        }
        self._position = {lid: pos for pos, lid in enumerate(layout.target_layers)}
        self._pending: dict[int, list[dist.Work]] = {}
        self._issued: dict[int, float] = {}
        """perf_counter() at each pending layer's start of flight, until its flight is counted; a layer that
        only the forward's own thread moves is not in it until the forward moves it."""
        self._delivered: set[int] = set()
        self._active = False
        self._ranges: list[range] | Callable[[], Sequence[range] | None] | None = None
        self.stats = BroadcastStats()

    @property
    def enabled(self) -> bool:
        """A group of one has nobody to send to."""
        return self.layout.group_size > 1

    def transport(self) -> tuple[str, int]:
        """How layers travel and how many ranks that reaches (the start-up proof, kvpp_core.activation)."""
        if self.group is None:
            return "none", 1
        return f"torch.distributed ({dist.get_backend(self.group)})", dist.get_world_size(self.group)

    def begin_step(self, active: bool,
                   block_ranges: Sequence[range] | Callable[[], Sequence[range] | None] | None = None) -> None:
        """Arm the broadcast for one forward pass. `block_ranges` are the blocks to send (None: every
        block); a callable is asked at the step's first broadcast, once the batch is known."""
        if self._pending:
            raise KvppBroadcastError("a new step started while layer broadcasts were still pending")
        self._active = active and self.enabled
        self._ranges = list(block_ranges) if isinstance(block_ranges, Sequence) else block_ranges
        self._delivered.clear()
        self._issued.clear()  # a failed step's layers that were never waited for
        self.stats.steps += 1
        self.stats.broadcast_steps += int(self._active)

    def before_layer(self, layer_id: int) -> None:
        """Called when a target layer is about to write its new KV: its history must be in place."""
        if not self._active or layer_id in self._delivered or layer_id not in self._position:
            return
        if callable(self._ranges):  # the step's first broadcast: the batch is known by now
            found = self._ranges()
            self._ranges = None if found is None else list(found)
        pos = self._position[layer_id]
        if layer_id not in self._pending:
            self._issue_counted(layer_id)
        ahead = self.layout.target_layers[pos + 1 : pos + 1 + self.layout.prefetch_depth]
        for nxt in ahead:
            if nxt not in self._pending and nxt not in self._delivered:
                self._issue_counted(nxt)
        self._wait(layer_id)

    def end_step(self) -> None:
        """Drain anything still in flight so the next step starts with the group in lockstep."""
        errors = []
        for lid in list(self._pending):
            try:
                self._wait(lid)
            except KvppBroadcastError as exc:
                errors.append(exc)
        self._active = False
        if errors:
            raise errors[0]

    def _issue_counted(self, layer_id: int) -> None:
        """Issue a layer. The forward's thread does that work, and whatever a transport does synchronously
        there, instead of computing: its time is waited time. It is flight time too: inside the flight that
        starts here (`_issued`), or else the forward's own work on the layer (a copy made right there)."""
        started = time.perf_counter()
        try:
            self._issue(layer_id, started)
        finally:
            spent = time.perf_counter() - started
            self.stats.wait_seconds += spent
            if layer_id not in self._issued:
                self.stats.flight_seconds += spent

    def _issue(self, layer_id: int, started: float) -> None:
        """Start a layer's transfer; a transfer that progresses without the forward from here on is in
        flight from `started` (`_issued`)."""
        self._issued[layer_id] = started
        src = self.group_ranks[self.layout.owner_of(layer_id)]
        works = []
        for blocks in self._blocks[layer_id]:
            pieces = [blocks] if self._ranges is None else [blocks[r.start : r.stop] for r in self._ranges]
            for piece in pieces:
                try:
                    works.append(dist.broadcast(piece, src=src, group=self.group, async_op=True))
                except RuntimeError as exc:
                    raise self._failure(layer_id, exc) from exc
                self.stats.bytes += piece.numel()
        self._pending[layer_id] = works

    def _wait(self, layer_id: int) -> None:
        works = self._pending.pop(layer_id)
        started = time.perf_counter()
        try:
            for work in works:
                work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._failure(layer_id, exc) from exc
        finally:
            self._landed(layer_id, started)
        self._delivered.add(layer_id)
        self.stats.layers += 1

    def _landed(self, layer_id: int, wait_started: float) -> None:
        """A layer's wait is over: count it, and the layer's flight if one was started (see `_issued`)."""
        now = time.perf_counter()
        self.stats.wait_seconds += now - wait_started
        issued = self._issued.pop(layer_id, None)
        if issued is not None:
            self.stats.flight_seconds += now - issued

    def _failure(self, layer_id: int, exc: Exception) -> KvppBroadcastError:
        self._active = False
        return KvppBroadcastError(
            f"KVPP broadcast of layer {layer_id} from kvpp rank {self.layout.owner_of(layer_id)} "
            f"failed on kvpp rank {self.layout.kvpp_rank}: {exc}"
        )
