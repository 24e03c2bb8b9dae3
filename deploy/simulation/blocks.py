"""Block identity: the chained hashes of a sequence's full blocks, as the simulator keys its prefix caches.

vLLM chains sha256 over (parent hash, the block's token ids, extra keys); the simulator needs only the same
equalities, so it chains a 64-bit BLAKE2b over the parent's hash and the block's token ids (two blocks are the same
block exactly when they and all blocks before them hold the same tokens). Traces that must not carry text give
the hashes themselves, at a block size that divides the simulated one (`coarsen`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import numpy as np

SEED = b"kvpp-simulation"


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


def coarsen(hashes: np.ndarray, factor: int) -> np.ndarray:
    """Hashes of blocks `factor` times larger: a chained hash names its whole prefix, so a larger block is named by
    the hash of its last sub-block (vLLM's `resolve_block_hashes` does the same)."""
    if factor == 1:
        return hashes
    return hashes[factor - 1::factor]
