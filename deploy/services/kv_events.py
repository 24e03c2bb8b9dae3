"""vLLM's KV cache events as they travel: the wire format the proxy reads, and its checks.

A prefill started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`
publishes every block its scheduler adds to or evicts from the prefix cache over ZMQ PUB, as frames
(topic, 8-byte big-endian sequence number, msgpack `KVEventBatch`); with a `replay_endpoint` it also answers
a request for the batches from a sequence number on, from a buffer of its last `buffer_steps` batches
(vllm/distributed/kv_events.py, `ZmqEventPublisher`). deploy/services/event_stream.py follows both,
deploy/services/prefix_index.py keeps what they say.

Whatever a publisher sends is checked here against what the index can hold, so that the index's hot path
checks nothing: a message that is not a batch is refused whole (`Refused`), a stored event the index cannot
represent is left out of its batch and reported, and nothing else is ever raised.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

Hash = bytes | int
"""vLLM's external block hash: sha256 bytes, or an int with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES."""
SEQ_BYTES = 8
END_OF_REPLAY = -1
"""The sequence number of the frame that ends a replay (vLLM's `ZmqEventPublisher.END_SEQ`)."""

MAX_MESSAGE_BYTES = 64 << 20
"""The largest message read (ZMQ's MAXMSGSIZE on the proxy's sockets: a larger one drops the connection).
A step's batch carries the token ids of the blocks it cached (tens of thousands of tokens, a few bytes each)
and of the prefixes its full reports announce again: megabytes at most."""
MAX_EVENTS = 1 << 18
"""Events in one batch (vLLM sends one per request that cached blocks, and one per evicted block)."""
MAX_BLOCKS = 1 << 18
"""Blocks in one stored event (a 4M-token prompt of 16-token blocks)."""
MAX_BLOCK_SIZE = 1 << 16
"""Tokens in a block (vLLM's are 16 to a few thousand for hybrid models)."""
MAX_TOKEN_ID = (1 << 63) - 1
"""The index keys blocks by their token ids as signed 64-bit integers."""
MAX_INT_HASH = (1 << 64) - 1
"""vLLM's int block hashes are the low 64 bits of its hash, unsigned."""
MAX_HASH_BYTES = 64
"""vLLM's bytes block hashes are a digest: 32 bytes for sha256."""
REFUSED_KINDS = ("frames", "size", "decode", "invalid", "range", "block_size")
"""Why a message or an event was refused: frames (not topic, seq, payload, or a negative sequence number),
size (past a bound: events in a batch, blocks in an event, tokens in a block), decode (not vLLM's KVEventBatch,
or nested past the decoder's depth), invalid (token ids that do not fill the event's blocks, no blocks),
range (a token id or a block hash the index cannot hold), block_size (not the prefills' block size the proxy was
told, `--kv-events-block-size`)."""


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
    """A message or an event the proxy cannot apply; `kind` (one of REFUSED_KINDS) labels it on /metrics and in
    the log."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


class Decoded(NamedTuple):
    seq: int
    batch: KVEventBatch
    """The batch, less the stored events in `refused`."""
    refused: list[Refused]
    """Stored events left out: the index does not hold their blocks, which costs hits and nothing else (a removal
    or a parent naming them finds nothing)."""


def sequence_number(frames: list[bytes]) -> int:
    """The sequence number of one message (a PUB message, or a replayed one less its empty delimiter)."""
    if len(frames) != 3:
        raise Refused("frames", f"{len(frames)} frames, not (topic, seq, payload)")
    if len(frames[1]) != SEQ_BYTES:
        raise Refused("frames", f"a sequence frame of {len(frames[1])} bytes, not {SEQ_BYTES}")
    return int.from_bytes(frames[1], "big", signed=True)


def decode_message(frames: list[bytes]) -> Decoded:
    """One message, its stored events checked for what the index relies on; raises Refused, and nothing else,
    for a message that is not a batch."""
    seq = sequence_number(frames)
    if seq < 0:
        raise Refused("frames", f"sequence number {seq}")
    try:
        batch = _decoder.decode(frames[2])
    except msgspec.DecodeError as exc:
        raise Refused("decode", str(exc)) from None
    except RecursionError:  # msgspec's own limit on nesting (extra_keys are any msgpack)
        raise Refused("decode", "nested past the decoder's depth") from None
    if len(batch.events) > MAX_EVENTS:
        raise Refused("size", f"a batch of {len(batch.events)} events, over {MAX_EVENTS}")
    kept, refused = [], []
    for event in batch.events:
        problem = _stored_problem(event) if isinstance(event, BlockStored) else None
        if problem is None:
            kept.append(event)
        else:
            refused.append(problem)
    if refused:
        batch.events = kept
    return Decoded(seq, batch, refused)


def _stored_problem(event: BlockStored) -> Refused | None:
    """Why the index cannot hold `event`'s blocks, if it cannot."""
    blocks, size, tokens = len(event.block_hashes), event.block_size, event.token_ids
    if blocks > MAX_BLOCKS or not 0 < size <= MAX_BLOCK_SIZE:
        return Refused("size", f"BlockStored of {blocks} blocks of {size} tokens (at most {MAX_BLOCKS} of "
                       f"1 to {MAX_BLOCK_SIZE})")
    if not blocks or len(tokens) != blocks * size:
        return Refused("invalid", f"BlockStored of {blocks} blocks of {size} tokens carries {len(tokens)} "
                       "token ids")
    if min(tokens) < 0 or max(tokens) > MAX_TOKEN_ID:
        return Refused("range", f"BlockStored with token ids from {min(tokens)} to {max(tokens)}, outside "
                       f"0 to {MAX_TOKEN_ID}")
    for block_hash in (event.parent_block_hash, *event.block_hashes):
        if type(block_hash) is int:
            if not 0 <= block_hash <= MAX_INT_HASH:
                return Refused("range", f"BlockStored with the int hash {block_hash}, outside 0 to {MAX_INT_HASH}")
        elif block_hash is not None and len(block_hash) > MAX_HASH_BYTES:
            return Refused("range", f"BlockStored with a hash of {len(block_hash)} bytes, over {MAX_HASH_BYTES}")
    return None
