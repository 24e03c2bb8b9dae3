"""ShardIO's rules against a narrow stand-in backend: puts and gets cut into calls of the backend's call_bytes, the
rest not asked once the pool did not answer one, and a block counted as landed (what the pool's BlockStored
events are decided from) only when the pool said so. The real store is in backends/test_mooncake.py."""

from __future__ import annotations

import pytest
import torch

from connectors.store.backends.base import Status
from connectors.store.keys import ShardKey, block_hashes
from connectors.store.transfer import BlockPages, ShardIO

pytestmark = pytest.mark.unit

BLOCKS = 6
HASHES = block_hashes(list(range(16 * BLOCKS)), 16)


class _Backend:
    """Answers each call from `answers[name]` (a list of statuses per call, in order; then `default`)."""

    def __init__(self, object_bytes: int, per_call: int, exists=None, **answers):
        self.per_call_bytes = object_bytes * per_call
        self.exist = exists or (lambda keys: [Status.MISSING] * len(keys))
        self.answers = {name: list(a) for name, a in answers.items()}
        self.calls: list[tuple[str, int]] = []

    def call_bytes(self):
        return self.per_call_bytes

    def exists(self, keys):
        return self.exist(keys)

    def _call(self, name, keys):
        self.calls.append((name, len(keys)))
        planned = self.answers.get(name)
        return [planned.pop(0) if planned else Status.OK for _ in keys]

    def put(self, keys, ptrs, sizes):
        return self._call("put", keys)

    def get(self, keys, ptrs, sizes):
        return self._call("get", keys)

    def remove(self, keys):
        return [Status.OK] * len(keys)


def _io(backend_args, per_call=2):
    pages = BlockPages([torch.zeros(BLOCKS, 4) for _ in range(2)])
    return ShardIO(_Backend(pages.object_bytes, per_call, **backend_args), ShardKey("fp", 0, 0), pages)


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
    assert (result.saved, result.skipped, result.failed, result.late) == (3, 1, 2, True)


def test_a_put_past_its_bound_leaves_the_rest_unasked_and_unlanded():
    io = _io({"put": [Status.TIMEOUT] * 2})  # a call past its bound: every key of it
    result = io.save(range(BLOCKS), HASHES)
    assert io.backend.calls == [("put", 2)] and result.landed == (False,) * BLOCKS and result.late


@pytest.mark.parametrize("answer", [
    lambda keys: [Status.REFUSED] * len(keys),
    lambda keys: [Status.TIMEOUT] * len(keys),
    lambda keys: [Status.MISSING] * (len(keys) - 1) + [Status.FAILED],  # a partial answer
], ids=["refused", "timeout", "partial"])
def test_a_save_whose_existence_check_was_not_answered_writes_nothing_and_lands_nothing(answer):
    io = _io({"exists": answer})
    result = io.save(range(BLOCKS), HASHES)
    assert io.backend.calls == [] and result.landed == (False,) * BLOCKS and result.failed == BLOCKS
