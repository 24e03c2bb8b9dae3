"""ShardIO's rules against a narrow stand-in backend: puts and gets cut into calls of the backend's call_bytes, the
rest not asked once the pool did not answer one, a block counted as landed (what the pool's BlockStored
events are decided from) only when the pool said so, bytes moved through staging slots only (a late call holds its
slot, never a block), and no call whose bound a load's deadline cannot cover. The real store is in
backends/test_mooncake.py."""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

from connectors.store.backends.base import Status
from connectors.store.keys import ShardKey, block_hashes
from connectors.store.staging import Staging
from connectors.store.transfer import BlockPages, ShardIO

pytestmark = pytest.mark.unit

BLOCKS = 6
HASHES = block_hashes(list(range(16 * BLOCKS)), 16)


class _Backend:
    """Answers each call from `answers[name]` (a list of statuses per call, in order; then `default`)."""

    def __init__(self, object_bytes: int, per_call: int, exists=None, bound_s=1.0, **answers):
        self.per_call_bytes = object_bytes * per_call
        self.exist = exists or (lambda keys: [Status.MISSING] * len(keys))
        self.answers = {name: list(a) for name, a in answers.items()}
        self.calls: list[tuple[str, int]] = []
        self.bound = bound_s
        self.late: list = []
        """The `settled` of calls that returned TIMEOUT: called when the test lets the late call return."""

    def call_bytes(self):
        return self.per_call_bytes

    def bound_s(self, nbytes):
        return self.bound

    def exists(self, keys):
        return self.exist(keys)

    def _call(self, name, keys, settled):
        self.calls.append((name, len(keys)))
        planned = self.answers.get(name)
        status = [planned.pop(0) if planned else Status.OK for _ in keys]
        if Status.TIMEOUT in status:
            self.late.append(settled)
        else:
            settled()
        return status

    def put(self, keys, ptrs, sizes, settled):
        return self._call("put", keys, settled)

    def get(self, keys, ptrs, sizes, settled):
        return self._call("get", keys, settled)

    def remove(self, keys):
        return [Status.OK] * len(keys)


def _io(backend_args, per_call=2, slots=4):
    pages = BlockPages([torch.zeros(BLOCKS, 4) for _ in range(2)])
    return ShardIO(_Backend(pages.object_bytes, per_call, **backend_args), ShardKey("fp", 0, 0), pages,
                   Staging(pages.object_bytes * 8, count=slots))


def test_a_load_is_cut_into_calls_and_stops_asking_at_the_first_block_it_could_not_load():
    io = _io({"get": [Status.OK, Status.OK, Status.OK, Status.TIMEOUT]})
    status = io.load(range(BLOCKS), HASHES)
    assert io.backend.calls == [("get", 2), ("get", 2)], "two blocks a call; the third call is not made"
    assert status == [Status.OK] * 3 + [Status.TIMEOUT] + [Status.REFUSED] * 2


def test_a_save_counts_a_block_landed_only_when_the_pool_said_so():
    present = lambda keys: [Status.OK] + [Status.MISSING] * (len(keys) - 1)  # noqa: E731 - block 0 already pooled
    io = _io({"exists": present, "put": [Status.OK, Status.FAILED, Status.OK, Status.OK, Status.TIMEOUT]})
    result = io.save(range(BLOCKS), HASHES)
    # Blocks 1-5 to write, 2 a call: (1, 2) OK/FAILED (no space: the pool answered), (3, 4) OK, (5) past its bound.
    assert io.backend.calls == [("put", 2), ("put", 2), ("put", 1)]
    assert result.landed == (True, True, False, True, True, False)
    assert (result.saved, result.skipped, result.failed, result.timeouts) == (3, 1, 2, 1)


def test_a_put_past_its_bound_leaves_the_rest_unasked_and_unlanded():
    io = _io({"put": [Status.TIMEOUT] * 2})  # a call past its bound: every key of it
    result = io.save(range(BLOCKS), HASHES)
    assert io.backend.calls == [("put", 2)] and result.landed == (False,) * BLOCKS
    assert (result.failed, result.timeouts, result.refused) == (BLOCKS, 2, BLOCKS - 2)


@pytest.mark.parametrize("answer", [
    lambda keys: [Status.REFUSED] * len(keys),
    lambda keys: [Status.TIMEOUT] * len(keys),
    lambda keys: [Status.MISSING] * (len(keys) - 1) + [Status.FAILED],  # a partial answer
], ids=["refused", "timeout", "partial"])
def test_a_save_whose_existence_check_was_not_answered_writes_nothing_and_lands_nothing(answer):
    io = _io({"exists": answer})
    result = io.save(range(BLOCKS), HASHES)
    assert io.backend.calls == [] and result.landed == (False,) * BLOCKS and result.failed == BLOCKS
    assert result.refused == (BLOCKS if answer([""]) == [Status.REFUSED] else 0)


class _MemoryStore(_Backend):
    """Keeps each object's bytes, copied from and to the addresses a call names (as the native client does)."""

    def __init__(self, object_bytes, per_call, **answers):
        super().__init__(object_bytes, per_call, **answers)
        self.objects: dict[str, bytes] = {}

    def put(self, keys, ptrs, sizes, settled):
        for key, pieces, lengths in zip(keys, ptrs, sizes):
            self.objects[key] = b"".join(ctypes.string_at(p, n) for p, n in zip(pieces, lengths))
        return self._call("put", keys, settled)

    def get(self, keys, ptrs, sizes, settled):
        for key, pieces, lengths in zip(keys, ptrs, sizes):
            data = self.objects[key]
            for p, n in zip(pieces, lengths):
                ctypes.memmove(p, data[:n], n)
                data = data[n:]
        return self._call("get", keys, settled)


def test_blocks_saved_and_loaded_through_staging_slots_arrive_intact_at_other_block_ids():
    src = [torch.randn(BLOCKS, 4, 3) for _ in range(3)]
    dst = [torch.zeros(BLOCKS, 4, 3) for _ in range(3)]
    pages = BlockPages(src)
    store = _MemoryStore(pages.object_bytes, per_call=4)
    staging = Staging(pages.object_bytes * 4, count=1)
    ShardIO(store, ShardKey("fp", 0, 0), pages, staging).save([5, 0, 3, 1, 2], HASHES[:5])
    status = ShardIO(store, ShardKey("fp", 0, 0), BlockPages(dst), staging).load([0, 1, 2, 3, 4], HASHES[:5])
    assert status == [Status.OK] * 5 and store.calls == [("put", 4), ("put", 1), ("get", 4), ("get", 1)]
    for s, d in zip(src, dst):
        assert torch.equal(d[:5], s[[5, 0, 3, 1, 2]]) and not d[5].any()
    assert staging.free() == 1


def test_device_caches_are_staged_by_index_copies_in_the_same_layout():
    """Device caches (GPU, NPU) are copied by one index copy per layer instead of host memmoves; no device here, so
    the index path runs on host tensors: the slot holds the same bytes either way, and they come back the same."""
    caches = [torch.randn(BLOCKS, 4, 3) for _ in range(2)]
    pages = BlockPages(caches)
    ids = [4, 1, 2]
    memmoved, indexed = Staging(pages.object_bytes * 4, count=2).take(), Staging(pages.object_bytes * 4).take()
    pages.gather(ids, memmoved)
    for layer in range(2):
        pages._copy_indexed(layer, ids, indexed, len(ids), into_slot=True)
    used = len(ids) * pages.object_bytes
    assert torch.equal(memmoved.tensor[:used], indexed.tensor[:used])
    copies = [c.clone() for c in caches]
    for c in caches:
        c.zero_()
    for layer in range(2):
        pages._copy_indexed(layer, ids, indexed, len(ids), into_slot=False)
    for c, o in zip(caches, copies):
        assert torch.equal(c[ids], o[ids]) and not c[[0, 3, 5]].any()


def test_a_get_past_its_bound_holds_its_slot_not_its_blocks():
    """The late get would write into the slot, never into the blocks; the slot stays out of use until it returned,
    and with every slot held by late calls a load is refused without a call."""
    io = _io({"get": [Status.TIMEOUT] * 2}, slots=1)
    status = io.load(range(BLOCKS), HASHES)
    assert status == [Status.TIMEOUT] * 2 + [Status.REFUSED] * 4 and io.staging.free() == 0
    io.backend.calls.clear()
    assert io.load(range(BLOCKS), HASHES) == [Status.REFUSED] * BLOCKS and io.backend.calls == []
    (settled,) = io.backend.late
    settled()  # the late get returned
    assert io.staging.free() == 1 and io.load(range(BLOCKS), HASHES) == [Status.OK] * BLOCKS


def test_a_load_makes_no_call_its_deadline_cannot_cover():
    io = _io({}, per_call=2)
    io.backend.bound = 1.0
    assert io.load(range(BLOCKS), HASHES, deadline=time.monotonic() + 0.5) == [Status.OVER_BUDGET] * BLOCKS
    assert io.backend.calls == []
    status = io.load(range(BLOCKS), HASHES, deadline=time.monotonic() + 60)
    assert status == [Status.OK] * BLOCKS and io.backend.calls == [("get", 2)] * 3
