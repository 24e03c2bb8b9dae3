"""Per-layer broadcast of KV caches from their owner to the cache-replica group.

Pure torch.distributed, no vLLM: the same object runs inside the engine and in the multi-process
tests. Collectives are asynchronous so that the next layer's transfer overlaps this layer's
compute; every rank issues them in the same order (execution order of the target layers), which
is what keeps owners and receivers matched without any extra coordination. A layer moves as exactly
the blocks the step references, packed into one buffer or run by run, or whole (kvpp_core.packing):
every rank derives the same blocks and the same choice from the same scheduler output, so nothing else
travels.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from kvpp_core.ownership import RankLayout
from kvpp_core.packing import PACK_BOUND_BYTES, LayerPack, Move, StepBlocks, choose, pack_buffer_bytes


class KvppBroadcastError(RuntimeError):
    """A layer could not be delivered; the step must fail rather than attend over stale KV."""


@dataclass
class BroadcastStats:
    steps: int = 0
    broadcast_steps: int = 0
    layers: int = 0
    bytes: int = 0
    """KV bytes moved into this rank's staging buffers: its foreign layers' referenced blocks, or whole layers."""
    whole_layers: int = 0
    """Foreign layers received whole: the step referenced too many of their blocks (kvpp_core.packing.choose),
    or did not say which."""
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


BlockIds = Sequence[int] | Callable[[], Sequence[int] | None] | None
"""A step's referenced block ids; a callable is asked at the step's first broadcast; None: every block."""


class LayerBroadcaster:
    """Delivers each target layer's cache to every rank of the group just before it is used.

    `regions[layer_id]` are the tensors this rank sends (it owns the layer: its persistent
    buffers) or receives into (a staging slot). Each is viewed as `[num_blocks, page_bytes]`
    bytes so that a step may send all blocks (the anchor's behaviour) or only those it references.
    """

    def __init__(
        self,
        layout: RankLayout,
        regions: Mapping[int, Sequence[torch.Tensor]],
        num_blocks: int,
        group: dist.ProcessGroup | None,
        group_ranks: Sequence[int],
        timeout: float = 60.0,
        pack_bound: int = PACK_BOUND_BYTES,
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
        self.num_blocks = num_blocks
        self._blocks = {
            lid: [t.view(torch.uint8).reshape(num_blocks, -1) for t in tensors]
            for lid, tensors in regions.items()
        }
        self._packs = {lid: LayerPack(pages) for lid, pages in self._blocks.items()}
        self._device = next(iter(self._blocks.values()))[0].device
        self._buffers = self._pack_buffers(pack_bound)
        self._position = {lid: pos for pos, lid in enumerate(layout.target_layers)}
        self._pending: dict[int, list[dist.Work]] = {}
        self._placing: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}
        """Packed layers in flight: their chunks' block ids and their buffer; the first chunk is in `_pending`."""
        self._issued: dict[int, float] = {}
        """perf_counter() at each pending layer's start of flight, until its flight is counted; a layer that
        only the forward's own thread moves is not in it until the forward moves it."""
        self._delivered: set[int] = set()
        self._active = False
        self._step: StepBlocks | Callable[[], Sequence[int] | None] | None = None
        self._index: torch.Tensor | None = None
        """The step's referenced block ids on the caches' device."""
        self.stats = BroadcastStats()

    def _pack_buffers(self, bound: int) -> list[torch.Tensor]:
        """One packed buffer per layer in flight (the current one and those prefetched), allocated and
        touched now, so that a shortage fails at start rather than in a step."""
        if not self.enabled:
            return []
        largest = max(pack.layer_page_bytes for pack in self._packs.values())
        size = pack_buffer_bytes(self.num_blocks, largest, bound)
        return [torch.zeros(size, dtype=torch.uint8, device=self._device)
                for _ in range(self.layout.prefetch_depth + 1)]

    @property
    def enabled(self) -> bool:
        """A group of one has nobody to send to."""
        return self.layout.group_size > 1

    @property
    def pack_buffer_bytes(self) -> int:
        """The packed buffers' bytes, allocated beside the KV cache."""
        return sum(b.numel() for b in self._buffers)

    def transport(self) -> tuple[str, int]:
        """How layers travel and how many ranks that reaches (the start-up proof, kvpp_core.activation)."""
        if self.group is None:
            return "none", 1
        return f"torch.distributed ({dist.get_backend(self.group)})", dist.get_world_size(self.group)

    def begin_step(self, active: bool, block_ids: BlockIds = None) -> None:
        """Arm the broadcast for one forward pass. `block_ids` are the blocks the step reads (None: every
        block); a callable is asked at the step's first broadcast, once the batch is known."""
        if self._pending:
            raise KvppBroadcastError("a new step started while layer broadcasts were still pending")
        self._active = active and self.enabled
        self._step = block_ids if block_ids is None or callable(block_ids) else StepBlocks(block_ids)
        self._index = None
        self._delivered.clear()
        self._issued.clear()  # a failed step's layers that were never waited for
        self._placing.clear()
        self.stats.steps += 1
        self.stats.broadcast_steps += int(self._active)

    def before_layer(self, layer_id: int) -> None:
        """Called when a target layer is about to write its new KV: its history must be in place."""
        if not self._active or layer_id in self._delivered or layer_id not in self._position:
            return
        if callable(self._step):  # the step's first broadcast: the batch is known by now
            found = self._step()
            self._step = None if found is None else StepBlocks(found)
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

    def _move(self, layer_id: int, collective: bool) -> Move:
        """How this step moves the layer: whole, or only its referenced blocks (kvpp_core.packing.choose)."""
        step = self._step
        assert not callable(step)
        pack = self._packs[layer_id]
        return choose(step, self.num_blocks, pack.layer_page_bytes, self._device, collective, len(pack.page_bytes))

    def _count_received(self, layer_id: int, blocks: int | None) -> None:
        """A foreign layer's bytes moved into this rank: `blocks` of it, or (None) all of it."""
        if self.layout.owner_of(layer_id) == self.layout.kvpp_rank:
            return
        self.stats.bytes += (self.num_blocks if blocks is None else blocks) * self._packs[layer_id].layer_page_bytes
        self.stats.whole_layers += blocks is None

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
        flight from `started` (`_issued`). Runs go one collective each, straight between the owner's pages and
        the staging slot. A packed layer that fits its buffer goes in one collective, placed at its wait; a
        bigger one goes chunk after chunk right here, so that every rank issues the group's collectives in the
        same order whatever its prefetch depth."""
        self._issued[layer_id] = started
        src = self.group_ranks[self.layout.owner_of(layer_id)]
        move = self._move(layer_id, collective=True)
        if move is not Move.PACKED:
            runs = self._step.runs if move is Move.RUNS else (range(0, self.num_blocks),)
            self._pending[layer_id] = [self._broadcast(layer_id, pages[r.start:r.stop], src)
                                       for r in runs for pages in self._blocks[layer_id]]
            self._count_received(layer_id, len(self._step) if move is Move.RUNS else None)
            return
        if self._index is None:
            self._index = self._step.index.to(self._device)
        self._count_received(layer_id, len(self._index))
        buffer = self._buffers[self._position[layer_id] % len(self._buffers)]
        per_chunk = buffer.numel() // self._packs[layer_id].layer_page_bytes
        self._pending[layer_id] = []
        if len(self._index) <= per_chunk:
            if len(self._index):
                self._pending[layer_id].append(self._send_chunk(layer_id, self._index, buffer, src))
                self._placing[layer_id] = (self._index, buffer)
            return
        for index in torch.split(self._index, per_chunk):
            self._wait_work(layer_id, self._send_chunk(layer_id, index, buffer, src))
            self._place(layer_id, index, buffer)

    def _send_chunk(self, layer_id: int, index: torch.Tensor, buffer: torch.Tensor, src: int) -> dist.Work:
        """One collective of packed blocks: the owner gathers them into the buffer first."""
        pack = self._packs[layer_id]
        if self.layout.owner_of(layer_id) == self.layout.kvpp_rank:
            payload = pack.gather(index, buffer)
        else:
            payload = buffer[:len(index) * pack.layer_page_bytes]
        return self._broadcast(layer_id, payload, src)

    def _place(self, layer_id: int, index: torch.Tensor, buffer: torch.Tensor) -> None:
        """A receiver puts the packed blocks that landed in `buffer` at their block ids."""
        if self.layout.owner_of(layer_id) != self.layout.kvpp_rank:
            self._packs[layer_id].place(index, buffer)

    def _broadcast(self, layer_id: int, tensor: torch.Tensor, src: int) -> dist.Work:
        try:
            return dist.broadcast(tensor, src=src, group=self.group, async_op=True)
        except RuntimeError as exc:
            raise self._failure(layer_id, exc) from exc

    def _wait_work(self, layer_id: int, work: dist.Work) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._failure(layer_id, exc) from exc

    def _wait(self, layer_id: int) -> None:
        works = self._pending.pop(layer_id)
        started = time.perf_counter()
        try:
            for work in works:
                self._wait_work(layer_id, work)
            if layer_id in self._placing:
                self._place(layer_id, *self._placing.pop(layer_id))
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
