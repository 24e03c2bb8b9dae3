"""Cache-aware prefill choice against round-robin, with KVPP off and on: multi-turn conversations through
`kvpp proxy` in front of two TP2 prefills and one decode (P/D over MooncakeConnectorV2), on a kernel that keeps
vLLM's prefix cache on (`--kernel`, as bench/multiturn.py takes it): the tiny MLA model in bf16 on AMX_MLA (a CPU with
AMX; the default), or the tiny GQA model in fp32 on CPU_ATTN (any x86 host).

Why: KVPP multiplies what one prefill keeps cached, and that pays only when a conversation's next turn reaches
the prefill that holds its history. Round-robin spreads a conversation's turns over both prefills, so each must
hold every history (and the turn that lands elsewhere recomputes); the cache-aware proxy (`--kv-events`, the
prefills' vLLM KV cache events and their replay endpoints) sends each turn to the prefill where its cached prefix,
net of the prompt tokens already queued there, leaves the least to compute.

Setup: per KVPP mode (`--modes`: off, and staging or zero-copy) two prefill engines (TP2, the same KV budget per
rank, vLLM's prefix cache on, their KV cache events published over ZMQ) and one decode (KVPP off: it holds whole
blocks; `--decode-tp`, default 1 for MLA, whose cache every rank holds whole, and 2 for GQA, whose decode reads each
KV head from the prefill rank of its TP rank), and two proxies in front of them: round-robin, and cache-aware fed by
the prefills' events. The modes run one after the other (a 2-core, 24 GiB host holds one mode's three engines at a
time); within a mode every round runs both policies, each round starting with the other one (bench/summary.py's
`interleaved`), so the policies are compared interleaved and the modes are not. Every run starts from empty prefix
caches (/reset_prefix_cache on every engine, which also tells the cache-aware proxy through AllBlocksCleared) and
sends the same conversations (multiturn's shape: turn t is the previous prompt, its answer and new user tokens).

Per run: the prefills' prefix-cache hit rate from their /metrics (`vllm:prefix_cache_hits_total` over
`..._queries_total`, deltas summed over both prefills), TTFT p50/p99 and TPOT at the client through the proxy
(prefill leg, KV pull and the decode's first token), requests/s, the decode's step time (the mean of its
`vllm:inter_token_latency_seconds`), and how the turns spread over the prefills
(`vllm:prefix_cache_queries_total` per prefill). Figures are min/median/max over rounds; ratios of cache-aware over
round-robin per mode, per round. Answers are bf16 and depend on which prefixes hit, so they are counted against
round-robin's of the same mode and round, not asserted.

    .venv/bin/python -m bench.routing [--kernel AMX_MLA|CPU_ATTN] [--modes off,zero-copy] [--rounds 3]
        [--conversations 8 --turns 6 --start-tokens 768 --user-tokens 256 --answer-tokens 16] [--kv-mib 96]
        [--decode-tp N] [--out bench/results/routing.json] [--png bench/results/routing.png]

writes bench/results/routing.json (AMX_MLA) or routing_gqa.json (CPU_ATTN), a chart beside it.

It takes the machine-wide engine lock (/tmp/kvpp-engine.lock) while its engines run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.anchor_table import MODES, engine_lock
from bench.multiturn import (Conversations, add_workload_args, bench_engine, chart, counters, decode_step_s,
                             equal_answers, hit_rate, results_path, serve, workload, workload_model)
from bench.serving import check_modes, latencies
from bench.summary import host, interleaved, spread
from deploy.deployment.launch import kv_events_flags
from deploy.harness.engines import engine_num_blocks
from deploy.services.ports import free_port, free_port_range
from deploy.services.processes import CpuEngine, Engine, ManagedProcess, start_servers
from deploy.services.proxy import start_proxy
from testbed.pd_servers import pd_server
from testbed.prompts import token_draws

POLICIES = ("round-robin", "cache-aware")
METRICS = ("hit_rate", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "decode_step_s", "wall_s")
DECODE_KV_BYTES = 1 << 30
RESULTS = {"AMX_MLA": "bench/results/routing", "CPU_ATTN": "bench/results/routing_gqa"}


def prefill(name: str, model: str, tmp: Path, kv_bytes: int, max_model_len: int, staging: int | None,
            engine: CpuEngine) -> Engine:
    """A TP2 prefill on cores 0 and 1 (`staging`: kvpp_staging_buffers, None: KVPP off) publishing its KV cache
    events and replaying them on free ports (the instance's kv_events, rendered as a deployment's), with vLLM's
    dev-mode routes (/reset_prefix_cache)."""
    kvpp = {} if staging is None else {"enable_kvpp": True, "additional_config": {"kvpp_staging_buffers": staging}}
    return pd_server(name, model, tmp, tp=2, cores=[0, 1], role="kv_producer", kv_port=free_port_range(3),
                     server={"kv_cache_bytes": kv_bytes, "max_model_len": max_model_len, "engine": engine,
                             "kv_events": True, "kv_events_port": free_port(), "kv_events_replay_port": free_port(),
                             **kvpp},
                     env={"VLLM_SERVER_DEV_MODE": "1"}, extra_args=("--served-model-name", "tiny"))


def run(proxy_url: str, prefills: list[Engine], decode: Engine, users: list[list[list[int]]], answer_tokens: int,
        label: str) -> dict:
    """One pass of every conversation through one proxy, with its figures."""
    before = [counters(e) for e in (*prefills, decode)]
    started = time.perf_counter()
    records = asyncio.run(serve(proxy_url, users, answer_tokens, label, engines=[e.url for e in (*prefills, decode)]))
    wall = time.perf_counter() - started
    *deltas, decoded = [{k: after[k] - b[k] for k in b}
                        for b, after in zip(before, (counters(e) for e in (*prefills, decode)))]
    flat = [r for conv in records for r in conv]
    return {
        "wall_s": wall, "requests_per_s": len(flat) / wall, **latencies(flat), "decode_step_s": decode_step_s(decoded),
        "hit_rate": hit_rate(sum(d["prefix_cache_hits"] for d in deltas),
                             sum(d["prefix_cache_queries"] for d in deltas)),
        "prefill_query_tokens": [d["prefix_cache_queries"] for d in deltas],
        "preemptions": sum(d["num_preemptions"] for d in deltas),
        "answers": [[r["token_ids"] for r in conv] for conv in records],
    }


def mode_stack(mode: str, model: str, tmp: Path, kv_bytes: int, work: Conversations, users: list[list[list[int]]],
               warm_up: list[list[list[int]]], rounds: int, runs: dict, engine: CpuEngine, decode_tp: int) -> list[int]:
    """One mode's two prefills and a decode, a proxy per policy, the policies interleaved over `rounds` (results
    into `runs`); the prefills' blocks."""
    prefills = [prefill(f"prefill-{mode}-{i}", model, tmp, kv_bytes, work.max_model_len, MODES[mode], engine)
                for i in range(2)]
    decode = pd_server(f"decode-{mode}", model, tmp, tp=decode_tp, cores=[1] if decode_tp == 1 else [0, 1],
                       role="kv_consumer", kv_port=free_port_range(2), policy="recompute",
                       env={"VLLM_SERVER_DEV_MODE": "1"}, extra_args=("--served-model-name", "tiny"),
                       server={"kv_cache_bytes": DECODE_KV_BYTES, "max_model_len": work.max_model_len,
                               "engine": engine})
    started: list[ManagedProcess] = []
    try:
        print(f"[routing] {mode}: starting 3 engines ...", file=sys.stderr, flush=True)
        start_servers((*prefills, decode), started, timeout=900)
        engines = [e.url for e in (*prefills, decode)]
        proxies = {}
        for policy in POLICIES:
            events = kv_events_flags([e.kv_events for e in prefills]) if policy == "cache-aware" else ()
            proc, proxies[policy] = start_proxy([e.url for e in prefills], [decode.url], tmp / f"proxy-{mode}-{policy}.log",
                                                extra_args=events)
            started.append(proc)
        for policy, url in proxies.items():  # the first requests of an engine pay one-time costs
            asyncio.run(serve(url, warm_up, work.answer_tokens, f"warm-up {mode} {policy}", engines=engines))
        for r, policy in interleaved(list(POLICIES), rounds):
            label = f"{mode}: round {r + 1}/{rounds} {policy}"
            print(f"[routing] {label} ...", file=sys.stderr, flush=True)
            runs[(r, f"{mode} {policy}")] = result = run(proxies[policy], prefills, decode, users, work.answer_tokens,
                                                         label)
            print(f"[routing] {label}: {result['wall_s']:.1f} s, hit rate {result['hit_rate']:.2f}, prefill query "
                  f"tokens {result['prefill_query_tokens']}", file=sys.stderr, flush=True)
        return [engine_num_blocks(e.url) for e in prefills]
    finally:
        for proc in reversed(started):
            proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, Conversations(8, 6, 768, 256, 16), kv_mib=96)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["off", "zero-copy"],
                    help=f"prefill pairs, KVPP off first ({', '.join(MODES)})")
    ap.add_argument("--decode-tp", type=int, choices=(1, 2), help="the decode's TP (default: 1 for MLA, 2 for GQA)")
    ap.add_argument("--out", help="default: bench/results/routing.json (AMX_MLA), routing_gqa.json (CPU_ATTN)")
    ap.add_argument("--png", help="default: the --out of the kernel, as .png")
    ap.add_argument("--note", default="", help="what the results file says about the host (e.g. shared)")
    ap.add_argument("--workdir", type=Path, help="keep the model and every engine's and proxy's log here "
                    "(default: a temporary directory, removed)")
    args = ap.parse_args()
    check_modes(ap, args.modes)
    engine = bench_engine(args)
    decode_tp = args.decode_tp or (1 if engine.kernel.mla else 2)
    work = workload(ap, args)
    configs = [f"{mode} {policy}" for mode in args.modes for policy in POLICIES]

    with tempfile.TemporaryDirectory(prefix="kvpp-routing-") as tmp_name:
        tmp = Path(tmp_name) if args.workdir is None else args.workdir
        tmp.mkdir(parents=True, exist_ok=True)
        model, layers = workload_model(args, tmp, engine)
        users = work.user_turns(token_draws(model, seed=7))
        warm_up = Conversations(1, 2, args.start_tokens, args.user_tokens, args.answer_tokens)
        runs, blocks = {}, {}
        with engine_lock():
            for mode in args.modes:
                blocks[mode] = mode_stack(mode, model, tmp, args.kv_mib << 20, work, users,
                                          warm_up.user_turns(token_draws(model, seed=8)), args.rounds, runs, engine,
                                          decode_tp)

    rounds = range(args.rounds)
    for (r, config), result in runs.items():
        mode = config.split()[0]
        result["answers_equal_round_robin"] = equal_answers(result["answers"], runs[(r, f"{mode} round-robin")]["answers"])
    for result in runs.values():
        del result["answers"]
    summary = {config: {m: spread([runs[(r, config)][m] for r in rounds]) for m in METRICS} for config in configs}
    ratio = {mode: {m: spread([runs[(r, f"{mode} cache-aware")][m] / runs[(r, f"{mode} round-robin")][m]
                               for r in rounds]) for m in METRICS}
             for mode in args.modes}
    out = {
        "command": ".venv/bin/python -m bench.routing " + shlex.join(sys.argv[1:]),
        "setup": {"kernel": engine.kernel.name, "dtype": engine.dtype, "block_size": engine.block_size,
                  "attention": "mla" if engine.kernel.mla else "gqa", "layers": layers,
                  "prefills_per_mode": 2, "prefill_tp": 2, "decode_tp": decode_tp,
                  "kv_mib_per_prefill_rank": args.kv_mib,
                  "modes": {mode: MODES[mode] for mode in args.modes}, "policies": list(POLICIES),
                  "conversations": {**asdict(work), "max_model_len": work.max_model_len,
                                    "requests": work.count * work.turns,
                                    "history_blocks": work.history_blocks(engine.block_size),
                                    "hit_rate_ceiling": work.hit_ceiling(engine.block_size)},
                  "num_gpu_blocks": blocks, "rounds": args.rounds,
                  "run_order": [f"{mode} {r}:{policy}" for mode in args.modes
                                for r, policy in interleaved(list(POLICIES), args.rounds)]},
        "host": host(args.note),
        "runs": [{"round": r, "config": config, **result} for (r, config), result in runs.items()],
        "summary": summary, "ratio_cache_aware_over_round_robin": ratio,
    }
    Path(results_path(args, "out", RESULTS)).write_text(json.dumps(out, indent=2) + "\n")
    chart(out, results_path(args, "png", RESULTS),
          f"{work.count} conversations x {work.turns} turns through kvpp proxy, 2 TP2 prefills + a TP{decode_tp} "
          f"decode, {engine.kernel.name} {engine.dtype}, {layers} layers, {args.kv_mib} MiB KV per prefill rank")
    print(json.dumps({"num_gpu_blocks": blocks,
                      "summary": {c: {m: s["median"] for m, s in figures.items()} for c, figures in summary.items()},
                      "ratio_cache_aware_over_round_robin": {mode: {m: s["median"] for m, s in r.items()}
                                                             for mode, r in ratio.items()}}, indent=2))


if __name__ == "__main__":
    main()
