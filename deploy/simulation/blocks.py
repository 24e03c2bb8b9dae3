"""Block identity: the chained hashes of a sequence's full blocks, as the simulator keys its prefix caches.

vLLM chains sha256 over (parent hash, the block's token ids, extra keys); the simulator needs only the same
equalities, so it chains a 64-bit BLAKE2b over the parent's hash and the block's token ids (two blocks are the same
block exactly when they and all blocks before them hold the same tokens). Traces that must not carry text give
block hashes instead, at a block size of their own (`resample` names the simulated blocks from them), either
chained already (this project's format) or one per block, each naming its tokens alone (the public traces':
`chain_ids` chains them, so that two blocks match only when every block before them matches too).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import numba
import numpy as np

SEED = b"kvpp-simulation"
_SEED_ID = np.uint64(0x6B767070_73696D75)
"""Where `chain_ids` starts a chain (any constant: chains are compared with chains only)."""


def token_block_hashes(tokens: Sequence[int], block_size: int, parent: int | None = None) -> np.ndarray:
    """The hashes of the full blocks of `tokens` (continuing the chain after `parent`, a previous block's hash)."""
    raw = array("q", tokens).tobytes()
    width = 8 * block_size
    count = len(tokens) // block_size
    out = np.empty(count, np.int64)
    prev = SEED if parent is None else int(parent).to_bytes(8, "little", signed=True)
    for i in range(count):
        digest = hashlib.blake2b(prev, digest_size=8)
        digest.update(raw[i * width:(i + 1) * width])
        prev = digest.digest()
        out[i] = int.from_bytes(prev, "little", signed=True)
    return out


@numba.njit(cache=True, inline="always")
def _mix(x):
    """splitmix64's finalizer: a 64-bit bijection that spreads every input bit over the output."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@numba.njit(cache=True)
def chain_ids(ids: np.ndarray) -> np.ndarray:
    """Chained hashes of blocks each named alone (`ids`, int64): the i-th names ids[0..i], so equal ids at other
    positions, or after other blocks, never match."""
    out = np.empty(len(ids), np.int64)
    h = _SEED_ID
    for i in range(len(ids)):
        h = _mix(h * np.uint64(0x9E3779B97F4A7C15) + np.uint64(ids[i]))
        out[i] = np.int64(h)
    return out


@numba.njit(cache=True)
def _split(hashes: np.ndarray, factor: int, count: int) -> np.ndarray:
    out = np.empty(count, np.int64)
    for b in range(count):
        out[b] = np.int64(_mix(np.uint64(hashes[b // factor]) * np.uint64(0xD6E8FEB86659FD93)
                               + np.uint64(b % factor + 1)))
    return out


def resample(hashes: np.ndarray, hash_block_size: int, block_size: int, tokens: int) -> np.ndarray:
    """The simulated blocks' names among the first `tokens` tokens, from the chained hashes of blocks of
    `hash_block_size` tokens (the last may be a partial block's), as far as they go.

    A larger simulated block is named by its last hashed sub-block (a chained hash names its whole prefix; vLLM's
    `resolve_block_hashes` does the same). A smaller one is named by the hashed block holding it and its place
    there: two simulated blocks match when their hashed blocks do, so where a trace's blocks are coarser than the
    simulated ones, hits are counted at the trace's granularity (a shared prefix ending inside a hashed block
    counts up to that block's start)."""
    full = tokens // block_size
    if block_size % hash_block_size == 0:
        factor = block_size // hash_block_size
        return hashes[factor - 1::factor][:full]
    factor = hash_block_size // block_size
    return _split(hashes, factor, min(full, len(hashes) * factor))


def check_block_sizes(block_size: int, hash_block_size: int) -> None:
    if hash_block_size < 1 or (block_size % hash_block_size and hash_block_size % block_size):
        raise ValueError(f"the block size {block_size} and --hash-block-size {hash_block_size} must divide one another "
                         "(a simulated block is named by the hashed blocks it spans, or by the one it lies in)")
