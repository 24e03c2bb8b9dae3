"""The MTP tiny model at TP2 (one speculative token, 64 MiB of KV) over the runtime engine test's two-wave
workload (deploy/harness/engine_run.py). KVPP on without any connector is also the shape of the store
engine test's pool-free reference, so one run (tests/conftest.py: mtp_kvpp_tp2) answers both. Each run then
serves the capacity load (LOAD_PROMPTS at once); a KVPP run serves it a second time with every KV block
past KVPP-off's count zeroed after each step (the capacity test's negative control)."""

from __future__ import annotations

import json
from pathlib import Path

from deploy.harness.engine_run import run, write_prompts

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


def plan(model: str, kv_bytes: int = KV_BYTES):
    """`kvpp plan` for a TP2 engine of `model`: the blocks KVPP off and on get from `kv_bytes` per rank (the
    capacity tests' KVPP-off count, also for the P/D prefill and the pool engines of this shape)."""
    return plan_capacity(ModelSpec.from_hf_config(model), Topology(tp=2), kv_bytes, block_size=BLOCK)


def mtp_tp2_run(model: str, tmp: Path, *extra: str, references: dict[str, list[int]] | None = None,
                reference_max_tokens: int = MAX_TOKENS) -> dict:
    """One engine run (`extra` flags, e.g. --kvpp); `references` are then served alone, under "references"."""
    prompts = write_prompts(tmp / "prompts.json", model, PROMPT_LENGTHS)
    load = write_prompts(tmp / "load.json", model, LOAD_PROMPTS, seed=1)
    args = ["--tp", "2", "--mtp", "1", "--kv-bytes", str(KV_BYTES), "--max-tokens", str(MAX_TOKENS), *extra,
            "--load", str(load), "--load-max-tokens", str(MAX_TOKENS)]
    if "--kvpp" in extra:
        args += ["--corrupt-above", str(plan(model).blocks_off)]
    if references:
        path = tmp / "references.json"
        path.write_text(json.dumps(references))
        args += ["--references", str(path), "--reference-max-tokens", str(reference_max_tokens)]
    return run(model, prompts, *args)
