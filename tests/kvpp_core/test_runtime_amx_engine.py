"""KVPP on the kernel CPU users serve MLA models with: bf16 on AMX_MLA (block size 128), with vLLM's own prefix
cache and chunked prefill on, as the seed's combined launch asks (`--enable-chunked-prefill
--enable-prefix-caching --max-num-batched-tokens 256 --max-num-seqs 12`; `--async-scheduling` is refused on CPU,
see tests/kvpp_core/test_setup.py). Runs only where the host has AMX tiles; skipped elsewhere with the reason.

KVPP off, staging and zero-copy each run one engine with the same number of blocks (each mode's budget sized by
`kvpp plan` so that it holds exactly BLOCKS blocks, asserted against the engine), so the three schedule alike:
the same steps, the same prefix-cache hits, the same preemptions. Then every token and every logprob must be
bit-identical: through a second pass that hits vLLM's prefix cache, a prompt chunked over several steps, MTP
speculative decoding, and a load that preempts and resumes requests under the full cache. In bf16 the answers
depend on how the work was batched and which prefixes hit (a hit computes the rest over cached pages), so runs
are compared only at equal blocks, where that is the same; no tolerance is needed there. The TP2 runs also
publish vLLM's KV cache events to a ZMQ subscriber: KVPP on must report the cache KVPP off reports.
"""

from __future__ import annotations

import collections

import pytest
from testbed.prompts import token_prompts
from testbed.staggered import Staggered
from tests.helpers.prefix_cache_modes import MODES, assert_every_pass_bit_identical, budget_for, mode_run

from deploy.services.processes import AMX
from kvpp_core.cpu_backends import host_has_amx
from kvpp_core.topology import Topology

pytestmark = [pytest.mark.engine, pytest.mark.skipif(
    not host_has_amx(), reason="AMX_MLA needs a CPU with AMX tiles (amx_tile in /proc/cpuinfo); this host has none")]

BLOCK = AMX.block_size
BLOCKS = 24
"""Every mode's engine holds exactly this many blocks (3,072 tokens)."""
SEED_LAUNCH = dict(max_num_batched_tokens=256, max_num_seqs=12)
MAX_TOKENS = 8
SHARED = 512
# Four conversations over one 512-token start (4 blocks), and one prompt chunked over 4+ steps of 256 tokens.
PROMPTS = ((SHARED, 90), (SHARED, 200), (SHARED, 310), (SHARED, 140), (0, 900))
# Four at once, 12 blocks each with their answers (1,400 + 64 tokens): two fill BLOCKS, and requests that grow
# past it are preempted and resumed (shorter ones are only queued: vLLM admits what fits).
LOAD = (1400,) * 4
LOAD_TOKENS = 64


def _prompts(model: str) -> list[list[int]]:
    shared = token_prompts(model, (SHARED,), seed=7)[0]
    tails = token_prompts(model, [n for _, n in PROMPTS], seed=8)
    return [shared[:start] + tail for (start, _), tail in zip(PROMPTS, tails)]


def amx_run(model: str, topology: Topology, mode: dict, workload: Staggered, mtp: int = 0,
            kv_events: str | None = None) -> dict:
    """One engine of `mode` on AMX_MLA, sized to BLOCKS blocks, serving `workload`; the plan's blocks added, and
    the KV cache events a subscriber to `kv_events` received."""
    return mode_run(model, topology, AMX, mode, workload, budget_for(model, topology, AMX, mode, BLOCKS), mtp=mtp,
                    kv_events=kv_events, max_model_len=2048, **SEED_LAUNCH)


@pytest.fixture(scope="module")
def tp2_runs(mtp_model, tmp_path_factory) -> dict:
    workload = Staggered(_prompts(mtp_model), max_tokens=MAX_TOKENS, repeats=1,
                         load=token_prompts(mtp_model, LOAD, seed=9), load_max_tokens=LOAD_TOKENS)
    events = tmp_path_factory.mktemp("kv-events")
    return {name: amx_run(mtp_model, Topology(tp=2), mode, workload, mtp=1, kv_events=f"ipc://{events}/{i}")
            for i, (name, mode) in enumerate(MODES.items())}


def test_every_mode_holds_the_blocks_of_its_plan(tp2_runs):
    for name, run in tp2_runs.items():
        assert run["num_blocks"] == run["planned_blocks"] == BLOCKS, name


def test_kvpp_gives_kvpp_offs_tokens_and_logprobs_bit_for_bit(tp2_runs):
    off = tp2_runs["off"]
    for name in ("staging", "zero-copy"):
        assert_every_pass_bit_identical(off, tp2_runs[name])


def test_the_second_pass_hit_vllms_prefix_cache(tp2_runs):
    for name, run in tp2_runs.items():
        (again,) = run["repeats"]
        for i in range(len(PROMPTS)):
            # Whole blocks only, at least the first (the cache may have evicted later ones of a long prompt).
            cached = again[str(i)]["cached_tokens"]
            assert cached >= BLOCK and cached % BLOCK == 0, (name, i, cached)
        assert run["prefix_cache"]["hits"] > 0


def test_a_long_prompt_was_chunked_over_several_steps(tp2_runs):
    steps = -(-PROMPTS[-1][1] // SEED_LAUNCH["max_num_batched_tokens"])
    for name, run in tp2_runs.items():
        assert run["outputs"][str(len(PROMPTS) - 1)]["prefill_steps"] >= steps, name


def test_the_full_cache_preempted_requests_that_resumed_alike(tp2_runs):
    preempted = {name: run["load"]["clean"]["preemptions"] for name, run in tp2_runs.items()}
    assert preempted["off"] > 0 and len(set(preempted.values())) == 1, preempted
    for name, run in tp2_runs.items():
        assert len(run["load"]["clean"]["outputs"]) == len(LOAD), name


def test_kvpp_broadcast_and_kept_the_mtp_cache_on_every_rank(tp2_runs):
    for name in ("staging", "zero-copy"):
        workers = tp2_runs[name]["workers"]
        assert [w["mtp_caches"] for w in workers] == [["model.layers.16.self_attn.attn"]] * 2
        assert sorted(layer for w in workers for layer in w["owned_layers"]) == list(range(16))
    for worker in tp2_runs["staging"]["workers"]:
        assert 0 < worker["broadcast"]["broadcast_steps"] < worker["broadcast"]["steps"]


def test_vllms_kv_cache_events_with_kvpp_are_kvpp_offs(tp2_runs):
    """vLLM's prefix-cache events (`--kv-events-config`), as a ZMQ subscriber received them: with KVPP on, staging or
    zero-copy, the same blocks stored and evicted in the same steps as with KVPP off; each stored block a whole
    block of the request's tokens. KVPP shards the layers, not the blocks, so a router reading them stays right."""
    off = tp2_runs["off"]["kv_events"]
    kinds = collections.Counter(event[0] for batch in off for event in batch)
    assert kinds["BlockStored"] > 0 and kinds["BlockRemoved"] > 0, kinds  # the load evicts cached prompts
    for event in (e for batch in off for e in batch if e[0] == "BlockStored"):
        assert len(event[3]) == len(event[1]) * BLOCK == len(event[1]) * event[4], event[1:]
    for name in ("staging", "zero-copy"):
        assert tp2_runs[name]["kv_events"] == off, name


@pytest.fixture(scope="module")
def pp_runs(tiny_model) -> dict:
    """TP2 x PP2, the 16 layers split 7 + 9 (no MTP: vLLM 0.32 does not start MTP with PP)."""
    topology = Topology(tp=2, pp=2, pp_layers=(7, 9))
    workload = Staggered(_prompts(tiny_model), max_tokens=MAX_TOKENS, repeats=1)
    return {name: amx_run(tiny_model, topology, mode, workload) for name, mode in MODES.items()}


def test_kvpp_with_pp_gives_kvpp_offs_tokens_and_logprobs_bit_for_bit(pp_runs):
    for name, run in pp_runs.items():
        assert run["num_blocks"] == run["planned_blocks"] == BLOCKS, name
        assert all(hit["cached_tokens"] >= BLOCK for hit in run["repeats"][0].values()), name
    for name in ("staging", "zero-copy"):
        assert_every_pass_bit_identical(pp_runs["off"], pp_runs[name])
