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
`nominal_turn_s`; the simulator reads ahead of that.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from deploy.simulation.trace import TraceLine


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


def lines(work: Workload, hash_block_size: int) -> Iterator[TraceLine]:
    """The workload's requests as trace lines, hashed at `hash_block_size` tokens."""
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
        full = p // hb
        first = ti == 0
        yield TraceLine(prompt_hashes=ids[:full].tolist(), prompt_len=p, output_len=a,
                        output_hashes=ids[full:].tolist(), conversation=ci,
                        arrival_s=float(starts[ci]) if first else None,
                        think_s=None if first else float(think[ci, ti]))
