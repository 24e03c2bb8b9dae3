"""Which of a layer's blocks a step moves, and how: exactly the blocks it references, or the whole layer.

A step reads, per foreign layer, only the blocks holding its requests' history (`StepBlocks`); the rest of
the cache may be full of idle histories. The broadcasters (kvpp_core.broadcast, kvpp_core.shm_broadcast)
move exactly those blocks, or the whole layer when that moves and touches fewer bytes (`choose`):

- `Move.PACKED`, over a collective: the owner gathers the blocks of every cache of the layer into one packed
  buffer (`gather`), one collective moves it (one per chunk past `PACK_BOUND_BYTES`), and each receiver places
  the rows at the owner's block ids in its staging slot (`place`): three passes over the referenced bytes
  against one over the whole layer, and one collective call;
- `Move.RUNS`: each run of contiguous block ids as it lies, one collective (or, through shared memory, one copy
  straight from the owner's pages) per run and cache: one pass over the referenced bytes, plus each call's fixed
  cost. It wins where a step's blocks lie in few runs (half a layer in one run), where a pack's three passes
  would lose to the whole layer.

Rows are moved as int64 where a page allows (index kernels are several times slower on byte rows: on an
H200 `index_copy_` of a 128K-token layer's rows took 93 µs as int64, 420 µs as bytes; BRIEF section 11).
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Iterable, Sequence

import torch

PACK_PASSES = 3
"""Passes a packed layer makes over its referenced bytes: the owner's gather, the collective, the placement."""
PACK_BOUND_BYTES = 256 << 20
"""The largest packed buffer of one layer in flight (vLLM's GPU KVPP bounds its own at 256 MiB); a layer
whose referenced blocks take more moves as several chunks, one collective each."""
CALL_BYTES = {"cpu": 64 << 10}
"""A copy call's fixed cost, in bytes it could have copied instead. On this project's CPU hosts a torch copy call
costs about 3.5 µs, 12-53 KiB at the copy's bandwidth (bench/results/packing.json, `calls`), rounded up: in
doubt, a layer moves whole."""
COLLECTIVE_CALL_BYTES = {"cpu": 1 << 20}
"""The same for one collective call between processes on a CPU host: a gloo broadcast of 8 bytes between two
ranks took 0.15 ms, 0.45-0.51 MB at gloo's whole-layer rate (bench/results/packing.json, `layer`:
`collective_call_s`), rounded up to about twice that."""
DEVICE_CALL_BYTES = 16 << 20
"""A call's fixed cost on device memory (a kernel launch, or a collective's latency, of ~8 µs at ~2 TB/s), from
the H200 figures of issue 37 (16 range copies of a 128K-token layer: 203 µs, one whole-layer copy: 79 µs); the
GPU check's packing part measures it."""


def call_bytes(device: torch.device, collective: bool = False) -> int:
    """A copy's (or, `collective`, a collective's) fixed cost on `device`, in bytes."""
    if device.type != "cpu":
        return DEVICE_CALL_BYTES
    return (COLLECTIVE_CALL_BYTES if collective else CALL_BYTES)[device.type]


class Move(enum.Enum):
    """How a layer's blocks travel in a step (see the module's docstring)."""

    WHOLE = "whole"
    RUNS = "runs"
    PACKED = "packed"


class StepBlocks:
    """The blocks a step references: sorted, unique block ids (an int64 CPU tensor: a step of a 128K-token
    batch references thousands), and their runs of contiguous ids, found when first asked for."""

    def __init__(self, block_ids: Iterable[int]) -> None:
        self.index = torch.unique(torch.as_tensor(list(block_ids), dtype=torch.int64))

    def __len__(self) -> int:
        return self.index.numel()

    @functools.cached_property
    def runs(self) -> tuple[range, ...]:
        if not len(self):
            return ()
        index = self.index
        breaks = torch.nonzero(index[1:] != index[:-1] + 1).flatten() + 1
        starts = torch.cat([index[:1], index[breaks]]).tolist()
        stops = torch.cat([index[breaks - 1] + 1, index[-1:] + 1]).tolist()
        return tuple(range(a, b) for a, b in zip(starts, stops))


def choose(step: StepBlocks | None, num_blocks: int, layer_page_bytes: int, device: torch.device,
           collective: bool, caches: int = 1) -> Move:
    """How a layer moves this step: whichever of the whole layer, its referenced runs and (over a collective) a
    pack moves and touches the fewest bytes, each call's fixed cost counted in bytes (`call_bytes`); a tie goes
    to the whole layer. `layer_page_bytes` is one block of every cache of the layer, `caches` how many caches
    (one call each per run, or per whole layer). None (blocks not known): whole."""
    if step is None:
        return Move.WHOLE
    call = call_bytes(device, collective)
    referenced = len(step) * layer_page_bytes
    cost = {Move.WHOLE: num_blocks * layer_page_bytes + caches * call,
            Move.RUNS: referenced + len(step.runs) * caches * call}
    if collective:
        cost[Move.PACKED] = PACK_PASSES * referenced + call + 2 * caches * call_bytes(device)
    return min(cost, key=cost.__getitem__)


def chunk_blocks(layer_page_bytes: int, bound: int = PACK_BOUND_BYTES) -> int:
    """Blocks of a layer one packed chunk holds (at least one, whatever the bound)."""
    return max(1, bound // layer_page_bytes)


def pack_buffer_bytes(num_blocks: int, layer_page_bytes: int, bound: int = PACK_BOUND_BYTES) -> int:
    """One packed buffer: the most blocks `choose` packs (fewer than a third of the layer, since packing
    passes three times over them and moves whole past that), capped at the bound; a bigger pack goes in chunks."""
    most = math.ceil(num_blocks / PACK_PASSES)
    return min(most, chunk_blocks(layer_page_bytes, bound)) * layer_page_bytes


class LayerPack:
    """One layer's caches (`[num_blocks, page_bytes]` byte views) and where a chunk of blocks sits in a packed
    buffer: each cache's rows one after the other."""

    def __init__(self, pages: Sequence[torch.Tensor]) -> None:
        self.page_bytes = [p.shape[1] for p in pages]
        self.layer_page_bytes = sum(self.page_bytes)
        words = all(p.shape[1] % 8 == 0 and p.data_ptr() % 8 == 0 for p in pages)
        self.rows = [p.view(torch.int64) if words else p for p in pages]
        """Each cache's pages as int64 rows where every page's size and address allow, else as bytes."""

    def _views(self, buffer: torch.Tensor, count: int) -> list[torch.Tensor]:
        """The packed buffer as each cache's `count` rows, typed like that cache's rows."""
        views, offset = [], 0
        for r, page in zip(self.rows, self.page_bytes):
            views.append(buffer[offset:offset + count * page].view(r.dtype).view(count, -1))
            offset += count * page
        return views

    def gather(self, index: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """The owner: the rows at `index` of every cache into `buffer`; returns the bytes to send."""
        for src, dst in zip(self.rows, self._views(buffer, len(index))):
            torch.index_select(src, 0, index, out=dst)
        return buffer[:len(index) * self.layer_page_bytes]

    def place(self, index: torch.Tensor, buffer: torch.Tensor) -> None:
        """A receiver: the packed rows back at their block ids."""
        for dst, src in zip(self.rows, self._views(buffer, len(index))):
            dst.index_copy_(0, index, src)
