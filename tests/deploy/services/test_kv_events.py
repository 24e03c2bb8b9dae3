"""vLLM's KV event wire format as the proxy reads it: what vLLM's own classes encode decodes to what the index
needs, and what does not add up is refused by kind, never raised as anything else."""

import time

import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from deploy.services import kv_events
from deploy.services.kv_events import Refused, decode_message

encode = msgspec.msgpack.Encoder().encode


def frames(seq, payload):
    return [b"", seq.to_bytes(8, "big", signed=True), payload]


@pytest.mark.unit
def test_vllms_own_batches_decode():
    batch = KVEventBatch(ts=time.time(), events=[
        BlockStored(block_hashes=[b"h1", b"h2"], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[b"h1"], medium="GPU"), AllBlocksCleared()])
    seq, decoded = decode_message(frames(7, encode(batch)))
    assert seq == 7
    stored, removed, cleared = decoded.events
    assert isinstance(stored, kv_events.BlockStored) and stored.block_hashes == [b"h1", b"h2"]
    assert stored.token_ids == list(range(8)) and stored.medium == "GPU"
    assert isinstance(removed, kv_events.BlockRemoved) and removed.block_hashes == [b"h1"]
    assert isinstance(cleared, kv_events.AllBlocksCleared)


@pytest.mark.unit
@pytest.mark.parametrize("message, kind", [
    ([b"one frame"], "frames"),
    ([b"", b"\x00\x01", encode(KVEventBatch(ts=1.0, events=[]))], "frames"),
    (frames(0, b"\xc1garbage"), "decode"),
    (frames(0, encode({"ts": 1, "events": []})), "decode"),
    (frames(0, encode([1.0, [{"type": "Nonsense"}]])), "decode"),
    (frames(0, encode(KVEventBatch(ts=1.0, events=[BlockStored(
        block_hashes=[b"h"], parent_block_hash=None, token_ids=[1, 2, 3], block_size=4, lora_id=None,
        medium="GPU", lora_name=None)]))), "invalid"),
])
def test_what_does_not_add_up_is_refused_by_kind(message, kind):
    with pytest.raises(Refused) as refused:
        decode_message(message)
    assert refused.value.kind == kind
