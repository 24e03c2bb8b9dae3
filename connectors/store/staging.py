"""Staging slots: the only memory the pool's store client reads and writes.

A store call that misses its bound runs on natively (C++ calls cannot be cancelled) and keeps touching the
buffers it was given; a pool that stops answering can keep it running for the whole stall (measured: a get and a
put in flight when the master and segment holder stopped returned only when they resumed, 12 s later). Given
vLLM's KV blocks, it would hold its request until it returned: a late get writing into blocks vLLM recomputed or
reused gives wrong tokens. So every put and get goes through a slot of the connector's own: a save copies the
blocks into a slot before its put, a load copies a slot into the blocks once its get returned whole. A slot
whose call ran late stays out of use until the call returned; with no slot free a put or get is refused. No
request waits for a late call, and no late call touches a block.
"""

from __future__ import annotations

import threading

import torch

SLOT_BYTES = 16 << 20
"""Bytes of one slot (at least one pool object): what one put or get moves at most."""
SLOTS = 4
"""One call each of a worker's load and save threads, and two more that may run late: a client stops calling
once two are late (connectors.store.backends.base.BoundedCalls)."""


class Slot:
    """A staging slot taken for one store call: free again once both the call settled and its caller is done with it
    (each calls `release` once)."""

    def __init__(self, staging: Staging, index: int) -> None:
        self._staging, self.index = staging, index
        self.tensor = staging.tensors[index]

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()

    def release(self) -> None:
        self._staging._release(self.index)


class Staging:
    """`count` slots of `slot_bytes` on `device` (the KV caches' device), to be registered with the store client."""

    def __init__(self, slot_bytes: int, device: torch.device | str = "cpu", count: int = SLOTS) -> None:
        self.slot_bytes = slot_bytes
        self.tensors = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(count)]
        self._holders = [0] * count
        self._lock = threading.Lock()

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of every slot."""
        return [(t.data_ptr(), t.numel()) for t in self.tensors]

    def take(self) -> Slot | None:
        """A free slot, held by its call and its caller until both released it; None while every slot is held."""
        with self._lock:
            for index, holders in enumerate(self._holders):
                if not holders:
                    self._holders[index] = 2
                    return Slot(self, index)
        return None

    def _release(self, index: int) -> None:
        with self._lock:
            if self._holders[index] <= 0:
                raise RuntimeError(f"staging slot {index} released more often than taken")
            self._holders[index] -= 1

    def free(self) -> int:
        with self._lock:
            return self._holders.count(0)
