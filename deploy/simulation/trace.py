"""Traces: requests as the simulator runs them, this project's own JSON-lines format, and what the readers of every
format share (deploy/simulation/formats.py reads the public ones and picks the format).

This project's format, one request a line (unknown keys are refused, so a typo is an error, not a silent default):

    {"prompt_token_ids": [...] | "prompt_hashes": [...], "prompt_len": N,
     "output_len": N | "output_token_ids": [...], "output_hashes": [...],
     "arrival_s": T, "conversation": "id", "think_s": S}

- `prompt_token_ids`, or, for a trace that must not carry text, `prompt_hashes` with `prompt_len`: the chained
  hashes of the prompt's full blocks of `--hash-block-size` tokens (each names its whole prefix; integers); it and
  the simulated block size must divide one another.
- `output_len`, or `output_token_ids`. An answer's blocks are cached too, and a conversation's next prompt
  usually contains the answer: give `output_token_ids` (or `output_hashes`, the hashes of the further full blocks
  of prompt and answer) for those hits to count; without them, the answer's blocks match nothing.
- `arrival_s`: when the request arrives (open loop; non-decreasing down the file). Without it, a request with a
  `conversation` arrives `think_s` (default 0) after the previous request of its conversation was answered
  (closed loop; a conversation's first request at `think_s`), and one without a conversation at 0.
"""

from __future__ import annotations

import math
import os
import stat
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import msgspec
import numpy as np

from deploy.simulation.blocks import resample, token_block_hashes

INT64 = 1 << 63
TURNS_REPORTED = 10
"""A trace's turns are counted one by one up to this, the later ones together."""


class TraceLine(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    prompt_token_ids: list[int] | None = None
    prompt_hashes: list[int] | None = None
    prompt_len: int | None = None
    output_len: int | None = None
    output_token_ids: list[int] | None = None
    output_hashes: list[int] | None = None
    arrival_s: float | None = None
    conversation: str | int | None = None
    think_s: float | None = None


@dataclass(slots=True)
class Request:
    """One request as the simulator runs it."""

    index: int
    """Its place (0-based) among the trace's requests."""
    prompt: int
    output: int
    hashes: np.ndarray
    """int64: the hashes of the full blocks of prompt and output at the simulated block size (placeholders where
    the trace gives none: they match nothing)."""
    arrival_s: float | None
    conversation: str | int | None
    think_s: float
    follows: bool = False
    """Open loop, but not before its conversation's previous request was answered (a later turn of a traced
    conversation: its user had the answer first)."""
    kind: str | None = None
    """The trace's type of request (Bailian's `type`), reported with its hits."""
    turn: int | None = None
    """The trace's turn of its conversation, reported with its hits."""


class TraceError(ValueError):
    """A trace line that cannot be simulated; the message names the line, the field and the fix."""


@dataclass
class TraceInfo:
    """What reading a trace learned about it, for the report."""

    format: str
    hash_block_size: int | None
    requests: int = 0
    skipped: Counter = field(default_factory=Counter)
    """Lines not simulated, by why (e.g. a failed request: no output token)."""
    types: Counter = field(default_factory=Counter)
    turns: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    """What the reader of the results must know (e.g. a trace of lengths alone can have no hits)."""

    def reset(self, fmt: str, hash_block_size: int | None, notes: list[str]) -> None:
        """Start again (a trace is read once per simulated configuration)."""
        self.format, self.hash_block_size, self.notes, self.requests = fmt, hash_block_size, notes, 0
        for counts in (self.skipped, self.types, self.turns):
            counts.clear()

    def count(self, request: Request) -> None:
        self.requests += 1
        if request.kind is not None:
            self.types[request.kind] += 1
        if request.turn is not None:
            self.turns[turn_label(request.turn)] += 1

    def to_json(self) -> dict:
        return {"format": self.format, "hash_block_size": self.hash_block_size, "requests": self.requests,
                "skipped": dict(self.skipped), "types": dict(self.types.most_common()),
                "turns": dict(sorted(self.turns.items(), key=lambda kv: int(kv[0].rstrip("+")))),
                "notes": self.notes}


def turn_label(turn: int) -> str:
    return str(turn) if turn < TURNS_REPORTED else f"{TURNS_REPORTED}+"


def placeholders(index: int, first: int, count: int) -> np.ndarray:
    """Hashes no other block has: request `index`'s blocks from `first` on (splitmix64 of a request-unique seed)."""
    x = (np.uint64(index) * np.uint64(0x100000001B3) + np.uint64(0xA5A5_0000_0000_0000)
         + np.arange(first, first + count, dtype=np.uint64))
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (x ^ (x >> np.uint64(31))).view(np.int64)


def hash_array(values: list[int], what: str) -> np.ndarray:
    """Hashes as int64: signed or unsigned 64-bit integers (an unsigned one above 2**63 wraps)."""
    try:
        return np.array(values, np.int64)
    except OverflowError:
        for v in values:
            if not -INT64 <= v < 2 * INT64:
                raise ValueError(f"{what}: {v} is not a 64-bit integer") from None
        return np.array([v - 2 * INT64 if v >= INT64 else v for v in values], np.int64)


def padded(known: np.ndarray, index: int, prompt: int, output: int, block_size: int) -> np.ndarray:
    """The names of a request's full blocks: those `known`, then placeholders for the rest."""
    full = (prompt + output) // block_size
    if len(known) >= full:
        return np.ascontiguousarray(known[:full])
    return np.concatenate([known, placeholders(index, len(known), full - len(known))])


def check_times(arrival: float | None, think: float | None, field_name: str) -> None:
    if arrival is not None and not 0 <= arrival < math.inf:
        raise ValueError(f"{field_name} must be a finite number >= 0, got {arrival}")
    if think is not None and not 0 <= think < math.inf:
        raise ValueError(f"think_s must be a finite number >= 0, got {think}")


def to_request(line: TraceLine, index: int, block_size: int, hash_block_size: int) -> Request:
    """A decoded line of this project's format as a Request; ValueError says what is wrong with it."""
    tokens, hashes = line.prompt_token_ids, line.prompt_hashes
    if (tokens is None) == (hashes is None):
        raise ValueError("give prompt_token_ids or prompt_hashes (with prompt_len), exactly one of them")
    out_tokens = line.output_token_ids
    if out_tokens is not None:
        if line.output_len is not None and line.output_len != len(out_tokens):
            raise ValueError(f"output_len {line.output_len} but {len(out_tokens)} output_token_ids")
        output = len(out_tokens)
    elif line.output_len is not None:
        output = line.output_len
    else:
        raise ValueError("give output_len or output_token_ids")
    if output < 1:
        raise ValueError(f"an answer has at least one token, got {output}")
    if tokens is not None:
        if line.prompt_len is not None and line.prompt_len != len(tokens):
            raise ValueError(f"prompt_len {line.prompt_len} but {len(tokens)} prompt_token_ids")
        if line.output_hashes is not None:
            raise ValueError("output_hashes go with prompt_hashes; with token ids give output_token_ids")
        prompt = len(tokens)
        if prompt < 1:
            raise ValueError("an empty prompt")
        known = token_block_hashes(tokens + out_tokens if out_tokens is not None else tokens, block_size)
    else:
        if out_tokens is not None:
            raise ValueError("output_token_ids go with prompt_token_ids; with prompt_hashes give output_hashes")
        if line.prompt_len is None:
            raise ValueError("prompt_hashes need prompt_len (the prompt's tokens)")
        prompt = line.prompt_len
        if prompt < 1:
            raise ValueError(f"prompt_len must be >= 1, got {prompt}")
        if len(hashes) != prompt // hash_block_size:
            raise ValueError(f"a prompt of {prompt} tokens has {prompt // hash_block_size} full blocks of "
                             f"{hash_block_size} tokens, but {len(hashes)} prompt_hashes are given (is "
                             "--hash-block-size right?)")
        if line.output_hashes is not None:
            most = (prompt + output) // hash_block_size - len(hashes)
            if len(line.output_hashes) > most:
                raise ValueError(f"{len(line.output_hashes)} output_hashes, but prompt and answer have only {most} "
                                 "full blocks after the prompt's")
            hashes = hashes + line.output_hashes
        fine = hash_array(hashes, "prompt_hashes and output_hashes")
        known = fine if hash_block_size == block_size else resample(fine, hash_block_size, block_size, prompt + output)
    if line.arrival_s is not None or line.think_s is not None:
        check_times(line.arrival_s, line.think_s, "arrival_s")
        if line.arrival_s is not None and line.think_s is not None:
            raise ValueError("think_s applies to requests without arrival_s (they follow their conversation's "
                             "previous answer); drop one of them")
    return Request(index, prompt, output, padded(known, index, prompt, output, block_size), line.arrival_s,
                   line.conversation, 0.0 if line.think_s is None else line.think_s)


def open_trace(path: str | Path) -> BinaryIO:
    """A trace file, refused unless it is a regular file (a FIFO would stream for ever)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise OSError(f"{path}: not a regular file")
    return f


def count_lines(path: str | Path) -> int:
    """The trace's lines (for a progress line), counted without decoding them."""
    with open_trace(Path(path)) as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def write_lines(lines: Iterable[TraceLine], path: str | Path) -> None:
    encoder = msgspec.json.Encoder()
    with open(path, "wb") as f:
        for line in lines:
            f.write(encoder.encode(line))
            f.write(b"\n")
