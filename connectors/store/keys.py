"""Pool object keys: a content hash chain over whole token blocks plus what makes the bytes comparable.

Every process of every node must derive the same key for the same tokens, so nothing here may depend
on Python's salted `hash()` or on process state: sha256 over a canonical encoding only.

A block's hash also covers its *extra keys*: what vLLM's own prefix-cache hasher adds to the tokens
(cache_salt, LoRA adapter, multimodal feature hashes, prompt-embedding digests), taken per block from
vLLM itself (connectors.store.request_keys). Two requests share a pooled block exactly when vLLM would
let them share a prefix-cache block, so one tenant's prefix never serves another.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from connectors.common.kv_caches import Heads, heads_text

# v2: block hashes cover vLLM's extra keys; v1 objects (token ids only) are never matched.
_CHAIN_ROOT = hashlib.sha256(b"kvpp-pool/v2").digest()
HASH_HEX_LEN = 64


class UnhashableExtraKeys(ValueError):
    """vLLM produced an extra key this module cannot encode canonically: the request is not pooled."""


def encode_extra_keys(extra: tuple[Any, ...] | None) -> bytes:
    """Canonical bytes of one block's extra keys (msgpack: str, bytes, ints and tuples are unambiguous)."""
    if extra is None:
        return b""
    try:
        return msgspec.msgpack.encode(extra)
    except (TypeError, msgspec.EncodeError) as exc:
        raise UnhashableExtraKeys(f"extra key {extra!r} has no canonical encoding: {exc}") from exc


def block_hashes(
    token_ids: Sequence[int], block_size: int, extra_keys: Sequence[tuple[Any, ...] | None] | None = None
) -> list[str]:
    """sha256 chain over the whole blocks of `token_ids` (a trailing partial block gets no hash).

    Hash i covers blocks 0..i, so equal hashes mean equal prefixes, not just equal blocks.
    `extra_keys[i]` (vLLM's extra keys of block i, or None) is hashed with block i's tokens; blocks
    without an entry have none.
    """
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    extra_keys = extra_keys or ()
    hashes: list[str] = []
    parent = _CHAIN_ROOT
    for i, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        block = token_ids[start : start + block_size]
        extra = encode_extra_keys(extra_keys[i] if i < len(extra_keys) else None)
        # Tokens have a fixed width, so the variable-length extra bytes cannot alias them.
        digest = hashlib.sha256(parent + struct.pack(f"<{block_size}q", *block) + extra).digest()
        hashes.append(digest.hex())
        parent = digest
    return hashes


@dataclass(frozen=True)
class CacheLayout:
    """What an object's bytes depend on besides the tokens: equal fingerprints mean loadable bytes."""

    model: str
    dtype: str
    block_size: int
    page_bytes: int
    """Bytes of one layer's page for one block."""

    def fingerprint(self, layer_ids: Iterable[int | str]) -> str:
        """Short digest over the layout and the layer set one object holds."""
        doc = {
            "model": self.model,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "page_bytes": self.page_bytes,
            "layers": sorted(str(l) for l in layer_ids),
        }
        canon = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(canon).hexdigest()[:16]


@dataclass(frozen=True)
class ShardKey:
    """The non-content part of a key: one (PP stage, KV heads, owner rank) shard with its layer fingerprint.

    A GQA shard's key names the KV heads it holds (`h0`, `h0-3`): two heads of one layer are two objects, and ranks
    of any TP size holding the same heads find the same object. An MLA/SFA shard (`heads` None) holds the one cache
    every rank holds, and its key names no head.
    """

    fingerprint: str
    pp_rank: int
    owner: int
    heads: Heads = None

    def key(self, block_hash: str) -> str:
        heads = "" if self.heads is None else f"h{heads_text(self.heads)}/"
        return f"kvpp/{self.fingerprint}/pp{self.pp_rank}/{heads}o{self.owner}/{block_hash}"

    def keys(self, hashes: Iterable[str]) -> list[str]:
        return [self.key(h) for h in hashes]
