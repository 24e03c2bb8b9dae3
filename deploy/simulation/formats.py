"""The trace formats `kvpp simulate --trace` reads, told apart by a trace's first line, each streamed line by line.

- `kvpp`: this project's own (deploy/simulation/trace.py).
- `mooncake`: Mooncake's FAST'25 traces, one JSON object a line: `timestamp` (ms since the first request),
  `input_length`, `output_length`, `hash_ids` (one id per block of 512 tokens, the last one a partial block's,
  each naming its whole prefix). Open loop.
- `bailian`: Alibaba's Qwen/Bailian traces, one JSON object a line: `chat_id`, `parent_chat_id` (-1 for a
  conversation's first request), `timestamp` (s), `input_length`, `output_length`, `type`, `turn`, `hash_ids`
  (one id per block of 16 tokens, each naming its block alone). Open loop, a later turn not before its
  conversation's previous turn was answered; the requests' types and turns are reported with their hits.
- `lengths`: traces of token counts alone, CSV with a header: Azure's LLM inference traces (2023, 2024:
  `TIMESTAMP,ContextTokens,GeneratedTokens`) and BurstGPT (`Timestamp,Model,Request tokens,Response tokens,Total
  tokens,Log Type`). No block of one request can be another's, so no prefix is ever reused: the report says so.

In every format the ids of a public trace's blocks are chained here (the i-th block is named by the ids of
blocks 0..i), so that only a common prefix matches, whatever the trace's ids mean; a trace's blocks coarser than the
simulated ones count hits at the trace's granularity (deploy/simulation/blocks.py, `resample`). The answers' blocks
are in no public trace: they match nothing (a later turn hits what its conversation's earlier prompts left
cached, not the answers, which a real engine caches too). Lines of a public trace may carry more keys (ignored);
a line that cannot be simulated is refused naming its line, its field and the fix; a request that generated no
token (a failed one, in BurstGPT) is skipped and counted.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path

import msgspec
import numpy as np

from deploy.simulation.blocks import chain_ids, check_block_sizes, resample
from deploy.simulation.trace import (Request, TraceError, TraceInfo, TraceLine, check_times, hash_array, open_trace,
                                     padded, to_request)

FORMATS = ("auto", "kvpp", "mooncake", "bailian", "lengths")
HASH_BLOCK_SIZES = {"mooncake": 512, "bailian": 16}
"""The tokens per block of a public trace's hash_ids (its publisher's), the default of --hash-block-size."""
AZURE = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT = ("Timestamp", "Request tokens", "Response tokens")
NO_ANSWER = "no output token (a failed request)"
NO_PROMPT = "no prompt token"


class MooncakeLine(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


class BailianLine(msgspec.Struct):
    chat_id: int | str
    parent_chat_id: int | str
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]
    type: str | None = None
    turn: int | None = None


def detect(path: str | Path) -> str:
    """The format of a trace, from its first non-blank line: the keys of a JSON object, or a CSV header."""
    with open_trace(path) as f:
        first = next((line for line in f if line.strip()), b"")
    if not first:
        raise TraceError(f"{path}: an empty trace")
    try:
        keys = set(msgspec.json.decode(first))
    except (msgspec.DecodeError, TypeError):
        header = {c.strip() for c in next(csv.reader([first.decode("utf-8", "replace")]))}
        if set(AZURE) <= header or set(BURSTGPT) <= header:
            return "lengths"
        raise TraceError(f"{path}:1: not a JSON object nor the CSV header of a trace of lengths ({','.join(AZURE)} or "
                         f"{','.join(BURSTGPT)},...); give --trace-format") from None
    if keys & set(TraceLine.__struct_fields__) and "hash_ids" not in keys:
        return "kvpp"
    if "hash_ids" in keys:
        return "bailian" if {"chat_id", "parent_chat_id"} <= keys else "mooncake"
    raise TraceError(f"{path}:1: cannot tell the trace's format from its first line's keys ({', '.join(sorted(keys))}); "
                     "give --trace-format kvpp, mooncake, bailian or lengths")


def resolve_hash_block_size(fmt: str, block_size: int, given: int | None) -> int | None:
    """The tokens per block of a trace's hashes: `given` (--hash-block-size), else the format's own."""
    if fmt == "lengths":
        if given is not None:
            raise ValueError("--hash-block-size: a trace of lengths carries no block hashes; drop it")
        return None
    size = given or HASH_BLOCK_SIZES.get(fmt, block_size)
    check_block_sizes(block_size, size)
    return size


def read_trace(path: str | Path, block_size: int, hash_block_size: int | None = None, fmt: str = "auto",
               info: TraceInfo | None = None) -> Iterator[Request]:
    """The requests of a trace, read as they are asked for; TraceError names a bad line, its field and the fix.
    `info`, if given, gathers what the report says about the trace."""
    path = Path(path)
    if fmt == "auto":
        fmt = detect(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; use one of {', '.join(FORMATS)}")
    hbs = resolve_hash_block_size(fmt, block_size, hash_block_size)
    if info is None:
        info = TraceInfo(fmt, hbs)
    info.reset(fmt, hbs, _notes(fmt, hbs, block_size))
    reader = {"kvpp": _kvpp, "mooncake": _mooncake, "bailian": _bailian, "lengths": _lengths}[fmt]
    last = 0.0
    with open_trace(path) as f:
        for number, request in reader(f, path, block_size, hbs, info):
            if request.arrival_s is not None:
                if request.arrival_s < last:
                    raise TraceError(f"{path}:{number}: the arrival ({_time_field(fmt)}) {request.arrival_s:g} s is "
                                     f"before the previous line's {last:g} s; sort the trace by {_time_field(fmt)}")
                last = request.arrival_s
            if request.kind is None and request.turn is None:
                info.requests += 1
            else:
                info.count(request)
            yield request
    if fmt == "lengths" and info.skipped:
        info.notes.append(f"{sum(info.skipped.values()):,} line(s) skipped: "
                          + ", ".join(f"{n:,} with {why}" for why, n in info.skipped.items()))


def _time_field(fmt: str) -> str:
    return {"kvpp": "arrival_s", "lengths": "the timestamp column"}.get(fmt, "timestamp")


def _notes(fmt: str, hbs: int | None, block_size: int) -> list[str]:
    notes = []
    if fmt == "lengths":
        notes.append("the trace carries token counts only: no request can reuse another's blocks, so every hit rate "
                     "is 0 by construction; the figures show capacity, preemptions and timing alone")
    elif fmt in HASH_BLOCK_SIZES:
        notes.append("the answers' blocks are not in the trace: they match nothing, so a later turn hits what its "
                     "conversation's earlier prompts left cached but not their answers (a real engine caches those "
                     "too)")
    if hbs is not None and hbs > block_size:
        notes.append(f"the trace names blocks of {hbs} tokens, coarser than the simulated {block_size}: a shared "
                     f"prefix counts up to the start of the {hbs}-token block where it ends")
    return notes


def _jsonl(f, path: Path, line_type) -> Iterator[tuple[int, object]]:
    decode = msgspec.json.Decoder(line_type).decode
    for number, raw in enumerate(f, start=1):
        try:
            line = decode(raw)
        except msgspec.ValidationError as exc:
            raise TraceError(f"{path}:{number}: {exc}; {_fix(line_type)}") from None
        except msgspec.DecodeError as exc:
            if not raw.strip():
                continue  # a blank line
            raise TraceError(f"{path}:{number}: not a JSON object ({exc}); each line is one request") from None
        yield number, line


def _fix(line_type) -> str:
    if line_type is TraceLine:
        return "see the Simulation page for the format"
    fields = ", ".join(f for f in line_type.__struct_fields__ if f not in ("type", "turn"))
    return f"every line of this format has {fields} (or give --trace-format)"


def _kvpp(f, path, block_size, hbs, info) -> Iterator[tuple[int, Request]]:
    for index, (number, line) in enumerate(_jsonl(f, path, TraceLine)):
        try:
            yield number, to_request(line, index, block_size, hbs)
        except ValueError as exc:
            raise TraceError(f"{path}:{number}: {exc}") from None


def _blocks(line, hbs: int) -> np.ndarray:
    """A public trace line's hash_ids, checked against its input length, chained."""
    full, blocks = line.input_length // hbs, -(-line.input_length // hbs)
    if len(line.hash_ids) not in (full, blocks):
        raise ValueError(f"hash_ids: {len(line.hash_ids)} ids, but an input_length of {line.input_length} tokens makes "
                         f"{blocks} blocks of {hbs} tokens ({full} full); is --hash-block-size right?")
    return chain_ids(hash_array(line.hash_ids, "hash_ids"))


def _lengths_of(line) -> str | None:
    """Why a line is skipped (a request with no token), or None; ValueError for lengths that cannot be."""
    for name in ("input_length", "output_length"):
        if getattr(line, name) < 0:
            raise ValueError(f"{name} must be >= 0, got {getattr(line, name)}")
    return NO_PROMPT if line.input_length == 0 else NO_ANSWER if line.output_length == 0 else None


def _public(line, index, number, path, block_size, hbs, info, arrival, **fields) -> Request | None:
    try:
        skip = _lengths_of(line)
        if skip is not None:
            info.skipped[skip] += 1
            return None
        check_times(arrival, None, "timestamp")
        known = resample(_blocks(line, hbs), hbs, block_size, line.input_length)
    except ValueError as exc:
        raise TraceError(f"{path}:{number}: {exc}") from None
    prompt, output = line.input_length, line.output_length
    return Request(index, prompt, output, padded(known, index, prompt, output, block_size), arrival, **fields)


def _mooncake(f, path, block_size, hbs, info) -> Iterator[tuple[int, Request]]:
    index = 0
    for number, line in _jsonl(f, path, MooncakeLine):
        request = _public(line, index, number, path, block_size, hbs, info, line.timestamp / 1000,
                          conversation=None, think_s=0.0)
        if request is not None:
            index += 1
            yield number, request


def _bailian(f, path, block_size, hbs, info) -> Iterator[tuple[int, Request]]:
    roots: dict[int | str, int | str] = {}
    """A chat -> the first chat of its conversation."""
    index = 0
    for number, line in _jsonl(f, path, BailianLine):
        root = line.chat_id if line.parent_chat_id in (-1, "-1") else roots.get(line.parent_chat_id,
                                                                                 line.parent_chat_id)
        roots[line.chat_id] = root
        request = _public(line, index, number, path, block_size, hbs, info, line.timestamp, conversation=root,
                          think_s=0.0, follows=root != line.chat_id, kind=line.type, turn=line.turn)
        if request is not None:
            index += 1
            yield number, request


def _lengths(f, path, block_size, hbs, info) -> Iterator[tuple[int, Request]]:
    rows = csv.reader(io.TextIOWrapper(f, encoding="utf-8", newline=""))
    header = [c.strip() for c in next(rows, [])]
    if set(AZURE) <= set(header):
        time_col, columns, parse = AZURE[0], AZURE[1:], _azure_time
    elif set(BURSTGPT) <= set(header):
        time_col, columns, parse = BURSTGPT[0], BURSTGPT[1:], float
    else:
        raise TraceError(f"{path}:1: a trace of lengths starts with the CSV header {','.join(AZURE)} (Azure) or "
                         f"{','.join(BURSTGPT)},... (BurstGPT); got {','.join(header)!r}")
    at = {name: header.index(name) for name in (time_col, *columns)}
    first = None
    index = 0
    for row in rows:
        number = rows.line_num
        if not any(c.strip() for c in row):
            continue
        name = time_col
        try:
            when = parse(row[at[time_col]])
            name = columns[0]
            prompt = int(row[at[columns[0]]])
            name = columns[1]
            output = int(row[at[columns[1]]])
        except (ValueError, IndexError) as exc:
            raise TraceError(f"{path}:{number}: {name}: {exc or 'missing'}; every row has {time_col} and the token "
                             f"counts {' and '.join(columns)}") from None
        if prompt < 0 or output < 0 or not math.isfinite(when):
            raise TraceError(f"{path}:{number}: {name}: a count of tokens is >= 0 and a time finite; got "
                             f"{','.join(row)!r}")
        if prompt == 0 or output == 0:
            info.skipped[NO_PROMPT if prompt == 0 else NO_ANSWER] += 1
            continue
        first = when if first is None else first
        if when < first:
            raise TraceError(f"{path}:{number}: {time_col} is before the first row's; sort the trace by {time_col}")
        yield number, Request(index, prompt, output, padded(np.empty(0, np.int64), index, prompt, output,
                                                            block_size), when - first, None, 0.0)
        index += 1


def _azure_time(text: str) -> float:
    """Azure's TIMESTAMP (e.g. 2023-11-16 18:15:46.6805900) in seconds."""
    day, _, fraction = text.strip().partition(".")
    return (datetime.fromisoformat(day).replace(tzinfo=timezone.utc).timestamp()
            + (float("0." + fraction) if fraction else 0.0))


def write_public(lines: Iterable[dict | list], path: str | Path, fmt: str) -> None:
    """Lines of a public format (deploy/simulation/synthetic.py's `public_lines`) as a trace file."""
    if fmt == "lengths":
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows(lines)
        return
    encoder = msgspec.json.Encoder()
    with open(path, "wb") as f:
        for line in lines:
            f.write(encoder.encode(line))
            f.write(b"\n")
