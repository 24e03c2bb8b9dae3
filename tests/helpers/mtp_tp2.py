"""The MTP tiny model at TP2 (one speculative token, 64 MiB of KV) over the runtime engine test's two-wave
workload (deploy/harness/engine_run.py). KVPP on without any connector is also the shape of the store
engine test's pool-free reference, so one run (tests/conftest.py: mtp_kvpp_tp2) answers both."""

from __future__ import annotations

import json
from pathlib import Path

from deploy.harness.engine_run import run, write_prompts

KV_BYTES = 64 << 20
MAX_TOKENS = 8
# Long enough to span many blocks (300 tokens = 19 blocks); two arrive while the first two decode.
PROMPT_LENGTHS = (300, 45, 170, 90)


def mtp_tp2_run(model: str, tmp: Path, *extra: str, references: dict[str, list[int]] | None = None,
                reference_max_tokens: int = MAX_TOKENS) -> dict:
    """One engine run (`extra` flags, e.g. --kvpp); `references` are then served alone, under "references"."""
    prompts = write_prompts(tmp / "prompts.json", model, PROMPT_LENGTHS)
    args = ["--tp", "2", "--mtp", "1", "--kv-bytes", str(KV_BYTES), "--max-tokens", str(MAX_TOKENS), *extra]
    if references:
        path = tmp / "references.json"
        path.write_text(json.dumps(references))
        args += ["--references", str(path), "--reference-max-tokens", str(reference_max_tokens)]
    return run(model, prompts, *args)
