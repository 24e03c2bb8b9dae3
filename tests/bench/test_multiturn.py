"""The multi-turn bench's arithmetic without an engine: how conversations grow, what a cache that evicts nothing
could hit, hit rates and answer counts, the decode step time, and which kernel writes which results file."""

import argparse
import asyncio
import itertools
import math

import pytest

from bench import multiturn, routing
from bench.multiturn import (Conversations, bench_engine, decode_step_s, equal_answers, hit_rate, results_path,
                             turn_hit_rates)
from deploy.services.processes import GQA

pytestmark = pytest.mark.unit

WORK = Conversations(count=2, turns=3, start_tokens=100, user_tokens=20, answer_tokens=5)


def test_each_turn_adds_the_answer_and_the_new_user_tokens():
    assert [WORK.prompt_tokens(t) for t in range(3)] == [100, 125, 150]
    assert WORK.max_model_len == 155
    assert WORK.history_blocks(32) == 2 * 5  # 155 tokens: 5 blocks of 32 per conversation


def test_the_user_turns_are_drawn_in_one_order_whatever_the_answers():
    counter = itertools.count()
    users = WORK.user_turns(lambda n: [next(counter) for _ in range(n)])
    assert [[len(turn) for turn in conv] for conv in users] == [[100, 20, 20], [100, 20, 20]]
    assert users[0][0][0] == 0 and users[1][0][0] == 140  # conversation 1 starts after all of conversation 0


def test_a_conversation_sends_its_history_and_answers_back(monkeypatch):
    sent = []

    async def fake_stream(session, url, prompt, max_tokens):
        sent.append(list(prompt))
        answer = [1000 + len(sent)] * max_tokens
        return {"token_ids": answer, "cached_tokens": 0, "sent": 0.0, "arrivals": [0.1, 0.2]}

    monkeypatch.setattr(multiturn, "stream_one", fake_stream)
    users = [[1] * 100, [2] * 20, [3] * 20]
    done = [0]
    records = asyncio.run(multiturn.conversation(None, "http://x", users, 5, done))
    assert [len(p) for p in sent] == [WORK.prompt_tokens(t) for t in range(3)]
    assert sent[1] == users[0] + [1001] * 5 + users[1]
    assert sent[2] == sent[1] + [1002] * 5 + users[2]
    assert [r["prompt_tokens"] for r in records] == [100, 125, 150] and done == [3]


def test_the_hit_ceiling_counts_the_whole_blocks_of_the_previous_turn():
    # Turn 1 reuses (100 + 5 - 1) // 32 = 3 blocks, turn 2 (125 + 4) // 32 = 4; 375 prompt tokens in all.
    assert WORK.hit_ceiling(32) == pytest.approx((3 * 32 + 4 * 32) / 375)
    assert Conversations(1, 1, 100, 20, 5).hit_ceiling(32) == 0.0


def test_hit_rates():
    assert hit_rate(30, 120) == 0.25 and hit_rate(0, 0) == 0.0
    records = [[{"cached_tokens": 0, "prompt_tokens": 100}, {"cached_tokens": 96, "prompt_tokens": 125}],
               [{"cached_tokens": 0, "prompt_tokens": 100}, {"cached_tokens": 0, "prompt_tokens": 125}]]
    assert turn_hit_rates(records) == [0.0, 96 / 250]


def test_equal_answers_counts_conversation_turns():
    reference = [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]
    assert equal_answers(reference, reference) == 4
    assert equal_answers([[[1, 2], [3, 0]], [[5, 6], [7, 8]]], reference) == 3


def test_the_decode_step_is_the_mean_of_the_inter_token_latencies_between_two_reads():
    assert decode_step_s({"sum": 3.0, "count": 6.0}) == 0.5
    assert math.isnan(decode_step_s({"sum": 0.0, "count": 0.0}))


def test_each_kernel_writes_its_own_results_unless_told_where(monkeypatch):
    gqa = argparse.Namespace(kernel="CPU_ATTN", out=None, png=None)
    assert results_path(gqa, "out") == "bench/results/multiturn_gqa.json"
    assert results_path(gqa, "png", routing.RESULTS) == "bench/results/routing_gqa.png"
    amx = argparse.Namespace(kernel="AMX_MLA", out="elsewhere.json", png=None)
    assert (results_path(amx, "out"), results_path(amx, "png")) == ("elsewhere.json", "bench/results/multiturn.png")
    assert bench_engine(gqa) is GQA
    monkeypatch.setattr(multiturn, "host_has_amx", lambda: False)
    with pytest.raises(SystemExit, match="--kernel CPU_ATTN runs the tiny GQA model"):
        bench_engine(amx)
