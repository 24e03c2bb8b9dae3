"""Run one real vLLM engine over a fixed workload and print tokens, logprobs and KVPP reports as JSON.

Tests compare two runs of this script (KVPP off and on) in separate processes, since one process
can host only one vLLM engine configuration. Requests arrive in two waves so that later steps mix
fresh prefills with decodes that need history (the steps where KVPP broadcasts).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--kvpp", action="store_true")
    ap.add_argument("--staging", type=int, default=None)
    ap.add_argument("--kv-bytes", type=int, default=64 << 20)
    ap.add_argument("--prompts", required=True, help="JSON file: list of lists of token ids")
    ap.add_argument("--first-wave", type=int, default=2, help="prompts submitted before the first step")
    ap.add_argument("--steps-between-waves", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    additional = {}
    if args.kvpp:
        additional["enable_kvpp"] = True
        if args.staging is not None:
            additional["kvpp_staging_buffers"] = args.staging
    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        dtype="float32",
        enforce_eager=True,
        block_size=16,
        kv_cache_memory_bytes=args.kv_bytes,
        compilation_config={"custom_ops": ["-rotary_embedding"]},
        additional_config=additional,
        max_model_len=1024,
        seed=0,
    )
    with open(args.prompts) as f:
        prompts = json.load(f)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1, ignore_eos=True)
    engine = llm.llm_engine
    outputs = {}
    step_seconds = []

    def submit(indices):
        for i in indices:
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params)

    def step():
        started = time.perf_counter()
        finished = engine.step()
        step_seconds.append(time.perf_counter() - started)
        for out in finished:
            if out.finished:
                comp = out.outputs[0]
                outputs[out.request_id] = {
                    "token_ids": list(comp.token_ids),
                    "logprobs": [lp[tok].logprob for tok, lp in zip(comp.token_ids, comp.logprobs)],
                }

    submit(range(min(args.first_wave, len(prompts))))
    for _ in range(args.steps_between_waves):
        step()
    submit(range(args.first_wave, len(prompts)))
    while engine.has_unfinished_requests():
        step()
    reports = llm.collective_rpc("kvpp_stats")
    print("KVPP_RESULT " + json.dumps({"outputs": outputs, "workers": reports, "step_seconds": step_seconds}), flush=True)


if __name__ == "__main__":
    main()
