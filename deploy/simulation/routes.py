"""Which prefill a request goes to: `kvpp proxy`'s own choice, driven by the simulated engines.

Round-robin is the proxy's `Rotation`; the cache-aware policy is its `PrefixRouter`, whose per-prefill
`PrefixIndex` is fed the simulated engines' KV cache events (the blocks each step stores, the blocks evicted) as
they happen, and whose load is the prompt tokens of the prefill legs in flight, counted as the proxy counts them.
The simulated blocks carry hashes, not tokens, so the indexes are given their keys (`PrefixIndex.store_keyed`):
a block's chained hash, which names its whole prefix as the proxy's keys over token ids do, so two blocks get the
same key exactly when they are the same block, which is all the router's choice depends on; a prompt's keys are
its blocks' hashes.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from prometheus_client import CollectorRegistry

from deploy.services.kv_events import BlockRemoved
from deploy.services.prefix_index import Prompt
from deploy.services.proxy import Rotation
from deploy.services.routing import PrefixRouter, PrefixRouting

POLICIES = ("round-robin", "cache-aware")
MEDIUM = "GPU"
"""What vLLM names an instance's own cache in its events."""


def url(engine: int) -> str:
    return f"http://prefill-{engine}"


class _SimPrompt(Prompt):
    """A simulated prompt: its length and its blocks' hashes, which are its router keys."""

    def __init__(self, length: int, hashes: np.ndarray, block_size: int):
        self.length, self.hashes, self.block_size = length, hashes, block_size

    def __len__(self) -> int:
        return self.length

    def keys(self, block_size: int) -> Iterator[int]:
        if block_size != self.block_size:
            raise ValueError(f"an index of {block_size}-token blocks in a simulation of {self.block_size}")
        return iter(self.hashes[:self.length // block_size].tolist())


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

    def choose(self, prompt: int, hashes: np.ndarray) -> tuple[int, int]:
        leg = self.router.choose(self.rotation.order(), _SimPrompt(prompt, hashes, self.block_size), prompt)[0]
        return self._index[leg.backend.url], leg.tokens

    def stored(self, engine: int, hashes: np.ndarray, parent: int | None) -> None:
        block_hashes = hashes.tolist()
        self._indexes[engine].store_keyed(block_hashes, parent, block_hashes, self.block_size, MEDIUM)

    def removed(self, engine: int, block_hashes: list[int]) -> None:
        self._indexes[engine].remove(BlockRemoved(block_hashes=block_hashes, medium=MEDIUM))


def policy(name: str, engines: int, block_size: int) -> RoundRobin:
    if name == "round-robin":
        return RoundRobin(engines)
    if name == "cache-aware":
        return CacheAware(engines, block_size)
    raise ValueError(f"unknown policy {name!r}; use {' or '.join(POLICIES)}")
