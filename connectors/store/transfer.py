"""One rank's shard I/O: block pages <-> pool objects, with the connector's save and load rules.

Separate from the worker's bookkeeping so the benchmark times exactly the path the engine uses. A job's puts
and gets are cut into calls of at most the backend's `call_bytes` and a staging slot, each bounded by what it
moves, so a long prompt is bounded by its progress; once the pool does not answer one, the rest are not asked.
Every call moves its objects through a staging slot (connectors.store.staging), never to or from the blocks
themselves, so a call past its bound holds no block. A load given a deadline (its request's pool budget) makes
no call whose bound would end past it.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from connectors.store.backends import Backend, Status
from connectors.store.keys import ShardKey
from connectors.store.staging import Slot, Staging


class BlockPages:
    """Addresses of one object's pieces: for each block, one page per layer, in shard order."""

    def __init__(self, caches: Sequence[torch.Tensor]) -> None:
        page_bytes = {t[0].numel() * t.element_size() for t in caches}
        if len(page_bytes) != 1:
            raise ValueError(f"pool objects need equal per-block pages across layers, got {sorted(page_bytes)}")
        for t in caches:
            if not t[0].is_contiguous():
                raise ValueError(f"cache of shape {tuple(t.shape)} has non-contiguous block pages; "
                                 "the pool connector needs [num_blocks, ...] caches")
        self.page_bytes = page_bytes.pop()
        self._caches = list(caches)
        self._bases = [t.data_ptr() for t in caches]
        self._strides = [t.stride(0) * t.element_size() for t in caches]
        self.num_blocks = caches[0].shape[0]

    @property
    def object_bytes(self) -> int:
        return self.page_bytes * len(self._bases)

    def ptrs(self, block_id: int) -> list[int]:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} outside a cache of {self.num_blocks} blocks")
        return [base + block_id * stride for base, stride in zip(self._bases, self._strides)]

    def sizes(self) -> list[int]:
        return [self.page_bytes] * len(self._bases)

    def staged(self, slot: Slot, n: int) -> list[list[int]]:
        """Where n objects' pieces lie in a staging slot, layer-major: layer l's n pages from l * n pages on."""
        return [[slot.ptr + (layer * n + i) * self.page_bytes for layer in range(len(self._caches))]
                for i in range(n)]

    def gather(self, block_ids: Sequence[int], slot: Slot) -> None:
        """Copy the blocks' pages into the slot (as `staged` lays them out)."""
        self._copy(block_ids, slot, len(block_ids), into_slot=True)

    def scatter(self, block_ids: Sequence[int], slot: Slot, n: int) -> None:
        """Copy the first len(block_ids) of the n objects staged in the slot into the blocks."""
        self._copy(block_ids, slot, n, into_slot=False)

    def _copy(self, block_ids: Sequence[int], slot: Slot, n: int, into_slot: bool) -> None:
        """Host caches: one memmove per run of consecutive pages (single-threaded, without the GIL: torch's
        intra-op threads would compete with the engine's forward for its cores, and on a busy 2-core host ran 10x
        slower); device caches: one index copy per layer (`_copy_indexed`)."""
        for layer, cache in enumerate(self._caches):
            if cache.device.type != "cpu":
                self._copy_indexed(layer, block_ids, slot, n, into_slot)
                continue
            start = layer * n * self.page_bytes
            for i, block, count in _runs(block_ids, self._strides[layer] == self.page_bytes):
                page = self._bases[layer] + block * self._strides[layer]
                staged = slot.ptr + start + i * self.page_bytes
                dst, src = (staged, page) if into_slot else (page, staged)
                ctypes.memmove(dst, src, count * self.page_bytes)

    def _copy_indexed(self, layer: int, block_ids: Sequence[int], slot: Slot, n: int, into_slot: bool) -> None:
        cache, start = self._caches[layer], layer * n * self.page_bytes
        staged = slot.tensor[start:start + len(block_ids) * self.page_bytes].view(cache.dtype)
        staged = staged.view(len(block_ids), *cache.shape[1:])
        ids = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        if into_slot:
            torch.index_select(cache, 0, ids, out=staged)
        else:
            cache.index_copy_(0, ids, staged)


def _runs(block_ids: Sequence[int], contiguous: bool):
    """(position, first block, count) of each run of consecutive block ids (runs of 1 unless pages are contiguous)."""
    i = 0
    while i < len(block_ids):
        j = i + 1
        while contiguous and j < len(block_ids) and block_ids[j] == block_ids[j - 1] + 1:
            j += 1
        yield i, block_ids[i], j - i
        i = j


@dataclass(frozen=True)
class SaveResult:
    saved: int
    skipped: int
    """Already pooled (by this or any other instance): not written again."""
    failed: int
    landed: tuple[bool, ...] = ()
    """Per block of the job: its object is in the pool now (written, or already there)."""
    refused: int = 0
    """Of the failed, blocks not asked: the breaker was open (or no staging slot was free)."""
    timeouts: int = 0
    """Of the failed, blocks whose put missed its bound."""

    @classmethod
    def nothing_written(cls, blocks: int, *, failed: bool, refused: bool = False) -> "SaveResult":
        """A save that wrote none of its blocks: all failed (all refused, if the breaker refused its existence
        check), or none was this rank's to write."""
        return cls(0, 0, blocks if failed else 0, (not failed,) * blocks, blocks if refused else 0)


class ShardIO:
    def __init__(self, backend: Backend, shard: ShardKey, pages: BlockPages, staging: Staging) -> None:
        self.backend, self.shard, self.pages, self.staging = backend, shard, pages, staging

    def _in_calls(self, save: bool, block_ids: Sequence[int], keys: Sequence[str], go_on: Callable[[Status], bool],
                  deadline: float | None = None) -> list[Status]:
        """Put or get the objects in calls of at most the backend's call_bytes and a slot; after a call with a
        status `go_on` refuses, the rest are not asked (OVER_BUDGET after a call the deadline could not cover,
        else REFUSED)."""
        per = max(1, min(self.backend.call_bytes(), self.staging.slot_bytes) // self.pages.object_bytes)
        status: list[Status] = []
        for start in range(0, len(keys), per):
            answer = self._call(save, block_ids[start:start + per], keys[start:start + per], deadline)
            status += answer
            if not all(map(go_on, answer)):
                rest = Status.OVER_BUDGET if Status.OVER_BUDGET in answer else Status.REFUSED
                return status + [rest] * (len(keys) - len(status))
        return status

    def _call(self, save: bool, block_ids: Sequence[int], keys: Sequence[str], deadline: float | None) -> list[Status]:
        """One put or get through a staging slot: the blocks copied in before a put, out after a get (its objects up
        to the first it did not load whole). The slot is free again once the store call settled."""
        n = len(keys)
        if deadline is not None and time.monotonic() + self.backend.bound_s(n * self.pages.object_bytes) > deadline:
            return [Status.OVER_BUDGET] * n
        slot = self.staging.take()
        if slot is None:  # every slot is held by a call still running past its bound
            return [Status.REFUSED] * n
        try:
            if save:
                self.pages.gather(block_ids, slot)
            call = self.backend.put if save else self.backend.get
            status = call(keys, self.pages.staged(slot, n), [self.pages.sizes()] * n, settled=slot.release)
            whole = next((i for i, s in enumerate(status) if s is not Status.OK), n)
            if not save and whole:
                self.pages.scatter(block_ids[:whole], slot, n)
        finally:
            slot.release()
        return status

    def save(self, block_ids: Sequence[int], hashes: Sequence[str]) -> SaveResult:
        """Write the blocks not yet pooled; if the pool cannot say which those are, write nothing."""
        keys = self.shard.keys(hashes)
        present = self.backend.exists(keys)
        if not all(s.answered for s in present):
            return SaveResult.nothing_written(len(keys), failed=True, refused=Status.REFUSED in present)
        todo = [i for i, s in enumerate(present) if s is Status.MISSING]
        # A put that failed for its objects (no space) leaves the pool answering: the next piece may fit.
        status = self._in_calls(True, [block_ids[i] for i in todo], [keys[i] for i in todo],
                                go_on=lambda s: s not in (Status.TIMEOUT, Status.REFUSED))
        ok = sum(s is Status.OK for s in status)
        landed = [s is Status.OK for s in present]
        for i, s in zip(todo, status):
            landed[i] = s is Status.OK
        return SaveResult(ok, len(keys) - len(todo), len(todo) - ok, tuple(landed), status.count(Status.REFUSED),
                          status.count(Status.TIMEOUT))

    def load(self, block_ids: Sequence[int], hashes: Sequence[str], deadline: float | None = None) -> list[Status]:
        """Fill the blocks' pages, making no call whose bound would end past `deadline` (time.monotonic); an object
        of the wrong size is refused and dropped from the pool, so that the recomputed block is saved correctly
        instead of being skipped as already pooled."""
        keys = self.shard.keys(hashes)
        # From the first block not loaded on, the request recomputes: the rest would be loaded for nothing.
        status = self._in_calls(False, block_ids, keys, go_on=lambda s: s is Status.OK, deadline=deadline)
        wrong = [k for k, s in zip(keys, status) if s is Status.WRONG_SIZE]
        if wrong:
            self.backend.remove(wrong)
        return status
