"""Zero-copy KVPP (`kvpp_staging_buffers: 0`): a foreign layer is read where its owner keeps it.

On a CPU host every rank's KV backing already lives in a shared-memory segment that all its peers map
(kvpp_core.shm_broadcast). Here a rank's views of its foreign layers are bound to their owner's
persistent pages in that segment, so no staging slot is allocated and nothing is copied. What keeps
it correct, with flags in the same control segments:

- Only the owner writes a layer's new tokens. The MLA latent is replicated, but the ranks compute it
  separately and their values need not be bit-identical, so two writers would race; a reader's write is
  skipped (`write`).
- The owner publishes `written[layer] = step` once its write of the step's tokens returned; a reader's
  attention waits for it (`before_read`), so it sees the history (earlier steps, pool loads) and this
  step's tokens.
- Before its first write of a step the owner waits until every peer's forward has begun (`STARTED`):
  each rank's runner zeroes the step's new blocks in every cache it binds (vLLM's CPU runner does,
  before the forward), the owner's pages included, and a late peer's zeroing must not land on the
  owner's new tokens. Zeroing a block twice is harmless; over a write it is not.
- A step barrier: no rank starts step N+1 (where freed blocks are reallocated and loads and zeroing
  write pages) until every peer has finished step N (`FINISHED`), i.e. stopped reading it.
- A peer that abandons the step, exits or stalls past the timeout fails the wait with the layer and both
  ranks named (`PeerWaits`); a rank whose forward fails mid-step abandons it, so its peers fail at once.

The flags are plain 8-byte stores ordered by x86-64's store order (validation refuses other hosts);
the write kernel's threads have joined before its flag is stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvpp_core.allocation import Placement
from kvpp_core.config import STAGING_KEY
from kvpp_core.ownership import RankLayout
from kvpp_core.shm_broadcast import FINISHED, STARTED, PeerWaits, ShmBroadcastStats, ShmGroup, layer_flag

REQUIRED_BY = (f"additional_config.{STAGING_KEY} is 0 (zero-copy), which reads peers' KV pages in shared "
               f"memory, but the group cannot share them: {{reason}}; set {STAGING_KEY} to 2 (staging buffers)")
"""The refusal when the group's segments cannot be shared (ShmGroup.negotiate fills in the reason)."""


@dataclass
class ZeroCopyStats(ShmBroadcastStats):
    transport: str = "zero-copy"
    reads: int = 0
    """Foreign layers read in place (each after its owner's written flag)."""
    waits: int = 0
    """Reads whose owner had not yet written the step's tokens: they waited (`wait_seconds` in all)."""
    step_waits: int = 0
    """The other waits on a peer that did wait, at a step's edges: its start for a peer to finish the
    previous step, an owner's first write for a peer's forward to begin (`step_wait_seconds` in all)."""
    step_wait_seconds: float = 0.0
    writes_skipped: int = 0
    """New-token writes a reader left to the owner."""
    forward_steps: int = 0
    """Steps whose forward ran this rank's target layers (a step without scheduled tokens runs none)."""


def adopt(shm: ShmGroup, caches: Mapping[str, torch.Tensor], placement: Placement) -> Mapping[str, torch.Tensor]:
    """vLLM's views moved onto this rank's segment (ShmGroup.adopt), then each borrowed (foreign) view rebound
    onto its owner's segment at the owner's offset, same size and strides, before anything binds them."""
    caches = shm.adopt(caches)
    for name in placement.borrowed:
        tensor = caches[name]
        owner, (offset, nbytes) = _owner_region(shm, name)
        size = tensor.element_size()
        if (tensor.storage_offset() + tensor.numel()) * size > nbytes or offset % size:
            raise RuntimeError(f"KVPP zero-copy: vLLM's view of {name} does not fit kvpp rank {owner}'s "
                               f"{nbytes}-byte region at {offset}")
        tensor.set_(shm.kv[owner].untyped_storage(), tensor.storage_offset() + offset // size, tensor.size(),
                    tensor.stride())
    return caches


def _owner_region(shm: ShmGroup, name: str) -> tuple[int, tuple[int, int]]:
    """The owner of a foreign cache and (offset, nbytes) of that cache in the owner's segment."""
    layer_id = next(c.layer_id for c in shm.layers if c.name == name)
    owner = shm.layout.owner_of(layer_id)
    return owner, shm.peer_placement(owner).region(name)


def check_bound(shm: ShmGroup, bound: Mapping[str, torch.Tensor], placement: Placement) -> None:
    """Every borrowed cache the engine binds points at its owner's pages (the owned ones are checked with
    the rest of the allocation)."""
    for name in placement.borrowed:
        owner, (offset, _) = _owner_region(shm, name)
        if bound[name].data_ptr() != shm.kv[owner].data_ptr() + offset:
            raise RuntimeError(f"KVPP zero-copy: cache {name} is not bound to kvpp rank {owner}'s pages")


class ZeroCopyLayers(PeerWaits):
    """The broadcaster's place in the runtime (begin_step, before_layer, end_step, stats) for zero-copy,
    plus the owner-only `write` and the reader's `before_read`."""

    _what = "zero-copy read"

    def __init__(self, layout: RankLayout, shm: ShmGroup, timeout: float) -> None:
        self.layout = layout
        self._shm = shm
        self._timeout_s = timeout
        self._epoch = 0
        self._in_step = False
        self._started_wait_done = False
        self._seen: set[int] = set()
        self._position = {lid: pos for pos, lid in enumerate(layout.target_layers)}
        self.stats = ZeroCopyStats()

    def begin_step(self, active: bool, block_ids: Sequence[int] | Callable | None = None) -> None:
        """Wait until every peer has finished the previous step, then open this one. Every rank opens every
        step (empty ones too), so the group's epochs advance together. `active` (a step with history)
        changes nothing here: a reader waits on every step, fresh prefills included."""
        self._step_barrier()
        self._epoch += 1
        self._in_step = True
        self._started_wait_done = False
        self._seen.clear()
        self.stats.steps += 1
        self.stats.broadcast_steps += int(active)

    def _step_barrier(self) -> None:
        for peer in range(self.layout.group_size):
            if peer != self.layout.kvpp_rank:
                self._wait_for(None, peer, lambda f=self._shm.flags[peer]: f[FINISHED] >= self._epoch,
                               "end of the previous step")

    def _wait_for(self, layer_id: int | None, peer: int, done: Callable[[], bool], what: str,
                  read: bool = False) -> None:
        """`_await` a peer's flag, counted when it was not set yet: a read's wait in `waits`, any other in
        `step_waits`. Every such second is the forward's, spent on a peer."""
        if done():
            return
        started = time.perf_counter()
        try:
            self._await(layer_id, peer, done, what)
        finally:
            elapsed = time.perf_counter() - started
            if read:
                self.stats.waits += 1
                self.stats.wait_seconds += elapsed
            else:
                self.stats.step_waits += 1
                self.stats.step_wait_seconds += elapsed

    def transport(self) -> tuple[str, int]:
        """How layers reach a reader (the start-up proof, kvpp_core.activation): in place, from every peer's
        mapped segment."""
        return "zero-copy shared memory", len(self._shm.kv)

    def before_layer(self, layer_id: int) -> None:
        """Nothing to deliver: the layer is already where this rank reads it."""

    def _forward_begins(self) -> None:
        """At this rank's first target layer of the step: its pre-forward writes are behind it."""
        if self._in_step and not self._seen:
            self._own_flags[STARTED] = self._epoch

    def _peers_started(self, layer_id: int) -> None:
        for peer in range(self.layout.group_size):
            if peer != self.layout.kvpp_rank:
                self._guarded(lambda peer=peer: self._wait_for(
                    layer_id, peer, lambda f=self._shm.flags[peer]: f[STARTED] >= self._epoch, "start of the forward"))

    def _guarded(self, wait: Callable[[], None]) -> None:
        try:
            wait()
        except Exception:
            self._abandon()
            raise

    def write(self, layer_id: int, do_write: Callable[[], None]) -> None:
        """The new tokens' KV write of a target layer: the owner writes, then flags it for this step."""
        self._forward_begins()
        if self.layout.owner_of(layer_id) != self.layout.kvpp_rank:
            if self._in_step:
                self.stats.writes_skipped += 1
                self._seen.add(layer_id)
            return
        if self._in_step and not self._started_wait_done:
            self._peers_started(layer_id)
            self._started_wait_done = True
        do_write()
        if self._in_step:
            self._own_flags[layer_flag(self._position[layer_id])] = self._epoch
            self._seen.add(layer_id)

    def before_read(self, layer_id: int) -> None:
        """Before a foreign layer's attention reads it: wait for its owner's write of this step."""
        owner = self.layout.owner_of(layer_id)
        if not self._in_step or owner == self.layout.kvpp_rank:
            return
        self._forward_begins()
        slot = layer_flag(self._position[layer_id])
        flags = self._shm.flags[owner]

        self._guarded(lambda: self._wait_for(layer_id, owner, lambda: flags[slot] >= self._epoch, "write", read=True))
        self._seen.add(layer_id)
        self.stats.reads += 1
        self.stats.layers += 1

    def end_step(self) -> None:
        """Close the step; a forward that touched some target layers but not all failed midway: abandon."""
        if self._in_step and self._seen and len(self._seen) < len(self.layout.target_layers):
            self._abandon()
        elif self._in_step:
            self._own_flags[FINISHED] = self._epoch
            self.stats.forward_steps += int(bool(self._seen))
        self._in_step = False
