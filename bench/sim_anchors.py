"""The anchors' published prefix-hit rates beside the simulator's, on paper: each anchor's KV capacity with KVPP off
and on, a synthetic multi-turn agent workload shaped by what the anchor states, and the hit rates the simulated
vLLM prefix cache reaches.

Capacities (tokens per engine):
- SGLang LayerSplit, GLM-5.2 CP8, one staging slot: the planner's (`kvpp plan --model glm-5.2 --tp 1 --pcp 8
  --runner v2 --staging 1`: 7.09x, the anchor's own ratio) at the anchor's published off capacity, 457,920 tokens.
- vLLM's GPU KVPP, GLM-5.3 FP8 on 4x GB300: its published 778,688 and 2,713,216 tokens (no GLM-5.3 preset here).
- vLLM's GPU KVPP, DeepSeek-V2-Lite TP4: the planner's with two scratch buffers (3.00x, the anchor's published 3.0x)
  at 32 GiB per rank (the anchor gives no memory; the workload is scaled to the capacity, so the figure does not
  depend on it).

Workload, the same rule for every anchor (none publishes its conversations): `conversations` closed-loop agent
conversations, all open at once, each with `turns` turns sent right after the previous answer, one of 8 shared
system prompts, a first message, a growth per turn and answers as in ANCHORS; the number of conversations is set so
that their histories at the last turn need `pressure` times the KVPP-off capacity. The anchors' pressure is not
published: each anchor is simulated at pressures 1, 2 and 4, and the table states them all, with the ceiling (the
hit rate of a cache that keeps every history: what the workload's new tokens leave). One colocated engine,
block 64 (the GPU anchors' FlashMLA page), vLLM's defaults of 8,192 batched tokens and 256 sequences; timing is the
default cost model's and does not enter the hit rate beyond the order of the steps.

    .venv/bin/python -m bench.sim_anchors [--out bench/results/sim_anchors.json]
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

from kvpp_core.capacity import plan_capacity
from kvpp_core.model import resolve_model
from kvpp_core.topology import Topology

from deploy.simulation.cluster import Simulation
from deploy.simulation.costs import DEFAULT
from deploy.simulation.state import EngineConfig
from deploy.simulation.synthetic import Workload, lines
from deploy.simulation.trace import to_request

BLOCK = 64
PRESSURES = (1.0, 2.0, 4.0)
GIB = 1 << 30


def _planned(model: str, topo: Topology, staging: int) -> tuple[int, int]:
    """(blocks off, blocks on) per engine from the planner, at 32 GiB per rank."""
    plan = plan_capacity(resolve_model(model).with_overrides(mtp_layers=0), topo, 32 * GIB, block_size=BLOCK,
                         staging=staging)
    return plan.blocks_off, plan.blocks_on


def anchors() -> list[dict]:
    glm_off, glm_on = _planned("glm-5.2", Topology(tp=1, pcp=8, runner="v2"), 1)
    sglang_off = 457_920 // BLOCK
    lite_off, lite_on = _planned("deepseek-v2-lite", Topology(tp=4), 2)
    return [
        {"anchor": "SGLang LayerSplit, GLM-5.2 CP8 (multi-turn, last round)", "published": (0.15, 0.67),
         "blocks": (sglang_off, round(sglang_off * glm_on / glm_off)), "capacity_source": "planner ratio "
         f"{glm_on / glm_off:.2f}x at the published 457,920 tokens off",
         "shape": dict(system_tokens=4096, first_tokens=4096, growth_tokens=2048, output_tokens=512, turns=12),
         "vague": "conversations, their lengths and concurrency unpublished; the figure is the last round's"},
        {"anchor": "vLLM GPU KVPP, GLM-5.3 FP8 4x GB300 (Agent-64K)", "published": (0.327, 0.787),
         "blocks": (778_688 // BLOCK, 2_713_216 // BLOCK), "capacity_source": "published tokens",
         "shape": dict(system_tokens=8192, first_tokens=8192, growth_tokens=3072, output_tokens=512, turns=16),
         "vague": "Agent-64K's shape unpublished beyond its name: histories assumed to grow to about 64K tokens"},
        {"anchor": "vLLM GPU KVPP, DeepSeek-V2-Lite TP4", "published": (0.38, 0.80),
         "blocks": (lite_off, lite_on), "capacity_source": f"planner, 32 GiB per rank ({lite_on / lite_off:.2f}x)",
         "shape": dict(system_tokens=2048, first_tokens=2048, growth_tokens=1024, output_tokens=256, turns=12),
         "vague": "workload unpublished (an input-throughput bench); a multi-turn agent workload assumed"},
    ]


def simulate(blocks: int, shape: dict, conversations: int) -> dict:
    work = Workload(conversations=conversations, rate=0.0, think_s=0.0, **shape)
    max_len = work.max_tokens()
    engine = EngineConfig(blocks, BLOCK, 8192, 256, max_len, False)
    result = Simulation(engine, 1, "round-robin", DEFAULT, "off").run(
        to_request(line, i, BLOCK, BLOCK) for i, line in enumerate(lines(work, BLOCK)))
    return {"hit_rate": result.hit_rate, "preemptions": result.preemptions, "requests": result.requests}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/sim_anchors.json")
    args = ap.parse_args()
    rows = []
    for a in anchors():
        work = Workload(conversations=1, rate=0.0, think_s=0.0, **a["shape"])
        history_blocks = work.max_tokens() / BLOCK
        for pressure in PRESSURES:
            conversations = max(1, math.ceil(pressure * a["blocks"][0] / history_blocks))
            unbounded = math.ceil(conversations * history_blocks) + 16 * a["shape"]["turns"] * conversations
            off, on, ceiling = (simulate(b, a["shape"], conversations) for b in (*a["blocks"], unbounded))
            rows.append({**a, "pressure": pressure, "conversations": conversations, "off": off, "on": on,
                         "ceiling": ceiling})
            print(f"{a['anchor']:58} pressure {pressure:g} ({conversations} conversations): simulated "
                  f"{off['hit_rate']:.3f} -> {on['hit_rate']:.3f} (every history kept: {ceiling['hit_rate']:.3f}), "
                  f"published {a['published'][0]} -> {a['published'][1]}", flush=True)
    out = {"command": ".venv/bin/python -m bench.sim_anchors " + shlex.join(sys.argv[1:]), "block_size": BLOCK,
           "costs": DEFAULT.source, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
