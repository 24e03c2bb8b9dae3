"""vLLM's KV event wire format as the proxy reads it: what vLLM's own classes encode decodes to what the index
needs; a message that is not a batch is refused whole by kind, a stored event the index cannot hold is left out of
its batch by kind, and nothing else is ever raised."""

import time

import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from deploy.services import kv_events
from deploy.services.kv_events import MAX_BLOCK_SIZE, MAX_EVENTS, MAX_HASH_BYTES, Refused, decode_message

encode = msgspec.msgpack.Encoder().encode


def frames(seq, payload):
    return [b"", seq.to_bytes(8, "big", signed=True), payload]


def stored(hashes=(b"h",), tokens=(1, 2, 3, 4), block_size=4, parent=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                       block_size=block_size, lora_id=None, medium="GPU", lora_name=None)


@pytest.mark.unit
def test_vllms_own_batches_decode():
    batch = KVEventBatch(ts=time.time(), events=[
        BlockStored(block_hashes=[b"h1", b"h2"], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                    lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[b"h1"], medium="GPU"), AllBlocksCleared()])
    seq, decoded, refused = decode_message(frames(7, encode(batch)))
    assert seq == 7 and refused == []
    stored_, removed, cleared = decoded.events
    assert isinstance(stored_, kv_events.BlockStored) and stored_.block_hashes == [b"h1", b"h2"]
    assert stored_.token_ids == list(range(8)) and stored_.medium == "GPU"
    assert isinstance(removed, kv_events.BlockRemoved) and removed.block_hashes == [b"h1"]
    assert isinstance(cleared, kv_events.AllBlocksCleared)


NESTED = encode([1.0, [{"type": "BlockStored", "block_hashes": [b"h"], "parent_block_hash": None,
                        "token_ids": [1, 2, 3, 4], "block_size": 4, "extra_keys": "here"}]])
NESTED = NESTED.replace(b"\xa4here", b"\x91" * 100_000 + b"\xc0")


@pytest.mark.unit
@pytest.mark.parametrize("message, kind", [
    ([b"one frame"], "frames"),
    ([b"", b"\x00\x01", encode(KVEventBatch(ts=1.0, events=[]))], "frames"),
    (frames(-5, encode(KVEventBatch(ts=1.0, events=[]))), "frames"),
    (frames(0, b"\xc1garbage"), "decode"),
    (frames(0, encode({"ts": 1, "events": []})), "decode"),
    (frames(0, encode([1.0, [{"type": "Nonsense"}]])), "decode"),
    (frames(0, encode(KVEventBatch(ts=1.0, events=[stored(tokens=[1.5, 2, 3, 4])]))), "decode"),
    (frames(0, NESTED), "decode"),  # extra_keys take any msgpack: here nested past msgspec's depth
    (frames(0, encode(KVEventBatch(ts=1.0, events=[AllBlocksCleared()] * (MAX_EVENTS + 1)))), "size"),
])
def test_what_is_not_a_batch_is_refused_whole(message, kind):
    with pytest.raises(Refused) as refused:
        decode_message(message)
    assert refused.value.kind == kind


@pytest.mark.unit
@pytest.mark.parametrize("event, kind", [
    (stored(tokens=[2 ** 63, 2, 3, 4]), "range"),  # valid msgpack (uint64), not an int64 key
    (stored(tokens=[1, 2, -1, 4]), "range"),
    (stored(hashes=[-5]), "range"),  # vLLM's int hashes are unsigned 64-bit
    (stored(parent=-1), "range"),
    (stored(hashes=[b"h" * (MAX_HASH_BYTES + 1)]), "range"),
    (stored(tokens=[], block_size=0, hashes=[b"h"]), "size"),
    (stored(tokens=[1] * (MAX_BLOCK_SIZE + 1), block_size=MAX_BLOCK_SIZE + 1), "size"),
    (stored(tokens=[1, 2, 3]), "invalid"),
    (stored(hashes=[], tokens=[]), "invalid"),
])
def test_a_stored_event_the_index_cannot_hold_is_left_out_of_its_batch(event, kind):
    """Refused by kind, the rest of its batch kept: not holding a block costs hits, and a removal or a parent naming
    it finds nothing, so nothing else of the batch need be lost."""
    good = stored(hashes=[2 ** 64 - 1], tokens=[0, 1, 2, 2 ** 63 - 1])  # the extremes the index can hold
    batch = KVEventBatch(ts=1.0, events=[good, event, BlockRemoved(block_hashes=[b"x"], medium="GPU")])
    seq, decoded, refused = decode_message(frames(3, encode(batch)))
    assert seq == 3 and [r.kind for r in refused] == [kind]
    assert [type(e).__name__ for e in decoded.events] == ["BlockStored", "BlockRemoved"]
    assert decoded.events[0].block_hashes == [2 ** 64 - 1]


@pytest.mark.unit
def test_an_event_of_another_block_size_than_the_proxy_was_told_is_refused_not_learned():
    """With the prefills' block size given (`--kv-events-block-size`, which `kvpp render` passes from the spec), a
    stored event of another size is refused and counted, and cannot make the index learn its size; the index keeps
    that size after it is emptied, so a good event after it is indexed."""
    from prometheus_client import CollectorRegistry

    from deploy.services.event_stream import EventMetrics, EventStream
    from deploy.services.prefix_index import PrefixIndex

    def message(seq, size):
        event = BlockStored(block_hashes=[b"h%d" % seq], parent_block_hash=None, token_ids=list(range(size)),
                            block_size=size, lora_id=None, medium="GPU", lora_name=None)
        payload = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[event]))
        return [b"", seq.to_bytes(8, "big"), payload]

    registry = CollectorRegistry()
    stream = EventStream("p0", "tcp://127.0.0.1:1", PrefixIndex(100, block_size=4), EventMetrics(registry), 5.0)
    stream.handle(message(0, 8))  # a hostile or misconfigured first event
    assert len(stream.index) == 0 and stream.index.block_size == 4
    assert registry.get_sample_value("kvpp_proxy_kv_event_refused_total", {"backend": "p0", "kind": "block_size"}) == 1
    stream.handle(message(1, 4))
    assert len(stream.index) == 1
    stream.index.clear()
    assert stream.index.block_size == 4
