"""A simulation end to end: requests arrive when the trace says (open loop) or after their conversation's answer
(closed loop), the front end passes them on one by one, P/D legs hold and release blocks and the proxy's load,
and the router's indexes, fed the engines' events, hold what the engines cache."""

from __future__ import annotations

import numpy as np
import pytest
from msgspec.structs import replace

from deploy.simulation import engine as E
from deploy.simulation.cluster import Simulation
from deploy.simulation.costs import DEFAULT
from deploy.simulation.state import EngineConfig
from deploy.simulation.trace import TraceLine, to_request

pytestmark = pytest.mark.unit

BS = 16
COSTS = replace(DEFAULT, pull_cv=0.0)


def _conversations(count: int, turns: int, first: int = 40, growth: int = 20, answer: int = 8,
                   think: float = 0.0, arrival: float | None = None) -> list:
    """Closed-loop conversations as the benches send them: turn t is the previous prompt, answer and new tokens."""
    lines = []
    for c in range(count):
        prompt: list[int] = []
        for t in range(turns):
            prompt = prompt + [9] * (answer if t else 0) + [1000 * c + 100 * t + i for i in range(growth if t else first)]
            lines.append(TraceLine(prompt_token_ids=prompt, output_token_ids=[9] * answer, conversation=c,
                                   think_s=think if t else None, arrival_s=arrival if t == 0 else None))
    lines.sort(key=lambda line: (line.arrival_s is None, 0))
    return [to_request(line, i, BS, BS) for i, line in enumerate(lines)]


def _engine(blocks: int = 200, held: bool = False) -> EngineConfig:
    return EngineConfig(blocks, BS, 256, 16, 512, held)


def test_a_turn_is_sent_its_think_time_after_the_previous_answer():
    log: list[dict] = []
    result = Simulation(_engine(), 1, "round-robin", COSTS, "off", log=log).run(
        _conversations(2, 3, think=0.7))
    assert result.answered == result.requests == 6
    by_conv = {c: sorted((x for x in log if x["conversation"] == c), key=lambda x: x["arrival_s"]) for c in (0, 1)}
    for turns in by_conv.values():
        for before, after in zip(turns, turns[1:]):
            assert after["arrival_s"] == pytest.approx(before["answer_s"] + COSTS.client_s + 0.7)
    assert [x["hit_tokens"] for x in by_conv[0]] == [0, 32, 64], "each turn hits the blocks of the one before"


def test_requests_that_arrive_together_reach_the_engine_one_dispatch_apart():
    log: list[dict] = []
    Simulation(_engine(), 1, "round-robin", COSTS, "off", log=log).run(_conversations(4, 1, arrival=3.0))
    assert sorted(x["arrival_s"] for x in log) == pytest.approx([3.0 + i * COSTS.dispatch_s for i in range(4)])


def test_a_read_ahead_shorter_than_a_conversation_makes_its_turns_late():
    requests = _conversations(3, 4)
    requests.sort(key=lambda r: (r.conversation, r.index))  # one conversation after another in the file
    assert Simulation(_engine(), 1, "round-robin", COSTS, "off", read_ahead=2).run(requests).late > 0
    assert Simulation(_engine(), 1, "round-robin", COSTS, "off", read_ahead=100).run(requests).late == 0


@pytest.mark.parametrize("policy", ["round-robin", "cache-aware"])
def test_pd_legs_give_back_their_blocks_and_the_proxys_load(policy):
    sim = Simulation(_engine(60, held=True), 2, policy, COSTS, "off")
    result = sim.run(_conversations(6, 4))
    assert result.answered == 24
    assert [b.queued_tokens for b in sim.policy.backends] == [0, 0]
    state = sim.state
    assert state.idle() and (state.es[:, E.E_NFREE] == 59).all(), "every block but the null one free again"


def test_cache_aware_keeps_each_conversation_on_one_prefill_where_round_robin_scatters_it():
    homes = {}
    for policy in ("round-robin", "cache-aware"):
        log: list[dict] = []
        # the think time lets every leg finish before the next turns come: no queue outweighs a cached history
        Simulation(_engine(400, held=True), 2, policy, COSTS, "zero-copy", log=log).run(_conversations(5, 4, think=5.0))
        homes[policy] = {c: {x["engine"] for x in log if x["conversation"] == c} for c in range(5)}
    assert all(len(engines) == 1 for engines in homes["cache-aware"].values())
    assert any(len(engines) == 2 for engines in homes["round-robin"].values())


def test_the_routers_indexes_hold_exactly_what_the_engines_cache():
    sim = Simulation(_engine(40, held=True), 2, "cache-aware", COSTS, "off")
    result = sim.run(_conversations(8, 5))
    assert result.evictions > 0, "the pool is small enough to evict"
    for e, index in enumerate(sim.policy._indexes):
        cached = {int(h) for h in sim.state.blocks[e, :, E.B_HASH][sim.state.blocks[e, :, E.B_HASHED] == 1]}
        assert {name[1] for name in index._entries} == cached


def test_a_request_longer_than_the_max_model_len_names_the_option():
    with pytest.raises(ValueError, match="raise --max-model-len"):
        Simulation(EngineConfig(200, BS, 256, 16, 40, False), 1, "round-robin", COSTS, "off").run(_conversations(1, 1))


def test_an_engine_too_small_for_the_max_model_len_is_refused_as_vllm_would():
    with pytest.raises(ValueError, match="max model len 512 needs 32 blocks of 16 tokens but an engine has 9"):
        EngineConfig(10, BS, 256, 16, 512, False)


def test_open_loop_requests_arrive_when_the_trace_says():
    log: list[dict] = []
    lines = [TraceLine(prompt_token_ids=[i] * 30, output_len=4, arrival_s=float(i)) for i in range(4)]
    Simulation(_engine(), 1, "round-robin", COSTS, "off", log=log).run(
        [to_request(line, i, BS, BS) for i, line in enumerate(lines)])
    assert [x["arrival_s"] for x in sorted(log, key=lambda x: x["index"])] == [0.0, 1.0, 2.0, 3.0]
    assert np.isfinite([x["answer_s"] for x in log]).all()


def test_past_an_index_bound_below_the_engines_blocks_the_router_matches_what_the_indexes_hold():
    """An index bound below an engine's blocks forgets blocks the engine still caches and keeps children of forgotten
    parents aside as orphans: a prompt matches exactly the chain of its blocks the indexes hold."""
    sim = Simulation(_engine(40, held=True), 2, "cache-aware", COSTS, "off")
    policy = sim.policy
    for index in policy._indexes:
        index.max_blocks = 4
    holders, everyone = policy.router.holders, sum(index.bit for index in policy._indexes)
    orphans, matches = [], []
    choose = policy.router.choose

    def checked(order, prompt, estimate):
        names = [("GPU", h) for h in prompt.hashes[:len(prompt) // BS].tolist()]
        indexed: list = []
        for index in policy._indexes:  # the chain as the indexes hold it
            indexed += index.keys_of(names, len(indexed))
        matches.append(holders.runs(indexed, everyone))
        assert holders.runs(prompt.keys(BS), everyone) == matches[-1]
        orphans.append(sum(index.orphans for index in policy._indexes))
        return choose(order, prompt, estimate)

    policy.router.choose = checked
    result = sim.run(_conversations(8, 6))
    assert result.answered == 48 and result.evictions > 0 and max(orphans) > 0, "the indexes kept orphans"
    assert any(matches), "some prompts matched"


def test_a_traced_turn_waits_for_the_previous_answer_when_it_came_later_here():
    """Bailian's later turns (open loop, `follows`): at their timestamp, but never before their conversation's
    previous answer."""
    from deploy.simulation.formats import read_trace
    from tests.helpers.paths import REPO

    requests = list(read_trace(REPO / "tests" / "data" / "traces" / "bailian.jsonl", BS))
    log: list[dict] = []
    slow = replace(COSTS, steps={m: replace(c, step_s=2.0) for m, c in COSTS.steps.items()})
    result = Simulation(EngineConfig(400, BS, 256, 16, 1024, False), 1, "round-robin", slow, "off", log=log).run(requests)
    assert result.answered == 10
    by_index = {x["index"]: x for x in log}
    follows = [r for r in requests if r.follows]
    held = 0
    for r in follows:
        previous = max((x for x in log if x["conversation"] == r.conversation and x["index"] < r.index),
                       key=lambda x: x["index"])
        assert by_index[r.index]["arrival_s"] >= max(r.arrival_s, previous["answer_s"] + slow.client_s) - 1e-9
        held += previous["answer_s"] + slow.client_s > r.arrival_s
    assert result.held_back == held > 0, "2-second steps answer some turns after the next one's timestamp"
    assert result.summary()["by_type"]["text"]["requests"] == 6
