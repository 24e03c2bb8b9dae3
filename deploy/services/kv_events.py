"""vLLM's KV cache events as they travel: the wire format the proxy reads, and its checks.

A prefill started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`
publishes every block its scheduler adds to or evicts from the prefix cache over ZMQ PUB, as frames
(topic, 8-byte big-endian sequence number, msgpack `KVEventBatch`); with a `replay_endpoint` it also answers
a request for the batches from a sequence number on, from a buffer of its last `buffer_steps` batches
(vllm/distributed/kv_events.py, `ZmqEventPublisher`). deploy/services/event_stream.py follows both,
deploy/services/prefix_index.py keeps what they say.
"""

from __future__ import annotations

from typing import Any

import msgspec

Hash = bytes | int
"""vLLM's external block hash: sha256 bytes, or an int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES."""
SEQ_BYTES = 8
END_OF_REPLAY = -1
"""The sequence number of the frame that ends a replay (vLLM's `ZmqEventPublisher.END_SEQ`)."""


# -- vLLM 0.32's wire format (vllm/distributed/kv_events.py), the fields the index reads -------------------
class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


class Refused(ValueError):
    """A message the proxy cannot apply; `kind` labels it on /metrics and in the log."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


def sequence_number(frames: list[bytes]) -> int:
    """The sequence number of one message (a PUB message, or a replayed one less its empty delimiter)."""
    if len(frames) != 3:
        raise Refused("frames", f"{len(frames)} frames, not (topic, seq, payload)")
    if len(frames[1]) != SEQ_BYTES:
        raise Refused("frames", f"a sequence frame of {len(frames[1])} bytes, not {SEQ_BYTES}")
    return int.from_bytes(frames[1], "big", signed=True)


def decode_message(frames: list[bytes]) -> tuple[int, KVEventBatch]:
    """(sequence number, batch) of one message, every event checked for what the index relies on."""
    seq = sequence_number(frames)
    payload = frames[2]
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise Refused("decode", str(exc)) from None
    for event in batch.events:
        if isinstance(event, BlockStored) and (
                event.block_size <= 0 or len(event.token_ids) != len(event.block_hashes) * event.block_size):
            raise Refused("invalid", f"BlockStored of {len(event.block_hashes)} blocks of {event.block_size} "
                          f"tokens carries {len(event.token_ids)} token ids")
    return seq, batch
