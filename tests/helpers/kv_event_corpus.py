"""Random and adversarial KV event batches in vLLM's wire format, well-formed and not: what a buggy or hostile
publisher can send the proxy. Hypothesis draws a `Corpus` (a seed, edge values, garbage, nested values and a mix);
the corpus then expands into as many messages as asked, cheaply, so that one example carries many batches.

Well-formed stored events use the engine's one block size (BS) over a small pool of hashes and token ids, so that
chains, re-announcements, loops, removals of parents and duplicate hashes are frequent. The rest is odd on purpose:
token ids and hashes at and past the edges of what the index holds, block sizes and lengths that do not add up, wrong
types, unknown tags, nesting past the decoder's depth, bytes that are no msgpack, and (in whole messages) frames that
are not (topic, seq, payload) and sequence numbers that jump, repeat and go back."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
from hypothesis import strategies as st

BS = 4
HASHES = [b"h%d" % i for i in range(24)] + list(range(16)) + [2 ** 64 - 1]
EDGE_INTS = [2 ** 63, 2 ** 63 - 1, 2 ** 64 - 1, -1, -(2 ** 63), 0]
SEQ_BYTES = 8

encode = msgspec.msgpack.Encoder().encode

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats() | st.text(max_size=6)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12)
"""Any value msgpack carries (what extra_keys, being Any, decode to)."""


@dataclass(frozen=True)
class Corpus:
    seed: int
    ints: tuple[int, ...]
    """Edge integers, used as token ids, hashes, block sizes and sequence numbers."""
    garbage: tuple[bytes, ...]
    """Byte strings used as whole payloads, hashes and frames."""
    nested: tuple[object, ...]
    """msgpack values put where vLLM puts lists (extra_keys, events, hashes)."""
    odd: float
    """The share of odd events, payloads and frames."""

    def events(self, rng: random.Random) -> object:
        """The `events` slot of one batch: mostly a list of events, good and odd; sometimes not a list at all, or
        bytes that are not msgpack (as msgspec.Raw, which any encoder, vLLM's included, embeds as is)."""
        if rng.random() < self.odd / 8:
            return rng.choice([msgspec.Raw(rng.choice(self.garbage or (b"\xc1",))), rng.choice(self.nested or (1,)),
                               msgspec.Raw(b"\x91" * 40_000 + b"\xc0"), {"type": "BlockStored"}, "events"])
        return [self._odd_event(rng) if rng.random() < self.odd else self._event(rng)
                for _ in range(rng.randint(0, 6))]

    def event_lists(self, n: int) -> Iterator[object]:
        """The `events` slots of `n` batches, for a publisher that numbers and frames them itself (vLLM's)."""
        rng = random.Random(self.seed)
        for _ in range(n):
            yield self.events(rng)

    def messages(self, n: int) -> Iterator[list[bytes]]:
        """`n` messages (topic, seq, payload) as vLLM's PUB sends them, sequence numbers mostly consecutive, and
        odd frames among them."""
        rng = random.Random(self.seed)
        seq = rng.choice([0, 0, 1000, 2 ** 40])
        for _ in range(n):
            roll = rng.random()
            if roll < self.odd / 10:
                yield self._odd_frames(rng, seq)
                continue
            if roll < self.odd / 5:
                seq = max(0, seq + rng.choice([-seq, -1, 0, 2, 7, 1000]))  # a restart, a repeat, a gap
            yield [b"", seq.to_bytes(SEQ_BYTES, "big"), self._payload(rng)]
            seq += 1

    def _payload(self, rng: random.Random) -> bytes:
        if rng.random() < self.odd / 10:
            good = encode([1.0, [self._event(rng)]])
            return rng.choice([rng.choice(self.garbage or (b"",)), good[:rng.randrange(len(good))],
                               _flipped(rng, good), encode(rng.choice(self.nested or ({},))),
                               encode({"ts": 1.0, "events": []})])
        return encode([rng.random() * 1e9, self.events(rng), rng.choice([None, None, 0, -1])])

    def _hash(self, rng: random.Random):
        return rng.choice(HASHES)

    def _event(self, rng: random.Random) -> dict:
        kind = rng.random()
        if kind < 0.6:
            n = rng.randint(1, 4)
            event = {"type": "BlockStored", "block_hashes": [self._hash(rng) for _ in range(n)],
                     "parent_block_hash": None if rng.random() < 0.3 else self._hash(rng),
                     "token_ids": [rng.randrange(8) for _ in range(n * BS)], "block_size": BS, "lora_id": None,
                     "medium": rng.choice(["GPU", "GPU", None, "CPU"]), "lora_name": None}
            if rng.random() < 0.1:
                event["extra_keys"] = [rng.choice([None, ("salt",)]) for _ in range(n)]
            if rng.random() < 0.05:
                event["group_idx"] = rng.choice([0, 1])
            return event
        if kind < 0.97:
            return {"type": "BlockRemoved", "block_hashes": [self._hash(rng) for _ in range(rng.randint(0, 3))],
                    "medium": rng.choice(["GPU", None, "CPU"])}
        return {"type": "AllBlocksCleared"}

    def _odd_event(self, rng: random.Random) -> object:
        event = self._event(rng)
        if event["type"] != "BlockStored":
            event["block_hashes"] = [self._odd_value(rng)] if "block_hashes" in event else None
            return event
        edit = rng.randrange(12)
        if edit == 0:
            event["token_ids"][rng.randrange(len(event["token_ids"]))] = self._odd_int(rng)
        elif edit == 1:
            event["block_hashes"][0] = self._odd_value(rng)
        elif edit == 2:
            event["parent_block_hash"] = self._odd_value(rng)
        elif edit == 3:
            event["block_size"] = rng.choice([0, -BS, BS + 1, 2 ** 20, self._odd_int(rng)])
        elif edit == 4:
            event["token_ids"] = event["token_ids"][:rng.randrange(len(event["token_ids"]))]
        elif edit == 5:
            event["block_hashes"], event["token_ids"] = [], []
        elif edit == 6:
            event["extra_keys"] = rng.choice(self.nested or ([],))
        elif edit == 7:
            event["block_hashes"] = [event["block_hashes"][0]] * len(event["block_hashes"])  # the same block twice
            event["parent_block_hash"] = event["block_hashes"][0]  # its own parent
        elif edit == 8:
            event["type"] = rng.choice(["Nonsense", "", "BlockStored\x00"])
        elif edit == 9:
            del event[rng.choice(["block_hashes", "token_ids", "block_size"])]
        elif edit == 10:  # well formed, at another engine's block size
            event["block_size"] = 2 * BS
            event["token_ids"] = [rng.randrange(8) for _ in range(len(event["block_hashes"]) * 2 * BS)]
        else:
            event["medium"] = self._odd_value(rng)
        return event

    def _odd_int(self, rng: random.Random) -> int:
        return rng.choice(EDGE_INTS + list(self.ints))

    def _odd_value(self, rng: random.Random) -> object:
        return rng.choice([self._odd_int(rng), rng.choice(self.garbage or (b"",)) * rng.randint(1, 20),
                           rng.choice(self.nested or (None,)), 1.5, "h1", [b"h1"]])

    def _odd_frames(self, rng: random.Random, seq: int) -> list[bytes]:
        payload = encode([1.0, [self._event(rng)]])
        negative = (-seq - 1).to_bytes(SEQ_BYTES, "big", signed=True)
        return rng.choice([[payload], [b"", payload], [b"", seq.to_bytes(SEQ_BYTES, "big"), payload, b""],
                           [b"", b"\x00\x01", payload], [b"", negative, payload],
                           [b"", rng.choice(self.garbage or (b"",)), payload]])


def _flipped(rng: random.Random, data: bytes) -> bytes:
    i = rng.randrange(len(data))
    return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]


corpora = st.builds(Corpus, seed=st.integers(0, 2 ** 32 - 1),
                    ints=st.lists(st.integers(-(2 ** 63), 2 ** 64 - 1), max_size=6).map(tuple),
                    garbage=st.lists(st.binary(max_size=24), max_size=4).map(tuple),
                    nested=st.lists(msgpack_values, max_size=3).map(tuple),
                    odd=st.sampled_from([0.0, 0.05, 0.3, 1.0]))
"""Corpora for Hypothesis: from all-good (odd 0) to all-odd (1)."""
