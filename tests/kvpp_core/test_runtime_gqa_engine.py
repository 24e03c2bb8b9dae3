"""KVPP on a GQA model whose KV head TP replicates, on vLLM's CPU attention kernel (CPU_ATTN, fp32, block 32), which
keeps vLLM's prefix cache and chunked prefill on every x86 host: the prefix-cache path KVPP exists for, tested
without AMX. The tiny GQA model (one KV head) at TP2, with a chunked-prefill launch (`--max-num-batched-tokens 256
--max-num-seqs 8`), publishing vLLM's KV cache events to a ZMQ subscriber.

Four engines serve one workload (tests/helpers/prefix_cache_modes.py): KVPP off and zero-copy with the same KV
memory per rank (KV_BYTES), each holding the blocks `kvpp plan` gives its mode; and staging and zero-copy sized by
the plan to KVPP off's blocks. Runs of equal blocks schedule alike (the same steps, prefix-cache hits and
preemptions), so every token and logprob must be bit-identical: the waves, a prompt chunked over several steps, a
second pass that hits vLLM's prefix cache, multi-turn conversations, and a load that preempts and resumes requests;
their KV cache events too. At equal memory the conversations (testbed/multi_turn.py) take turns through a cache that
KVPP off cannot keep every history in and zero-copy can: KVPP lifts vLLM's prefix-hit rate to the workload's
ceiling. First, a probe on the fresh cache: staging moves exactly its foreign layers' referenced blocks.

"""

from __future__ import annotations

import collections

import pytest
from testbed.multi_turn import MultiTurn
from testbed.prompts import token_draws, token_prompts
from testbed.staggered import Staggered
from tests.helpers.prefix_cache_modes import (MODES, assert_every_pass_bit_identical, budget_for, mode_run,
                                              planned_blocks)

from bench.multiturn import Conversations
from deploy.services.processes import GQA
from kvpp_core.topology import Topology

pytestmark = pytest.mark.engine

TP2 = Topology(tp=2)
BLOCK = GQA.block_size
KV_BYTES = 4 << 20
"""Per rank: 64 blocks with KVPP off (8 layers x 8 KiB pages), 85 with staging (6 pages), 128 with zero-copy (4)."""
PAGE = BLOCK * 2 * 32 * 4
"""One layer's block on a rank: 32 tokens x K and V of the one KV head of 32 channels, fp32."""
LAUNCH = dict(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=1024)
MAX_TOKENS = 8
SHARED = 256
# Four prompts over one 256-token start (8 blocks), and one chunked over 4+ steps of 256 tokens.
PROMPTS = ((SHARED, 40), (SHARED, 100), (SHARED, 150), (SHARED, 70), (0, 900))
# Four at once, 15 blocks each at admission (480 tokens), 16 from their first decode: together past the 63 blocks
# KVPP off's 64 leave usable (vLLM keeps one null block), so the last admitted is preempted and resumes.
LOAD = (480,) * 4
LOAD_TOKENS = 16
PROBE = (64,) * 4
"""The bytes test's requests: 2 blocks each, all four prefilled in the first step, few enough blocks that every layer
moves exactly them, never whole (kvpp_core.packing.choose)."""
TALK = Conversations(count=6, turns=4, start_tokens=256, user_tokens=64, answer_tokens=4)
"""Every history at the last turn takes 6 x 15 = 90 blocks: more than KVPP off's 64, fewer than zero-copy's 128."""


def _workload(model: str) -> Staggered:
    shared = token_prompts(model, (SHARED,), seed=7)[0]
    tails = token_prompts(model, [n for _, n in PROMPTS], seed=8)
    return Staggered([shared[:start] + tail for (start, _), tail in zip(PROMPTS, tails)], max_tokens=MAX_TOKENS,
                     repeats=1, load=token_prompts(model, LOAD, seed=9), load_max_tokens=LOAD_TOKENS,
                     probe=token_prompts(model, PROBE, seed=10),
                     multi_turn=MultiTurn(TALK.user_turns(token_draws(model, seed=11)), TALK.answer_tokens))


@pytest.fixture(scope="module")
def runs(tiny_gqa_model, tmp_path_factory) -> dict:
    """{"memory": KVPP off and zero-copy at KV_BYTES per rank, "blocks": every mode at KVPP off's blocks (off's run
    shared)}."""
    workload = _workload(tiny_gqa_model)
    events = tmp_path_factory.mktemp("kv-events")
    ends = iter(range(4))

    def run(mode: dict, kv_bytes: int) -> dict:
        return mode_run(tiny_gqa_model, TP2, GQA, mode, workload, kv_bytes, kv_events=f"ipc://{events}/{next(ends)}",
                        **LAUNCH)

    memory = {name: run(MODES[name], KV_BYTES) for name in ("off", "zero-copy")}
    blocks_off = memory["off"]["num_blocks"]
    blocks = {name: memory["off"] if name == "off" else
              run(mode, budget_for(tiny_gqa_model, TP2, GQA, mode, blocks_off)) for name, mode in MODES.items()}
    return {"memory": memory, "blocks": blocks}


def test_every_engine_holds_and_allocates_what_the_plan_gives_it(runs):
    assert [runs["memory"][name]["num_blocks"] for name in ("off", "zero-copy")] == [64, 128]
    for kind in ("memory", "blocks"):
        for name, run in runs[kind].items():
            plan, mode = run["plan"], MODES[name]
            assert run["num_blocks"] == run["planned_blocks"] == planned_blocks(plan, mode), (kind, name)
            (stage,) = plan.stages
            for worker in run["workers"]:
                if not mode:
                    assert worker["allocated_kv_bytes"] == plan.blocks_off * stage.ranks[0].bytes_per_block_off
                    continue
                rank = stage.ranks[worker["kvpp_rank"]]
                assert (worker["replica_group"], worker["group_size"]) == (0, 2)
                assert worker["owned_layers"] == list(rank.owned), (kind, name)
                assert worker["bytes_per_block"] == rank.bytes_per_block_on == \
                    (len(rank.owned) + rank.staging_slots) * PAGE, (kind, name)
                assert worker["allocated_kv_bytes"] == worker["kv_bytes"] == plan.blocks_on * rank.bytes_per_block_on
            if mode:
                assert sorted(layer for w in run["workers"] for layer in w["owned_layers"]) == list(range(8))
    for name in MODES:
        assert runs["blocks"][name]["num_blocks"] == runs["memory"]["off"]["num_blocks"], name


def test_kvpp_gives_kvpp_offs_tokens_and_logprobs_bit_for_bit(runs):
    off = runs["blocks"]["off"]
    for name in ("staging", "zero-copy"):
        assert_every_pass_bit_identical(off, runs["blocks"][name])


def test_the_second_pass_hit_vllms_prefix_cache(runs):
    for name, run in runs["blocks"].items():
        (again,) = run["repeats"]
        for i, (start, _) in enumerate(PROMPTS):
            cached = again[str(i)]["cached_tokens"]
            assert cached >= BLOCK and cached % BLOCK == 0, (name, i, cached)
        assert run["prefix_cache"]["hits"] > 0


def test_a_long_prompt_was_chunked_over_several_steps(runs):
    steps = -(-PROMPTS[-1][1] // LAUNCH["max_num_batched_tokens"])
    for name, run in runs["blocks"].items():
        assert run["outputs"][str(len(PROMPTS) - 1)]["prefill_steps"] >= steps, name


def test_the_full_cache_preempted_requests_that_resumed_alike(runs):
    preempted = {name: run["load"]["clean"]["preemptions"] for name, run in runs["blocks"].items()}
    assert preempted["off"] > 0 and len(set(preempted.values())) == 1, preempted
    for name, run in runs["blocks"].items():
        assert len(run["load"]["clean"]["outputs"]) == len(LOAD), name


def test_vllms_kv_cache_events_with_kvpp_are_kvpp_offs(runs):
    off = runs["blocks"]["off"]["kv_events"]
    kinds = collections.Counter(event[0] for batch in off for event in batch)
    assert kinds["BlockStored"] > 0 and kinds["BlockRemoved"] > 0, kinds
    for event in (e for batch in off for e in batch if e[0] == "BlockStored"):
        assert len(event[3]) == len(event[1]) * BLOCK == len(event[1]) * event[4], event[1:]
    for name in ("staging", "zero-copy"):
        assert runs["blocks"][name]["kv_events"] == off, name


def test_at_equal_memory_kvpp_keeps_more_histories_and_lifts_the_prefix_hit_rate(runs):
    """The conversations' hit rate by vLLM's own counters (`vllm:prefix_cache_hits` over `..._queries`) and by each
    request's `num_cached_tokens`: zero-copy keeps every history (each later turn finds every full block of its
    previous prompt and answer, the workload's ceiling), KVPP off evicts histories it is asked for next; at equal
    blocks KVPP hits what KVPP off hits (the bit-for-bit test compares each request's cached tokens)."""
    rates = {}
    for name, run in runs["memory"].items():
        counters = run["multi_turn"]["prefix_cache"]
        outputs = run["multi_turn"]["outputs"].values()
        cached = sum(o["cached_tokens"] for o in outputs)
        # One request at a time: nothing is preempted, so vLLM counts each prompt once.
        assert counters["queries"] == sum(o["prompt_tokens"] for o in outputs), name
        assert counters["hits"] == cached, name
        rates[name] = counters["hits"] / counters["queries"]
    print(f"prefix-hit rate of the conversations at {KV_BYTES >> 20} MiB per rank: {rates}, ceiling "
          f"{TALK.hit_ceiling(BLOCK):.3f}")
    assert rates["zero-copy"] == pytest.approx(TALK.hit_ceiling(BLOCK), abs=1e-12)
    assert rates["off"] < 0.8 * rates["zero-copy"], rates
    assert TALK.history_blocks(BLOCK) > runs["memory"]["off"]["num_blocks"]


def test_staging_moves_exactly_the_referenced_blocks_of_its_foreign_layers(runs):
    """The probe on the fresh cache: each decode step the blocks holding each request's computed tokens, whole pages,
    no layer whole; every staging rank receives its 4 foreign layers' share."""
    referenced = sum(-(-(n + s) // BLOCK) for n in PROBE for s in range(MAX_TOKENS - 1))
    run = runs["blocks"]["staging"]
    assert {w["transport"] for w in run["workers"]} == {"shared memory"}
    for worker, moved in zip(run["workers"], run["probe"]["fresh"]["workers"], strict=True):
        foreign = 8 - len(worker["owned_layers"])
        assert moved["whole_layers"] == 0, (worker["kvpp_rank"], moved)
        assert moved["bytes"] == foreign * referenced * PAGE, (worker["kvpp_rank"], moved)
