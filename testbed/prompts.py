"""Seeded token-id prompts drawn from a model's vocabulary, the same in every process that draws them."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path


def token_draws(model: str, seed: int) -> Callable[[int], list[int]]:
    """`draw(n)`: the next n token ids of one seeded stream over the model's vocabulary (ids 5 and up:
    never a special token)."""
    rng = random.Random(seed)
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    return lambda n: [rng.randrange(5, vocab) for _ in range(n)]


def token_prompts(model: str, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, drawn in order from one stream."""
    draw = token_draws(model, seed)
    return [draw(n) for n in lengths]
