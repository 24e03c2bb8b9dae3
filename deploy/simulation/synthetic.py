"""A synthetic trace: multi-turn agent conversations.

Conversations start at `rate` per second (a Poisson process; 0: all at once). Each opens with one of
`system_prompts` shared system prompts of `system_tokens` and a first user message of `first_tokens`; every later
turn sends the whole history back (the previous prompt and its answer) plus `growth_tokens` new ones, `think_s`
(exponentially distributed, that mean) after the previous answer. Answers are `output_tokens` long. With
`variation` v > 0, each first message, growth and answer length is drawn uniformly from (1 - v, 1 + v) times its
mean.

The trace carries block hashes, not tokens: a block of a system prompt is named by the prompt and its position,
every other block by its conversation and its position (a turn's prompt extends the previous turn's prompt and
answer, so their blocks are the same blocks). Lines come in the order their requests would be sent if a turn took
`nominal_turn_s`; the simulator reads ahead of that. `public_lines` writes the same requests in the public trace
formats, open loop at those nominal times.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np

from deploy.simulation.formats import AZURE
from deploy.simulation.trace import TraceLine

AZURE_EPOCH = datetime(2023, 11, 16)
"""Where the Azure-style timestamps of a written trace start (any wall-clock day: the reader subtracts the first)."""


@dataclass(frozen=True)
class Workload:
    conversations: int = 1000
    turns: int = 10
    rate: float = 10.0
    system_prompts: int = 8
    system_tokens: int = 2048
    first_tokens: int = 512
    growth_tokens: int = 256
    output_tokens: int = 256
    think_s: float = 5.0
    variation: float = 0.0
    seed: int = 0
    nominal_turn_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_prompts", "first_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"synthetic workload: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("system_tokens", "growth_tokens", "rate", "think_s", "nominal_turn_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"synthetic workload: {name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.variation < 1:
            raise ValueError(f"synthetic workload: variation must be in [0, 1), got {self.variation}")

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    def max_tokens(self) -> int:
        """The longest prompt plus answer the workload can send."""
        v = 1 + self.variation
        return int(self.system_tokens + v * (self.first_tokens + (self.turns - 1) * self.growth_tokens
                                             + self.turns * self.output_tokens)) + 1


def _requests(work: Workload, hash_block_size: int) -> Iterator[tuple[int, int, int, int, np.ndarray, float, float]]:
    """Each request, in the order of its nominal time: (conversation, turn, prompt and answer tokens, the ids of the
    full blocks of prompt and answer at `hash_block_size`, its nominal time, its think time)."""
    rng = np.random.default_rng(work.seed)
    c, t = work.conversations, work.turns
    starts = np.zeros(c)
    if work.rate > 0:
        starts = np.cumsum(rng.exponential(1 / work.rate, c))
        starts -= starts[0]
    system = rng.integers(0, work.system_prompts, c)
    v = work.variation

    def lengths(mean: int, shape) -> np.ndarray:
        if v == 0 or mean == 0:
            return np.full(shape, mean, np.int64)
        return np.maximum(1, np.rint(mean * rng.uniform(1 - v, 1 + v, shape))).astype(np.int64)

    user = lengths(work.growth_tokens, (c, t))
    user[:, 0] = lengths(work.first_tokens, c)
    answer = lengths(work.output_tokens, (c, t))
    think = rng.exponential(work.think_s, (c, t)) if work.think_s > 0 else np.zeros((c, t))
    # prompt of turn i: system + every earlier user message and answer + this turn's user message
    prompt = work.system_tokens + np.cumsum(user, axis=1) + np.concatenate(
        [np.zeros((c, 1), np.int64), np.cumsum(answer, axis=1)[:, :-1]], axis=1)
    hb = hash_block_size
    sys_blocks = work.system_tokens // hb
    per_conv = int((prompt[:, -1] + answer[:, -1]).max()) // hb + 1
    conv_base = 1 + work.system_prompts * (sys_blocks + 1)
    nominal = starts[:, None] + np.arange(t)[None, :] * (work.nominal_turn_s + work.think_s)
    order = np.argsort(nominal, axis=None, kind="stable")
    for flat in order:
        ci, ti = divmod(int(flat), t)
        p, a = int(prompt[ci, ti]), int(answer[ci, ti])
        ids = np.arange((p + a) // hb, dtype=np.int64)
        shared = ids < sys_blocks
        ids = np.where(shared, 1 + int(system[ci]) * (sys_blocks + 1) + ids, conv_base + ci * per_conv + ids)
        yield ci, ti, p, a, ids, float(nominal[ci, ti]), float(think[ci, ti])


def lines(work: Workload, hash_block_size: int) -> Iterator[TraceLine]:
    """The workload's requests as trace lines of this project's format, hashed at `hash_block_size` tokens: closed
    loop (a later turn `think_s` after the previous answer), answers' blocks included."""
    for ci, ti, p, a, ids, nominal, think in _requests(work, hash_block_size):
        full = p // hash_block_size
        first = ti == 0
        yield TraceLine(prompt_hashes=ids[:full].tolist(), prompt_len=p, output_len=a,
                        output_hashes=ids[full:].tolist(), conversation=ci,
                        arrival_s=nominal if first else None, think_s=None if first else think)


def public_lines(work: Workload, fmt: str, hash_block_size: int | None) -> Iterator[dict | list]:
    """The workload in a public trace format (deploy/simulation/formats.py), open loop at each request's nominal
    time: a Mooncake or Bailian object (a block id per `hash_block_size` tokens of the prompt, its partial last
    block named by an id of its own, which no other block has), or an Azure CSV row of lengths (a header first)."""
    if fmt == "lengths":
        yield list(AZURE)
    partial = 1 << 62
    for index, (ci, ti, p, a, ids, nominal, _think) in enumerate(_requests(work, hash_block_size or 1)):
        if fmt == "lengths":
            yield [(AZURE_EPOCH + timedelta(seconds=nominal)).isoformat(sep=" ", timespec="microseconds"), p, a]
            continue
        full = p // hash_block_size
        hashes = ids[:full].tolist() + ([partial + index] if p % hash_block_size else [])
        if fmt == "mooncake":
            yield {"timestamp": round(nominal * 1000, 3), "input_length": p, "output_length": a, "hash_ids": hashes}
        elif fmt == "bailian":
            chat = ci * work.turns + ti
            yield {"chat_id": chat, "parent_chat_id": chat - 1 if ti else -1, "timestamp": round(nominal, 6),
                   "input_length": p, "output_length": a, "type": "text", "turn": ti + 1, "hash_ids": hashes}
        else:
            raise ValueError(f"no public trace format {fmt!r}")
