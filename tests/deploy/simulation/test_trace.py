"""Traces in: each line's blocks named as the simulator keys them, and every bad line refused with its line number
and the fix."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from deploy.simulation.blocks import token_block_hashes
from deploy.simulation.formats import read_trace
from deploy.simulation.trace import TraceError, TraceLine, count_lines, to_request

pytestmark = pytest.mark.unit


def _write(tmp_path, *lines) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_token_prompts_with_their_answers_name_the_blocks_a_next_turn_reuses():
    turn1 = to_request(TraceLine(prompt_token_ids=list(range(20)), output_token_ids=[7] * 6), 0, 4, 4)
    turn2 = to_request(TraceLine(prompt_token_ids=list(range(20)) + [7] * 6 + [1, 2], output_len=1), 1, 4, 4)
    assert (turn1.prompt, turn1.output, len(turn1.hashes)) == (20, 6, 6)
    assert (turn2.hashes[:6] == turn1.hashes).all(), "the answer's blocks are the next prompt's"
    assert len(set(turn2.hashes.tolist())) == len(turn2.hashes)


def test_an_answer_without_its_tokens_matches_nothing():
    a = to_request(TraceLine(prompt_token_ids=list(range(10)), output_len=10), 0, 4, 4)
    b = to_request(TraceLine(prompt_token_ids=list(range(10)), output_len=10), 1, 4, 4)
    assert (a.hashes[:2] == b.hashes[:2]).all(), "the same prompt blocks"
    assert len(a.hashes) == 5 and not set(a.hashes[2:].tolist()) & set(b.hashes[2:].tolist())


def test_hashed_prompts_are_coarsened_to_the_simulated_block():
    fine = token_block_hashes(list(range(64)), 16)
    line = TraceLine(prompt_hashes=[int(h) for h in fine[:3]], prompt_len=50, output_len=14,
                     output_hashes=[int(fine[3])])
    r = to_request(line, 0, 32, 16)
    assert r.hashes.tolist() == [int(fine[1]), int(fine[3])], "a 32-token block is named by its last 16-token one"


def test_unsigned_64_bit_hashes_wrap():
    r = to_request(TraceLine(prompt_hashes=[2**64 - 1, 5], prompt_len=8, output_len=1), 0, 4, 4)
    assert r.hashes[:2].tolist() == [-1, 5]


@pytest.mark.parametrize("line, message", [
    ({"prompt_token_ids": [1, 2], "prompt_hashes": [], "prompt_len": 2, "output_len": 1}, "exactly one"),
    ({"prompt_token_ids": [1, 2]}, "give output_len or output_token_ids"),
    ({"prompt_token_ids": [1, 2], "output_len": 0}, "at least one token"),
    ({"prompt_token_ids": [], "output_len": 1}, "empty prompt"),
    ({"prompt_token_ids": [1], "output_len": 2, "output_token_ids": [1]}, "output_len 2 but 1"),
    ({"prompt_hashes": [1], "output_len": 1}, "need prompt_len"),
    ({"prompt_hashes": [1, 2], "prompt_len": 5, "output_len": 1}, "--hash-block-size"),
    ({"prompt_hashes": [1], "prompt_len": 4, "output_len": 4, "output_hashes": [2, 3]}, "only 1 full blocks"),
    ({"prompt_hashes": [2**64], "prompt_len": 4, "output_len": 1}, "not a 64-bit integer"),
    ({"prompt_token_ids": [1], "output_len": 1, "arrival_s": -1}, "arrival_s"),
    ({"prompt_token_ids": [1], "output_len": 1, "arrival_s": 1, "think_s": 1}, "drop one"),
    ({"prompt_token_ids": [1], "output_len": 1, "output_hashes": [1]}, "go with prompt_hashes"),
    ({"prompt_token_ids": [1], "output_len": 1, "promt": 1}, "promt"),
    ("{not json", "malformed"),
])
def test_a_bad_line_is_refused_with_its_number(tmp_path, line, message):
    path = _write(tmp_path, {"prompt_token_ids": [1, 2, 3, 4, 5], "output_len": 2}, line)
    with pytest.raises(TraceError, match=f"trace.jsonl:2: .*{message}"):
        list(read_trace(path, 4))


def test_open_loop_arrivals_go_forward_only(tmp_path):
    path = _write(tmp_path, {"prompt_token_ids": [1], "output_len": 1, "arrival_s": 2.0},
                  {"prompt_token_ids": [1], "output_len": 1, "conversation": "c"},
                  {"prompt_token_ids": [1], "output_len": 1, "arrival_s": 1.0})
    with pytest.raises(TraceError, match=r":3: the arrival \(arrival_s\) 1 s is before the previous line's 2 s; sort the "
                       "trace by arrival_s"):
        list(read_trace(path, 4))


def test_the_block_size_and_the_hashed_one_must_divide_one_another(tmp_path):
    with pytest.raises(ValueError, match="block size 24 and --hash-block-size 16 must divide one another"):
        list(read_trace(_write(tmp_path, {"prompt_token_ids": [1], "output_len": 1}), 24, 16))


def test_blank_lines_are_skipped_and_counted_lines_are_all_lines(tmp_path):
    path = _write(tmp_path, {"prompt_token_ids": [1], "output_len": 1}, "", {"prompt_token_ids": [2], "output_len": 1})
    assert [r.index for r in read_trace(path, 4)] == [0, 1]
    assert count_lines(path) == 3


def test_a_fifo_is_not_a_trace(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        list(read_trace(fifo, 4))
    with pytest.raises(OSError, match="not a regular file"):
        count_lines(fifo)


def test_placeholders_differ_between_requests_and_blocks():
    hashes = np.concatenate([to_request(TraceLine(prompt_token_ids=[i], output_len=40), i, 4, 4).hashes
                             for i in range(50)])
    assert len(set(hashes.tolist())) == len(hashes) == 50 * 10
