"""The TP2 x PP2 offline engine run (KVPP off, staging or zero-copy) and its `kvpp plan`, shared by the eager
and the compiled PP engine tests: the tiny model split unevenly (7 + 9 layers, VLLM_PP_LAYER_PARTITION), fp32."""

from __future__ import annotations

from testbed.engine import EngineSettings
from testbed.engine_run import Job, run_engine
from testbed.prompts import token_prompts
from testbed.staggered import Staggered, assert_bit_identical, assert_same_outputs

from kvpp_core.capacity import plan_capacity
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology

SPLIT = (7, 9)
KV_BYTES = 64 << 20
BLOCK = 16
MAX_TOKENS = 8
PROMPT_LENGTHS = (300, 45, 170, 90)
PAGE = BLOCK * 576 * 4  # one layer's block: 16 tokens x (512 + 64) fp32
PROBE_LENGTHS = (160,) * 4
"""The bytes test's requests (testbed/staggered.py's probe): 10 blocks each before they decode, 44 of the cache's
260 at most, few enough that every layer moves exactly them, never whole (kvpp_core.packing.choose)."""
CHURN_PROMPTS = 40
CHURN_TOKENS = tuple(75 + i % 5 for i in range(CHURN_PROMPTS))
"""The churn between the probe's passes: 40 one-block prompts decoding together, 6 blocks each, 240 in all (every
free block handed out, the requests' blocks interleaved), then finishing in five groups of every fifth request:
vLLM hands freed blocks out again last freed first, so the probe's requests get the blocks of every fifth churn
request, ids four apart, where the at most 16 ranges sent before issue 37 bridge the gaps."""


def pp_run(model: str, probe: bool = False, env: dict[str, str] | None = None, **settings) -> dict:
    """One run of the workload, TP2 x PP2 split SPLIT; `settings` further EngineSettings (kvpp, staging,
    compiled, worker_extension); `probe`: first the probe on a fresh and on a churned cache (the bytes test)."""
    extra = {} if not probe else dict(
        probe=token_prompts(model, PROBE_LENGTHS, seed=2), churn=token_prompts(model, (16,) * CHURN_PROMPTS, seed=3),
        churn_max_tokens=list(CHURN_TOKENS))
    job = Job(EngineSettings(model=model, tp=2, pp=2, kv_bytes=KV_BYTES, **settings),
              Staggered(token_prompts(model, PROMPT_LENGTHS), max_tokens=MAX_TOKENS, **extra))
    return run_engine(job, env={"VLLM_PP_LAYER_PARTITION": ",".join(map(str, SPLIT)), **(env or {})})


def pp_plan(model: str, staging: int = 2):
    """`kvpp plan` for the same model, split and memory as pp_run."""
    return plan_capacity(ModelSpec.from_hf_config(model), Topology(tp=2, pp=2, pp_layers=SPLIT), KV_BYTES,
                         block_size=BLOCK, staging=staging)


def assert_probe_moves_exactly_its_blocks(off: dict, on: dict) -> dict:
    """The bytes test (issue 37) on a pp_run(probe=True) against KVPP off's: on the fresh cache and on the churned
    one (its free blocks scattered and full of the churn's stale histories), the probe's answers are KVPP off's,
    bit for bit, and every worker received, over each pass, exactly its foreign layers' referenced blocks: each
    decode step the blocks holding each request's computed tokens, whole pages, no layer whole. The churn did
    scatter them: the at most 16 ranges sent before issue 37 would have carried several times as many blocks.
    Returns those block counts."""
    from bench.packing import ranges_before

    # Decode step s (1..7) of a request reads the blocks of its prompt and its first s - 1 answer tokens.
    referenced = sum(-(-(n + s) // BLOCK) for n in PROBE_LENGTHS for s in range(MAX_TOKENS - 1))
    for phase in ("fresh", "churned"):
        assert_same_outputs(off["probe"][phase], on["probe"][phase], len(PROBE_LENGTHS), MAX_TOKENS)
        assert_bit_identical(off["probe"][phase], on["probe"][phase])
        for worker, moved in zip(on["workers"], on["probe"][phase]["workers"], strict=True):
            foreign = SPLIT[worker["pp_rank"]] - len(worker["owned_layers"])
            assert moved["whole_layers"] == 0, (phase, worker["pp_rank"], worker["kvpp_rank"], moved)
            assert moved["bytes"] == foreign * referenced * PAGE, (phase, worker["pp_rank"], worker["kvpp_rank"], moved)
    carried = {}
    for phase in ("fresh", "churned"):
        ids = [b for blocks in on["probe"][phase]["block_ids"].values() for b in blocks]
        carried[phase] = {"blocks": len(set(ids)), "ranges_before_carried": sum(len(r) for r in ranges_before(ids))}
    assert carried["fresh"]["ranges_before_carried"] == carried["fresh"]["blocks"], carried  # one run: nothing bridged
    assert carried["churned"]["ranges_before_carried"] >= 3 * carried["churned"]["blocks"], carried
    return carried
