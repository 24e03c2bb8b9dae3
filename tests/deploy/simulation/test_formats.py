"""The public trace formats: each sample (tests/data/traces/, made here in each format's shape) read as its format,
prefixes matched the way vLLM's chained hashes match them, times in seconds, and every bad line refused naming its
line, its field and the fix."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deploy.simulation.formats import detect, read_trace
from deploy.simulation.trace import TraceError, TraceInfo
from tests.helpers.paths import REPO

pytestmark = pytest.mark.unit

SAMPLES = REPO / "tests" / "data" / "traces"


def _write(tmp_path, name: str, *lines) -> str:
    path = tmp_path / name
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading blocks two requests share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("name, fmt", [("mooncake.jsonl", "mooncake"), ("bailian.jsonl", "bailian"),
                                       ("azure.csv", "lengths"), ("burstgpt.csv", "lengths"), ("kvpp.jsonl", "kvpp")])
def test_each_sample_is_told_by_its_first_line_and_read_whole(name, fmt):
    assert detect(SAMPLES / name) == fmt
    info = TraceInfo(fmt, None)
    requests = list(read_trace(SAMPLES / name, 16, info=info))
    lines = sum(1 for line in (SAMPLES / name).read_text().splitlines() if line.strip()) - name.endswith(".csv")
    assert len(requests) + sum(info.skipped.values()) == lines == info.requests + sum(info.skipped.values())
    assert [r.index for r in requests] == list(range(len(requests)))
    arrivals = [r.arrival_s for r in requests if r.arrival_s is not None]
    assert arrivals == sorted(arrivals)


def test_mooncake_ids_name_prefixes_of_512_tokens_and_timestamps_are_milliseconds():
    requests = list(read_trace(SAMPLES / "mooncake.jsonl", 128))
    first, third = requests[0], requests[2]
    assert (first.arrival_s, third.arrival_s) == (0.0, 1.52)
    # both start with ids 0, 1, 2 (1,536 tokens) and then differ: 12 blocks of 128 shared, not the 13th
    assert _shared(first.hashes, third.hashes) == 12
    # the hashed block's sub-blocks are distinct blocks
    assert len(set(first.hashes.tolist())) == len(first.hashes)
    assert len(first.hashes) == (2400 + 180) // 128


def test_mooncake_blocks_coarser_than_the_trace_are_named_by_their_last_sub_block():
    fine = list(read_trace(SAMPLES / "mooncake.jsonl", 512))
    coarse = list(read_trace(SAMPLES / "mooncake.jsonl", 1024, 512))
    assert _shared(fine[0].hashes, fine[2].hashes) == 3 and _shared(coarse[0].hashes, coarse[2].hashes) == 1
    assert coarse[0].hashes[0] == fine[0].hashes[1]


def test_bailian_ids_are_chained_so_an_id_elsewhere_never_matches():
    requests = list(read_trace(SAMPLES / "bailian.jsonl", 16))
    a1, b1, c1 = requests[0], requests[1], requests[4]
    assert _shared(a1.hashes, b1.hashes) == 4, "the three system blocks and the boilerplate block, in place"
    assert _shared(c1.hashes, a1.hashes) == 0, "the boilerplate block first: no match with it at position 3"
    assert not set(c1.hashes.tolist()) & set(a1.hashes.tolist())
    a2 = requests[3]
    assert _shared(a1.hashes, a2.hashes) == 185 // 16, "a later turn extends the first's full blocks"


def test_bailian_conversations_turns_and_types():
    info = TraceInfo("bailian", None)
    requests = list(read_trace(SAMPLES / "bailian.jsonl", 16, info=info))
    by_chat = {11 + i: r for i, r in enumerate(requests)}
    assert by_chat[19].conversation == by_chat[14].conversation == by_chat[11].conversation == 11
    assert [r.follows for r in requests] == [r.turn > 1 for r in requests]
    assert info.types == {"text": 6, "file": 2, "search": 1, "image": 1}
    assert info.turns == {"1": 6, "2": 3, "3": 1}
    assert by_chat[13].kind == "search" and by_chat[13].arrival_s == 2.25


def test_lengths_are_azure_or_burstgpt_and_share_no_block():
    info = TraceInfo("lengths", None)
    azure = list(read_trace(SAMPLES / "azure.csv", 16, info=info))
    assert [round(r.arrival_s, 6) for r in azure[:4]] == [0.0, 0.026517, 0.442328, 1.328091]
    assert (azure[0].prompt, azure[0].output) == (4808, 10)
    assert any("no request can reuse" in note for note in info.notes)
    burst = list(read_trace(SAMPLES / "burstgpt.csv", 16, info=info))
    assert [r.arrival_s for r in burst] == [0.0, 105.5, 113.0, 113.0, 235.0]
    assert dict(info.skipped) == {"no output token (a failed request)": 1}
    for requests in (azure, burst):
        names = [h for r in requests for h in r.hashes.tolist()]
        assert len(names) == len(set(names))


@pytest.mark.parametrize("name, line, message", [
    ("m.jsonl", {"timestamp": 0, "input_length": 600, "output_length": 3}, r"m.jsonl:2: .*`hash_ids`.*every line"),
    ("m.jsonl", {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2, 3]},
     r"m.jsonl:2: hash_ids: 3 ids, but an input_length of 600 tokens makes 2 blocks of 512 tokens \(1 full\); is "
     "--hash-block-size right"),
    ("m.jsonl", {"timestamp": "soon", "input_length": 6, "output_length": 3, "hash_ids": [1]},
     r"m.jsonl:2: Expected `float`, got `str` - at `\$.timestamp`"),
    ("m.jsonl", {"timestamp": 0, "input_length": -6, "output_length": 3, "hash_ids": []},
     "m.jsonl:2: input_length must be >= 0"),
    ("m.jsonl", {"timestamp": -1, "input_length": 6, "output_length": 3, "hash_ids": [1]},
     "m.jsonl:2: timestamp must be a finite number >= 0"),
    ("m.jsonl", {"timestamp": 0, "input_length": 6, "output_length": 3, "hash_ids": [2**64]},
     "m.jsonl:2: hash_ids: 18446744073709551616 is not a 64-bit integer"),
    ("m.jsonl", "not json", "m.jsonl:2: not a JSON object"),
    ("b.jsonl", {"parent_chat_id": -1, "timestamp": 0, "input_length": 6, "output_length": 3, "hash_ids": [1]},
     r"b.jsonl:2: Object missing required field `chat_id`"),
])
def test_a_bad_line_names_its_line_field_and_fix(tmp_path, name, line, message):
    first = ({"timestamp": 0, "input_length": 1000, "output_length": 3, "hash_ids": [1, 2]} if name == "m.jsonl" else
             {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0, "input_length": 40, "output_length": 3,
              "hash_ids": [1, 2, 3]})
    fmt = "mooncake" if name == "m.jsonl" else "bailian"
    with pytest.raises(TraceError, match=message):
        list(read_trace(_write(tmp_path, name, first, line), 16, fmt=fmt))


def test_timestamps_go_forward_only(tmp_path):
    path = _write(tmp_path, "m.jsonl", {"timestamp": 2000, "input_length": 6, "output_length": 3, "hash_ids": [1]},
                  {"timestamp": 1000, "input_length": 6, "output_length": 3, "hash_ids": [1]})
    with pytest.raises(TraceError, match=r"m.jsonl:2: the arrival \(timestamp\) 1 s is before the previous line's 2 s; "
                       "sort the trace by timestamp"):
        list(read_trace(path, 16))


@pytest.mark.parametrize("text, message", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,48,10\nyesterday,4,1\n",
     "a.csv:3: TIMESTAMP: Invalid isoformat string"),
    ("Timestamp,Model,Request tokens,Response tokens\n1,m,5,1\n2,m,many,1\n", "a.csv:3: Request tokens: invalid literal"),
    ("Timestamp,Model,Request tokens,Response tokens\n1,m,5,1\n2,m,5,-1\n", "a.csv:3: Response tokens: a count"),
    ("Timestamp,Model,Request tokens,Response tokens\n5,m,5,1\n2,m,5,1\n", "a.csv:3: Timestamp is before the first"),
    ("when,prompt,answer\n1,2,3\n", "a.csv:1: .*not a JSON object nor the CSV header"),
])
def test_a_bad_row_of_lengths_names_its_line_column_and_fix(tmp_path, text, message):
    path = tmp_path / "a.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=message):
        list(read_trace(path, 16))


def test_an_unknown_first_line_asks_for_the_format(tmp_path):
    with pytest.raises(TraceError, match=r"x.jsonl:1: cannot tell the trace's format from its first line's keys "
                       r"\(prompt, when\); give --trace-format"):
        detect(_write(tmp_path, "x.jsonl", {"when": 1, "prompt": "hi"}))


def test_lengths_carry_no_hash_block_size():
    with pytest.raises(ValueError, match="--hash-block-size: a trace of lengths carries no block hashes; drop it"):
        list(read_trace(SAMPLES / "azure.csv", 16, 16))
