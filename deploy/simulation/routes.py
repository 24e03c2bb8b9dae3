"""Which prefill a request goes to: `kvpp proxy`'s own choice, driven by the simulated engines.

Round-robin is the proxy's `Rotation`; the cache-aware policy is its `PrefixRouter`, whose per-prefill
`PrefixIndex` is fed the simulated engines' KV cache events (`BlockStored`, `BlockRemoved`, vLLM's wire structs)
as they happen, and whose load is the prompt tokens of the prefill legs in flight, counted as the proxy counts
them. The simulated blocks carry hashes, not text, so each block reaches the router as `block_size` stand-in
token ids (its hash, then zeros): two blocks get the same router key exactly when they are the same block, which
is all the router's choice depends on. A prompt's keys are those its blocks got in the indexes, remembered while
some engine caches the block (so each block's key is one lookup, not one per index); past the first block no index
holds, no instance can match, so the router is given a key none holds there and no further. The remembered keys are
all an index can hold unless an index kept a block aside as an orphan (its bound, `max_index_blocks`, below an
engine's blocks, forgot the block's parent): it may index that block later, unseen, so from then on the indexes are
asked for the keys past those remembered.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import numpy as np
from prometheus_client import CollectorRegistry

from deploy.services.kv_events import BlockRemoved, BlockStored
from deploy.services.prefix_index import Prompt
from deploy.services.proxy import Rotation
from deploy.services.routing import PrefixRouter, PrefixRouting

POLICIES = ("round-robin", "cache-aware")
MEDIUM = "GPU"
"""What vLLM names an instance's own cache in its events."""
UNHELD = b""
"""A key no index holds (their keys are 16-byte digests)."""


def url(engine: int) -> str:
    return f"http://prefill-{engine}"


class _SimPrompt(Prompt):
    """A simulated prompt: its length and its blocks' hashes; its router keys come from the indexes."""

    def __init__(self, length: int, hashes: np.ndarray, policy: CacheAware):
        self.length, self.hashes, self.policy = length, hashes, policy

    def __len__(self) -> int:
        return self.length

    def keys(self, block_size: int) -> Iterator[bytes]:
        if block_size != self.policy.block_size:
            raise ValueError(f"an index of {block_size}-token blocks in a simulation of {self.policy.block_size}")
        return iter(self.policy.keys(self.hashes[:self.length // block_size]))


class RoundRobin:
    """The proxy's rotation: each request to the next prefill in turn."""

    name = "round-robin"

    def __init__(self, engines: int):
        self.rotation = Rotation("prefill", [url(i) for i in range(engines)])
        self._index = {b.url: i for i, b in enumerate(self.rotation.backends)}
        self.backends = self.rotation.backends

    def choose(self, prompt: int, hashes: np.ndarray) -> tuple[int, int]:
        """(engine, the leg's tokens for the proxy's load count)."""
        return self._index[self.rotation.order()[0].url], 0

    def stored(self, engine: int, hashes: np.ndarray, parent: int | None) -> None:
        pass

    def removed(self, engine: int, block_hashes: list[int]) -> None:
        pass


class CacheAware(RoundRobin):
    """The proxy's cache-aware choice (`kvpp proxy --kv-events`), its indexes fed by the simulated engines."""

    name = "cache-aware"

    def __init__(self, engines: int, block_size: int):
        super().__init__(engines)
        self.block_size = block_size
        self.router = PrefixRouter(self.backends, PrefixRouting(tuple(f"sim://{i}" for i in range(engines))),
                                   CollectorRegistry())
        self._indexes = [self.router.streams[b.url].index for b in self.backends]
        self._keys: dict[int, bytes] = {}
        """A block's hash -> the key an index gave it when it was stored, while some engine caches it."""
        self._copies: dict[int, int] = {}
        """A block's hash -> the engines' cached blocks that have it."""
        self._orphans = False
        """Whether an index ever kept an orphan (then it may hold keys not remembered)."""

    def choose(self, prompt: int, hashes: np.ndarray) -> tuple[int, int]:
        leg = self.router.choose(self.rotation.order(), _SimPrompt(prompt, hashes, self), prompt)[0]
        return self._index[leg.backend.url], leg.tokens

    def keys(self, hashes: np.ndarray) -> list[bytes]:
        """The router keys of a chain of blocks, first to last, as the indexes gave them, up to the first block no
        index holds, which gets UNHELD. The indexes give a block the same key (its chain's), so the keys remembered
        and (after an orphan) one pass over the indexes for the rest extend the chain as far as the longest run any
        of them holds."""
        keys = list(map(self._keys.get, hashes.tolist()))
        if None not in keys:
            return keys
        del keys[keys.index(None):]
        if not self._orphans:
            return keys + [UNHELD]
        names = [(MEDIUM, h) for h in hashes[len(keys):].tolist()]
        rest: list[bytes] = []
        for index in self._indexes:
            rest += index.keys_of(names, len(rest))
            if len(rest) == len(names):
                return keys + rest
        return keys + rest + [UNHELD]

    def stored(self, engine: int, hashes: np.ndarray, parent: int | None) -> None:
        tokens = np.zeros(len(hashes) * self.block_size, np.int64)
        tokens[::self.block_size] = hashes
        block_hashes = hashes.tolist()
        index = self._indexes[engine]
        index.store(BlockStored(block_hashes=block_hashes, parent_block_hash=parent,
                                token_ids=array("q", tokens.tobytes()), block_size=self.block_size, medium=MEDIUM))
        copies, known = self._copies, self._keys
        for h in block_hashes:
            copies[h] = copies.get(h, 0) + 1
        known.update(zip(block_hashes, index.keys_of([(MEDIUM, h) for h in block_hashes])))
        self._orphans = self._orphans or index.orphans > 0

    def removed(self, engine: int, block_hashes: list[int]) -> None:
        self._indexes[engine].remove(BlockRemoved(block_hashes=block_hashes, medium=MEDIUM))
        copies = self._copies
        for h in block_hashes:
            left = copies[h] - 1
            if left:
                copies[h] = left
            else:
                del copies[h]
                self._keys.pop(h, None)


def policy(name: str, engines: int, block_size: int) -> RoundRobin:
    if name == "round-robin":
        return RoundRobin(engines)
    if name == "cache-aware":
        return CacheAware(engines, block_size)
    raise ValueError(f"unknown policy {name!r}; use {' or '.join(POLICIES)}")
