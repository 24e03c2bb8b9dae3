"""Goodput at the capacity boundary: a KV-bound workload through real servers, per KVPP mode.

One vLLM server per mode (`--modes`, the anchor table's columns: KVPP off, staging = 2 staging buffers,
zero-copy = `kvpp_staging_buffers` 0) of the tiny 16-layer MLA model (TP=2, fp32, built by the project's
launch builder like every other engine here), all with the same small KV budget per rank; staging fits
1.6x the blocks of KVPP off, zero-copy about 2x. Each phase sends the same burst of long prompts, all at once,
as streamed completions, to one server: more requests than KVPP off's blocks can hold together. Every
repeat runs every mode once, each repeat starting one mode later (bench/summary.py's `interleaved`, so
drift on this shared machine hits every mode alike), --repeats times. Per phase:
requests/s and output tokens/s over the burst's wall time, TTFT and TPOT p50/p99 from the client's
stream, and from the server's own /metrics the peak of `vllm:num_requests_running` and
`vllm:kv_cache_usage_perc` (polled) and the `vllm:num_preemptions` the phase added. Every answer is
checked against the first phase's answers (greedy: every mode must produce the same text).
Ratios mode / off are taken per repeat (the phases next to each other), reported as min/median/max.

    flock /tmp/kvpp-engine.lock .venv/bin/python -m bench.goodput [--modes off,staging,zero-copy]
        [--repeats 3] [--requests 16] [--prompt-tokens 128] [--max-tokens 48] [--kv-mib 24]
        [--out bench/results/goodput.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.anchor_table import MODES
from bench.serving import check_modes, client_session, latencies, mode_server, stream_one
from bench.summary import host, interleaved, spread
from deploy.harness.engines import engine_metrics, engine_num_blocks, metric_total
from deploy.services.processes import REFERENCE, Engine, start_servers
from testbed.prompts import token_prompts

METRICS = ("requests_per_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
           "peak_running", "peak_kv_usage", "preemptions")


def poll_peaks(url: str, stop: threading.Event, peaks: dict) -> None:
    while not stop.is_set():
        text = engine_metrics(url)
        peaks["running"] = max(peaks["running"], metric_total(text, "vllm:num_requests_running"))
        peaks["kv_usage"] = max(peaks["kv_usage"], metric_total(text, "vllm:kv_cache_usage_perc"))
        stop.wait(0.2)


async def burst(url: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    async with client_session() as session:
        return await asyncio.gather(*(stream_one(session, url, p, max_tokens) for p in prompts))


def phase(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """One burst against one server, with its metrics."""
    preempted = metric_total(engine_metrics(engine.url), "vllm:num_preemptions_total")
    peaks, stop = {"running": 0.0, "kv_usage": 0.0}, threading.Event()
    poller = threading.Thread(target=poll_peaks, args=(engine.url, stop, peaks), daemon=True)
    poller.start()
    started = time.perf_counter()
    answers = asyncio.run(burst(engine.url, prompts, max_tokens))
    wall = time.perf_counter() - started
    stop.set()
    poller.join()
    return {
        "wall_s": wall, "requests_per_s": len(prompts) / wall,
        "output_tokens_per_s": len(prompts) * max_tokens / wall, **latencies(answers),
        "peak_running": peaks["running"], "peak_kv_usage": peaks["kv_usage"],
        "preemptions": metric_total(engine_metrics(engine.url), "vllm:num_preemptions_total") - preempted,
        "texts": [a["text"] for a in answers],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model dir (default: build the 16-layer tiny model)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--kv-mib", type=int, default=24, help="KV budget per rank (every mode)")
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES),
                    help=f"servers, KVPP off first ({', '.join(MODES)})")
    ap.add_argument("--out", default="bench/results/goodput.json")
    ap.add_argument("--note", default="", help="what the results file says about the host (e.g. shared)")
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats: at least 3 (min/median/max need them)")
    check_modes(ap, args.modes)
    modes = args.modes

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = args.model
        if model is None:
            from deploy.harness.tiny_model import build_tiny_model

            model = str(build_tiny_model(tmp / "tiny16", layers=16))
        prompts = token_prompts(model, [args.prompt_tokens] * args.requests, seed=3)
        max_model_len = args.prompt_tokens + args.max_tokens + 16
        engines = {mode: mode_server(f"goodput-{mode}", model, tmp, args.kv_mib << 20, max_model_len, MODES[mode])
                   for mode in modes}
        started = []
        try:
            start_servers(list(engines.values()), started, timeout=600)
            blocks = {mode: engine_num_blocks(e.url) for mode, e in engines.items()}
            phases, reference = [], None
            for rep, mode in interleaved(modes, args.repeats):
                print(f"[goodput] repeat {rep + 1}/{args.repeats} kvpp {mode}", file=sys.stderr, flush=True)
                result = phase(engines[mode], prompts, args.max_tokens)
                texts = result.pop("texts")
                reference = reference or texts
                result.update(repeat=rep, mode=mode, answers_equal_first_phase=texts == reference)
                phases.append(result)
        finally:
            for proc in reversed(started):
                proc.stop()

    by = {(p["repeat"], p["mode"]): p for p in phases}
    repeats = range(args.repeats)
    summary = {mode: {m: spread([by[(r, mode)][m] for r in repeats]) for m in METRICS} for mode in modes}
    ratio = {mode: {m: spread([by[(r, mode)][m] / by[(r, "off")][m] for r in repeats])
                    for m in METRICS if all(by[(r, "off")][m] for r in repeats)}
             for mode in modes[1:]}
    out = {
        "command": "flock /tmp/kvpp-engine.lock .venv/bin/python -m bench.goodput " + shlex.join(sys.argv[1:]),
        "setup": {"model": "tiny 16-layer MLA, fp32", "kernel": REFERENCE.kernel.name, "tp": 2,
                  "kv_mib_per_rank": args.kv_mib,
                  "modes": {mode: MODES[mode] for mode in modes},
                  "run_order": [f"{r}:{m}" for r, m in interleaved(modes, args.repeats)],
                  "requests": args.requests, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                  "max_model_len": max_model_len, "repeats": args.repeats, "num_gpu_blocks": blocks},
        "host": host(args.note),
        "all_answers_equal": all(p["answers_equal_first_phase"] for p in phases),
        "phases": phases, "summary": summary, "ratio_over_off": ratio,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"num_gpu_blocks": blocks, "all_answers_equal": out["all_answers_equal"],
                      "summary": summary, "ratio_over_off": ratio}, indent=2))


if __name__ == "__main__":
    main()
