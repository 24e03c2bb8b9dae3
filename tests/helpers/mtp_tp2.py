"""The MTP tiny model at TP2 (one speculative token, 64 MiB of KV) over the runtime engine test's two-wave
workload (testbed/staggered.py). KVPP on without any connector is also the shape of the store
engine test's pool-free reference, so one run (tests/conftest.py: mtp_kvpp_tp2) answers both. Each run then
serves the capacity load (LOAD_PROMPTS at once); a KVPP run serves it a second time with every KV block
past KVPP-off's count zeroed after each step (the capacity test's negative control)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from testbed.engine import EngineSettings
from testbed.engine_run import Job, run_engine
from testbed.prompts import token_prompts
from testbed.staggered import Staggered

from kvpp_core.capacity import plan_capacity
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology

KV_BYTES = 64 << 20
MAX_TOKENS = 8
# Long enough to span many blocks (300 tokens = 19 blocks); two arrive while the first two decode.
PROMPT_LENGTHS = (300, 45, 170, 90)
# 8 x 17 blocks (260 prompt + 8 answer + 1 speculative token) = 136: past KVPP off's 107 blocks, within KVPP
# on's 165, so KVPP off can hold only 6 of them at once and KVPP on all 8.
LOAD_PROMPTS = (260,) * 8
BLOCK = 16


def plan(model: str, kv_bytes: int = KV_BYTES, staging: int = 2):
    """`kvpp plan` for a TP2 engine of `model`: the blocks KVPP off and on get from `kv_bytes` per rank (the
    capacity tests' KVPP-off count, also for the P/D prefill and the pool engines of this shape)."""
    return plan_capacity(ModelSpec.from_hf_config(model), Topology(tp=2), kv_bytes, block_size=BLOCK, staging=staging)


def mtp_tp2_run(model: str, *, references: dict[str, list[int]] | None = None,
                reference_max_tokens: int = MAX_TOKENS, log: Path | None = None, wrap: Sequence[str] = (),
                **settings) -> dict:
    """One engine run (`settings`: further EngineSettings, e.g. kvpp=True, or another kv_bytes); `references` are then served alone,
    under "references"; `log`: where the engine's output goes; `wrap`: what it runs under (run_engine)."""
    kvpp = settings.get("kvpp", False)
    workload = Staggered(token_prompts(model, PROMPT_LENGTHS), max_tokens=MAX_TOKENS,
                         load=token_prompts(model, LOAD_PROMPTS, seed=1), load_max_tokens=MAX_TOKENS,
                         corrupt_above=plan(model).blocks_off if kvpp else None,
                         references=references or {}, reference_max_tokens=reference_max_tokens)
    engine = EngineSettings(**{"model": model, "tp": 2, "mtp": 1, "kv_bytes": KV_BYTES, **settings})
    return run_engine(Job(engine, workload), log=log, wrap=wrap)
