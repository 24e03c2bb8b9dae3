"""What one prefill holds in its prefix cache, keyed by the proxy's own chained hash over token ids.

vLLM's block hashes depend on its hash function and seed, which the proxy neither knows nor needs: each vLLM
hash (its "name", with the medium it lives on) is mapped to the proxy's key of the same block, so removals and
parents resolve. The index keeps what it can still use after a hiccup:
- a block whose parent it has not seen (stored before the proxy listened, or announced while a gap lasted) is
  kept aside as an orphan and indexed the moment its parent is (vLLM's full reports announce a hit prefix from
  its first block; a replay brings the rest);
- past `max_blocks` it forgets the least recently announced block that no indexed block descends from, so a
  bound never cuts a live chain at its root.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deploy.services.kv_events import BlockRemoved, BlockStored, Hash

    Name = tuple[str | None, Hash]
    """A block as vLLM names it: (medium, vLLM's block hash)."""

ROOT = b""
"""The proxy's key of the empty prefix, parent of every first block."""
OWN_CACHE_MEDIA = (None, "GPU")
"""The media of an instance's own KV cache in vLLM's events ("GPU" on every device, CPU included). Blocks on other
media (an offload tier, a pool that every prefill reads, as the pool connector's events report) do not make one
instance the place to send a prompt, so they are not indexed."""


def block_key(parent: bytes, tokens) -> bytes:
    """The proxy's key of a block: its parent's key chained with its token ids."""
    return _chain(parent, array("q", tokens).tobytes())


def _chain(parent: bytes, raw: bytes) -> bytes:
    """block_key over the block's token ids as 8-byte integers."""
    return hashlib.blake2b(parent + raw, digest_size=16).digest()


def iter_keys(tokens: list[int], block_size: int) -> Iterator[bytes]:
    """The keys of a prompt's full blocks, first to last, computed as they are asked for."""
    parent = ROOT
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start:start + block_size])
        yield parent


class Prompt:
    """A prompt as the router matches it: its length, and the keys of its full blocks at a block size, computed as
    they are asked for (matching stops at the first block no instance holds). deploy/simulation/routes.py gives the
    router prompts whose keys it already knows."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def keys(self, block_size: int) -> Iterator[bytes]:
        return iter_keys(self.tokens, block_size)


def _drop_one(counts: dict, key) -> bool:
    """One fewer `key` in `counts`; True when none is left (the key then gone)."""
    count = counts[key] - 1
    if count > 0:
        counts[key] = count
        return False
    del counts[key]
    return True


class Holders:
    """Which instances hold each key, shared by the indexes of one router: matching a prompt looks each of its blocks
    up once for all instances, not once per instance."""

    def __init__(self):
        self.by_key: dict[bytes, int] = {}
        """A key -> the bits of the indexes that hold it (an index's `bit`)."""
        self._slots = 0

    def slot(self) -> int:
        """A bit for a new index."""
        bit = 1 << self._slots
        self._slots += 1
        return bit

    def runs(self, keys: Iterable[bytes], bits: int) -> dict[int, int]:
        """How many of a prompt's first blocks (their keys, in order) each index of `bits` holds, by its bit (those
        holding none left out); `keys` is read up to the first block none of them holds."""
        by_key, runs, n = self.by_key, {}, 0
        for key in keys:
            held = by_key.get(key, 0) & bits
            if held != bits:
                if n:
                    _count(runs, bits & ~held, n)
                bits = held
                if not bits:
                    return runs
            n += 1
        if n:
            _count(runs, bits, n)
        return runs


def _count(runs: dict[int, int], bits: int, n: int) -> None:
    """runs[bit] = n for each bit set in `bits`."""
    while bits:
        low = bits & -bits
        runs[low] = n
        bits ^= low


@dataclass(frozen=True)
class _Orphan:
    parent: Name
    raw: bytes | None
    """Its token ids as 8-byte integers (None: its key is `key`, the caller's)."""
    key: object = None


class PrefixIndex:
    """The full blocks one instance holds; at most `max_blocks` indexed and as many orphans waiting for a parent.
    Its keys are also marked with its bit in `holders` (the router's, shared by its instances; by default its own)."""

    def __init__(self, max_blocks: int, holders: Holders | None = None, block_size: int | None = None):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self.holders = Holders() if holders is None else holders
        self.bit = self.holders.slot()
        self.fixed_block_size = block_size
        """The instance's block size when the proxy was told it: never learned, so no event can change it."""
        self.block_size: int | None = block_size
        self._entries: dict[Name, tuple[bytes, Name | None]] = {}
        """A name -> (its key, its parent's name; None: a first block)."""
        self._twins: dict[bytes, int] = {}
        """A key -> how many indexed names have it besides the first (a key held at all is marked in `holders`)."""
        self._children: dict[Name, int] = {}
        """A name -> indexed blocks whose parent it is (indexed itself or not)."""
        self._leaves: collections.OrderedDict[Name, None] = collections.OrderedDict()
        """Indexed blocks with no indexed child, least recently announced first: what goes when room is needed.
        A block whose last child goes becomes the least recent leaf (its subtree's newest block just went)."""
        self._firsts = 0
        """Indexed first blocks: with none, the instance holds no prompt's first block."""
        self._orphans: collections.OrderedDict[Name, _Orphan] = collections.OrderedDict()  # oldest first
        self._waiting: dict[Name, set[Name]] = {}
        """A name not indexed yet -> its orphans."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def orphans(self) -> int:
        return len(self._orphans)

    @property
    def holds_a_first_block(self) -> bool:
        return self._firsts > 0

    def clear(self) -> None:
        for key in {key for key, _ in self._entries.values()}:
            self._unmark(key)
        for table in (self._entries, self._twins, self._children, self._leaves, self._orphans, self._waiting):
            table.clear()
        self._firsts = 0
        self.block_size = self.fixed_block_size

    def holds(self, key: bytes) -> bool:
        return bool(self.holders.by_key.get(key, 0) & self.bit)

    def keys_of(self, names: Sequence[Name], start: int = 0) -> list[bytes]:
        """The keys this index gave the blocks vLLM names `names[start:]`, up to the first it did not index."""
        entries, keys = self._entries, []
        for name in names[start:]:
            entry = entries.get(name)
            if entry is None:
                break
            keys.append(entry[0])
        return keys

    def matched_blocks(self, keys: Iterable[bytes]) -> int:
        """How many of a prompt's first blocks (their keys, in order) this instance holds."""
        by_key, bit, n = self.holders.by_key, self.bit, 0
        for key in keys:
            if not by_key.get(key, 0) & bit:
                break
            n += 1
        return n

    def store(self, event: BlockStored) -> str | None:
        """Index the event's blocks (or keep them as orphans); returns why they were skipped, if they were."""
        if event.lora_name is not None or event.lora_id is not None or event.group_idx not in (None, 0) \
                or any(k is not None for k in event.extra_keys or ()):
            return "unindexable"  # LoRA, salts, multimodal or a second KV group: token ids alone do not name it
        if event.medium not in OWN_CACHE_MEDIA:
            return "medium"
        if self.block_size not in (None, event.block_size):
            return "block_size"
        self.block_size = size = event.block_size
        medium, entries = event.medium, self._entries
        raw = array("q", event.token_ids).tobytes()
        width = 8 * size
        parent: Name | None = None if event.parent_block_hash is None else (medium, event.parent_block_hash)
        for i, vllm_hash in enumerate(event.block_hashes):
            name = (medium, vllm_hash)
            chunk = raw[i * width:(i + 1) * width]
            if parent is None:
                self._index(name, None, _chain(ROOT, chunk))
            else:
                entry = entries.get(parent)
                if entry is not None:
                    self._index(name, parent, _chain(entry[0], chunk))
                else:
                    self._orphan(name, _Orphan(parent, chunk))
            parent = name
        self._trim()
        return None

    def store_keyed(self, block_hashes: Sequence[Hash], parent_block_hash: Hash | None, keys: Sequence,
                    block_size: int, medium: str = "GPU") -> None:
        """Index blocks of the instance's own cache as `store` does, their keys given instead of computed from token
        ids: any hashable that names a block's whole prefix, the same on every instance (the simulator's chained
        block hashes, deploy/simulation/routes.py, whose blocks carry no tokens). An index is fed one kind of key."""
        self.block_size = block_size
        entries = self._entries
        parent: Name | None = None if parent_block_hash is None else (medium, parent_block_hash)
        for vllm_hash, key in zip(block_hashes, keys):
            name = (medium, vllm_hash)
            if parent is None:
                self._index(name, None, key)
            elif parent in entries:
                self._index(name, parent, key)
            else:
                self._orphan(name, _Orphan(parent, None, key))
            parent = name
        self._trim()

    def remove(self, event: BlockRemoved) -> None:
        for vllm_hash in event.block_hashes:
            name = (event.medium, vllm_hash)
            self._forget(name)
            if self._orphans:
                self._drop_orphan(name)

    # -- indexed blocks --------------------------------------------------------------------------------
    def _index(self, name: Name, parent: Name | None, key: bytes) -> None:
        """Index `name` as the newest block, then every orphan that waited for it."""
        entries, children, leaves = self._entries, self._children, self._leaves
        by_key, bit = self.holders.by_key, self.bit
        pending = [(name, parent, key)]
        while pending:
            name, parent, key = pending.pop()
            entry = key, parent
            old = entries.get(name)
            if old == entry:  # announced again (a full report): now the newest
                if name in leaves:
                    leaves.move_to_end(name)
                continue
            if old is not None:
                self._forget(name)
            entries[name] = entry
            holders = by_key.get(key, 0)
            if holders & bit:
                self._twins[key] = self._twins.get(key, 0) + 1
            else:
                by_key[key] = holders | bit
            if not children.get(name):
                leaves[name] = None
            if parent is None:
                self._firsts += 1
            else:
                children[parent] = children.get(parent, 0) + 1
                leaves.pop(parent, None)
            if self._orphans:
                self._drop_orphan(name)
            if self._waiting:
                for child in self._waiting.pop(name, ()):
                    orphan = self._orphans.pop(child)
                    pending.append((child, name, orphan.key if orphan.raw is None else _chain(key, orphan.raw)))

    def _forget(self, name: Name) -> None:
        """Drop `name` from the index (its children keep their entries: vLLM may still hold them, and they match
        again once it is announced anew)."""
        entry = self._entries.pop(name, None)
        if entry is None:
            return
        key, parent = entry
        self._leaves.pop(name, None)
        if key in self._twins:
            _drop_one(self._twins, key)
        else:
            self._unmark(key)
        if parent is None:
            self._firsts -= 1
            return
        if _drop_one(self._children, parent) and parent in self._entries:
            self._leaves[parent] = None
            self._leaves.move_to_end(parent, last=False)

    def _unmark(self, key: bytes) -> None:
        by_key = self.holders.by_key
        rest = by_key[key] & ~self.bit
        if rest:
            by_key[key] = rest
        else:
            del by_key[key]

    def _trim(self) -> None:
        """Forget the least recent leaves until the index fits (with none, only a parent chain that loops, which
        a hostile publisher alone sends: then any block)."""
        while len(self._entries) > self.max_blocks:
            self._forget(next(iter(self._leaves or self._entries)))
        while len(self._orphans) > self.max_blocks:
            self._drop_orphan(next(iter(self._orphans)))

    # -- orphans ---------------------------------------------------------------------------------------
    def _orphan(self, name: Name, orphan: _Orphan) -> None:
        self._forget(name)  # re-announced under a parent the index has lost
        self._drop_orphan(name)
        self._orphans[name] = orphan
        self._waiting.setdefault(orphan.parent, set()).add(name)

    def _drop_orphan(self, name: Name) -> None:
        orphan = self._orphans.pop(name, None)
        if orphan is None:
            return
        siblings = self._waiting.get(orphan.parent)
        if siblings is not None:
            siblings.discard(name)
            if not siblings:
                del self._waiting[orphan.parent]
