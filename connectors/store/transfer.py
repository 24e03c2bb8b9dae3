"""One rank's shard I/O: block pages <-> pool objects, with the connector's save and load rules.

Separate from the worker's bookkeeping so the benchmark times exactly the path the engine uses. A job's puts
and gets are cut into calls of at most the backend's `call_bytes`, each bounded by what it moves, so a long
prompt is bounded by its progress; once the pool does not answer one, the rest are not asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from connectors.store.backends import Backend, Status
from connectors.store.keys import ShardKey


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


@dataclass(frozen=True)
class SaveResult:
    saved: int
    skipped: int
    """Already pooled (by this or any other instance): not written again."""
    failed: int
    late: bool = False
    """The put outlived its bound and may still be reading the blocks (see Backend.late_calls)."""
    landed: tuple[bool, ...] = ()
    """Per block of the job: its object is in the pool now (written, or already there)."""

    @classmethod
    def nothing_written(cls, blocks: int, *, failed: bool) -> "SaveResult":
        """A save that wrote none of its blocks: all failed, or none was this rank's to write."""
        return cls(0, 0, blocks if failed else 0, landed=(not failed,) * blocks)


class ShardIO:
    def __init__(self, backend: Backend, shard: ShardKey, pages: BlockPages) -> None:
        self.backend, self.shard, self.pages = backend, shard, pages

    def _objects(self, block_ids: Sequence[int], hashes: Sequence[str]):
        keys = self.shard.keys(hashes)
        return keys, [self.pages.ptrs(b) for b in block_ids], [self.pages.sizes()] * len(keys)

    def _in_calls(self, call: Callable[..., list[Status]], keys, ptrs, sizes, go_on: Callable[[Status], bool]):
        """`call` over the objects in pieces of at most the backend's call_bytes; after a piece with a status
        `go_on` refuses, the rest are not asked (REFUSED)."""
        per = max(1, self.backend.call_bytes() // self.pages.object_bytes)
        status: list[Status] = []
        for start in range(0, len(keys), per):
            piece = slice(start, start + per)
            answer = call(keys[piece], ptrs[piece], sizes[piece])
            status += answer
            if not all(map(go_on, answer)):
                return status + [Status.REFUSED] * (len(keys) - len(status))
        return status

    def save(self, block_ids: Sequence[int], hashes: Sequence[str]) -> SaveResult:
        """Write the blocks not yet pooled; if the pool cannot say which those are, write nothing."""
        keys, ptrs, sizes = self._objects(block_ids, hashes)
        present = self.backend.exists(keys)
        if not all(s.answered for s in present):
            return SaveResult.nothing_written(len(keys), failed=True)
        todo = [i for i, s in enumerate(present) if s is Status.MISSING]
        # A put that failed for its objects (no space) leaves the pool answering: the next piece may fit.
        status = self._in_calls(self.backend.put, [keys[i] for i in todo], [ptrs[i] for i in todo],
                                [sizes[i] for i in todo], go_on=lambda s: s not in (Status.TIMEOUT, Status.REFUSED))
        ok = sum(s is Status.OK for s in status)
        landed = [s is Status.OK for s in present]
        for i, s in zip(todo, status):
            landed[i] = s is Status.OK
        return SaveResult(ok, len(keys) - len(todo), len(todo) - ok, Status.TIMEOUT in status, tuple(landed))

    def load(self, block_ids: Sequence[int], hashes: Sequence[str]) -> list[Status]:
        """Fill the blocks' pages; an object of the wrong size is refused and dropped from the pool, so
        that the recomputed block is saved correctly instead of being skipped as already pooled."""
        keys, ptrs, sizes = self._objects(block_ids, hashes)
        # From the first block not loaded on, the request recomputes: the rest would be loaded for nothing.
        status = self._in_calls(self.backend.get, keys, ptrs, sizes, go_on=lambda s: s is Status.OK)
        wrong = [k for k, s in zip(keys, status) if s is Status.WRONG_SIZE]
        if wrong:
            self.backend.remove(wrong)
        return status
