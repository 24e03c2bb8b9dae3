"""One vLLM engine (TP=2, fp32, KV pool) running anchor_table.py's workload; prints one JSON line.

The workload file lists phases run in order on this one engine, so KVPP off and on see the same
requests in the same order:
  ["ttft", name, ids]                     one prompt, one token: seconds and pooled tokens
  ["decode", name, [ids...], max_tokens]  a batch decoding together: the median of its last steps
  ["waves", name, [[ids...], ...]]        waves of prompts, each waiting for the previous: seconds
  ["pause", name, seconds]                let the pool's background saves land
Separate process per configuration, since one process hosts one engine configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from deploy.services.processes import reference_engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--staging", type=int, default=None,
                    help="KVPP on with this many staging buffers (0: zero-copy); KVPP off when left out")
    ap.add_argument("--kv-bytes", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--kv-transfer-config", required=True)
    ap.add_argument("--workload", required=True)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model, tensor_parallel_size=2, **reference_engine(), enforce_eager=True,
        kv_cache_memory_bytes=args.kv_bytes,
        additional_config={} if args.staging is None else {"enable_kvpp": True, "kvpp_staging_buffers": args.staging},
        max_model_len=args.max_model_len,
        max_num_batched_tokens=max(args.max_model_len, 4096), seed=0,
        kv_transfer_config=json.loads(args.kv_transfer_config),
    )
    engine = llm.llm_engine
    with open(args.workload) as fh:
        phases = json.load(fh)
    results = {}
    for i, phase in enumerate(phases):
        kind, name = phase[0], phase[1]
        label = "off" if args.staging is None else f"staging {args.staging}"
        print(f"[anchor {label}] {i + 1}/{len(phases)} {kind} {name}", file=sys.stderr, flush=True)
        if kind == "ttft":
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            started = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": phase[2]}], params, use_tqdm=False)[0]
            results[name] = {"seconds": time.perf_counter() - started, "pooled_tokens": out.num_cached_tokens,
                             "token": out.outputs[0].token_ids[0]}
        elif kind == "decode":
            prompts, max_tokens = phase[2], phase[3]
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            for j, ids in enumerate(prompts):
                engine.add_request(f"{name}-{j}", {"prompt_token_ids": ids}, params)
            steps, tokens = [], {}
            while engine.has_unfinished_requests():
                started = time.perf_counter()
                for out in engine.step():
                    if out.finished:
                        tokens[out.request_id] = list(out.outputs[0].token_ids)
                steps.append(time.perf_counter() - started)
            # The first steps load and prefill; the last half of max_tokens are decode steps only.
            results[name] = {"step_seconds": statistics.median(steps[-(max_tokens // 2):]), "steps": len(steps),
                             "tokens": [tokens[f"{name}-{j}"] for j in range(len(prompts))]}
        elif kind == "waves":
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            started, pooled, prompt_tokens = time.perf_counter(), 0, 0
            for wave in phase[2]:
                outs = llm.generate([{"prompt_token_ids": ids} for ids in wave], params, use_tqdm=False)
                pooled += sum(o.num_cached_tokens for o in outs)
                prompt_tokens += sum(len(ids) for ids in wave)
            results[name] = {"seconds": time.perf_counter() - started, "prompt_tokens": prompt_tokens,
                             "pooled_tokens": pooled}
        elif kind == "pause":
            time.sleep(phase[2])
        else:
            raise ValueError(f"unknown phase {phase[0]!r}")
    results["workers"] = llm.collective_rpc("kvpp_stats")
    print("ANCHOR_RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
