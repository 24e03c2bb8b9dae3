"""Which blocks a step moves and how (kvpp_core/packing.py): the referenced blocks and their runs, the choice
between them and the whole layer, and a packed buffer's round trip over one or two caches of a layer."""

from __future__ import annotations

import pytest
import torch

from kvpp_core.packing import (CALL_BYTES, PACK_PASSES, LayerPack, Move, StepBlocks, call_bytes, choose,
                               pack_buffer_bytes)

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
PAGE = 16 * 576 * 2  # one block of one MLA layer: 16 tokens x 576 bf16 values


def test_step_blocks_are_sorted_unique_ids_and_their_runs():
    step = StepBlocks([9, 3, 4, 5, 3, 11, 10, 0])  # requests sharing a prefix repeat its blocks
    assert step.index.tolist() == [0, 3, 4, 5, 9, 10, 11] and len(step) == 7
    assert step.runs == (range(0, 1), range(3, 6), range(9, 12))
    assert StepBlocks([]).runs == () and StepBlocks([7]).runs == (range(7, 8),)


@pytest.mark.parametrize("fraction, move", [(0.10, Move.PACKED), (0.30, Move.PACKED), (0.34, Move.WHOLE),
                                            (0.50, Move.WHOLE), (1.0, Move.WHOLE)])
def test_a_collective_packs_scattered_blocks_while_three_passes_over_them_touch_less_than_the_layer(fraction, move):
    blocks = 8192  # a 128K-token layer
    step = StepBlocks(range(0, int(blocks * fraction) * 2, 2))  # scattered: a collective per block costs most
    assert choose(step, blocks, PAGE, CPU, collective=True) is move


def test_a_collective_sends_few_runs_as_they_lie_where_a_pack_would_lose_to_the_whole_layer():
    blocks = 8192
    assert choose(StepBlocks(range(4096)), blocks, PAGE, CPU, collective=True) is Move.RUNS  # half, one run
    halves = StepBlocks([b for start in range(0, blocks, 512) for b in range(start, start + 256)])  # half, 16 runs
    assert choose(halves, blocks, PAGE, CPU, collective=True) is Move.RUNS
    shorter = StepBlocks([b for start in range(0, blocks, 64) for b in range(start, start + 32)])  # half, 128 runs
    assert choose(shorter, blocks, PAGE, CPU, collective=True) is Move.WHOLE  # 128 calls cost more than half a layer
    # Each run's call outweighs what it saves once runs are short: then a pack, or the whole layer.
    assert choose(StepBlocks(range(0, 400, 2)), blocks, PAGE, CPU, collective=True) is Move.PACKED
    # Two caches (an SFA layer's) are two calls per run: with small pages the calls dominate.
    assert choose(halves, blocks, PAGE, CPU, collective=True, caches=2) is Move.RUNS
    assert choose(halves, blocks, PAGE // 8, CPU, collective=True, caches=2) is Move.WHOLE


def test_a_copy_run_by_run_pays_each_runs_call():
    blocks, call_pages = 2048, CALL_BYTES["cpu"] / PAGE
    contiguous = StepBlocks(range(1024))  # half the layer in one run: half the bytes
    assert choose(contiguous, blocks, PAGE, CPU, collective=False) is Move.RUNS
    # Every other block: half the bytes, but a call per block costs more than the other half.
    assert call_pages > 1 and choose(StepBlocks(range(0, blocks, 2)), blocks, PAGE, CPU, collective=False) is Move.WHOLE
    assert choose(StepBlocks(range(0, blocks // 5, 2)), blocks, PAGE, CPU, collective=False) is Move.RUNS  # 205 runs
    # Through shared memory nothing is packed, however scattered.
    assert all(choose(StepBlocks(range(0, int(blocks * f) * 2, 2)), blocks, PAGE, CPU, collective=False)
               is not Move.PACKED for f in (0.01, 0.1, 0.3))


def test_blocks_not_known_move_the_whole_layer_and_tiny_layers_too():
    assert choose(None, 8192, PAGE, CPU, collective=True) is Move.WHOLE
    # A layer of 4 blocks: its one referenced block as one run saves the bytes of three, a pack's three calls do not.
    assert choose(StepBlocks([3]), 4, PAGE, CPU, collective=True) is Move.RUNS
    assert choose(StepBlocks([1, 3]), 4, PAGE, CPU, collective=True) is Move.WHOLE  # two calls outweigh two blocks
    assert call_bytes(torch.device("cuda")) > call_bytes(CPU)
    assert call_bytes(CPU, collective=True) > call_bytes(CPU)


def test_a_pack_buffer_holds_a_third_of_the_layer_up_to_the_bound():
    assert pack_buffer_bytes(8192, PAGE) == -(-8192 // PACK_PASSES) * PAGE  # 2731 blocks, 50 MB: under 256 MiB
    assert pack_buffer_bytes(8192, PAGE, bound=100 * PAGE + 5) == 100 * PAGE
    assert pack_buffer_bytes(8192, PAGE, bound=1) == PAGE  # at least one block a chunk


@pytest.mark.parametrize("pages", [(PAGE,), (PAGE, 16 * 128 * 2), (60, 20)], ids=["mla", "mla+indexer", "bytes"])
def test_gather_then_place_puts_exactly_the_indexed_blocks_where_they_were(pages):
    blocks = 12
    gen = torch.Generator().manual_seed(0)
    owner = [torch.randint(0, 256, (blocks, p), dtype=torch.uint8, generator=gen) for p in pages]
    slot = [torch.zeros_like(o) for o in owner]
    sent, got = LayerPack(owner), LayerPack(slot)
    assert sent.rows[0].dtype == (torch.uint8 if pages == (60, 20) else torch.int64)  # 60 is no multiple of 8
    index = torch.tensor([1, 2, 7, 11])
    buffer = torch.empty(len(index) * sent.layer_page_bytes, dtype=torch.uint8)
    payload = sent.gather(index, buffer)
    assert payload.numel() == len(index) * sum(pages)
    got.place(index, payload.clone())  # what arrives: the same bytes, in another rank's buffer
    for o, s in zip(owner, slot):
        assert torch.equal(s[index], o[index])
        untouched = torch.ones(blocks, dtype=torch.bool)
        untouched[index] = False
        assert not s[untouched].any()
