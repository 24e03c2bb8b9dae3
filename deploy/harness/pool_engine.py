"""One vLLM engine (offline LLM) running a scripted sequence against the KV pool; prints JSON.

Actions (a JSON list): ["gen", name, token_ids, opts?] serves one prompt; ["batch", [[name, token_ids,
opts?], ...], batch_opts?] serves several at once (admitted in this order, looked up and loaded
concurrently; batch_opts {"zero_blocks_of": name} zeroes that request's KV blocks after every engine step
from its first schedule until it ends: a negative control); ["kill", pid] kills a process (the pool's
master) mid-run. opts may hold "cache_salt" and "kv_transfer_params" (e.g. {"do_remote_decode": true}, as
a P/D proxy sends a prefill). Each prompt records the tokens, their logprobs, and how many prompt tokens
came from outside the engine (num_cached_tokens), so tests compare runs made in separate processes: one
process hosts one engine configuration, and the KV block ids the scheduler gave it (block_ids: its first
KV cache group's when first scheduled, loaded blocks included), so a test reads where a load landed.
Under "kvpp_workers" it adds each worker's `kvpp_stats` report (blocks, layout), and under
"kv_usage_after" vLLM's own `vllm:kv_cache_usage_perc` after each gen or batch (blocks a P/D prefill
still holds for its decode count as used).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

from deploy.harness.engine_run import BlockZeroing, kvpp_config, llm_metric
from deploy.services.processes import reference_engine


def _batch_opts(action: list) -> dict:
    """A batch action's batch_opts, {} when it has none."""
    return action[2] if len(action) > 2 else {}


def record_block_ids(llm) -> dict[str, list[int]]:
    """Each request's block ids (first KV cache group) when the scheduler first schedules it, by the request id
    its output carries (vLLM appends 8 random characters inside the engine), as the workers receive them."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # the engine core runs in this process
    seen: dict[str, list[int]] = {}
    schedule = scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        for req in out.scheduled_new_reqs:
            seen.setdefault(req.req_id.rsplit("-", 1)[0], list(req.block_ids[0]))
        return out

    scheduler.schedule = recording
    return seen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1, help="PP stages (the split: VLLM_PP_LAYER_PARTITION)")
    ap.add_argument("--kvpp", action="store_true")
    ap.add_argument("--staging", type=int, default=None, help="kvpp_staging_buffers (0 = zero-copy)")
    ap.add_argument("--mtp", type=int, default=0, help="MTP speculative tokens (the model needs MTP layers)")
    ap.add_argument("--kv-transfer-config", default=None, help="JSON; omitted = no pool")
    ap.add_argument("--actions", required=True, help="JSON file with the action list")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--kv-bytes", type=int, default=64 << 20)
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args()

    # The engine core in this process: one Python start-up (~20 s here) less per run. With TP or PP > 1
    # the workers are still processes of their own, as in a served engine.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    with open(args.actions) as fh:
        actions = json.load(fh)
    kwargs = {}
    if any(a[0] == "batch" and "zero_blocks_of" in _batch_opts(a) for a in actions):
        kwargs["worker_extension_cls"] = f"{BlockZeroing.__module__}.{BlockZeroing.__qualname__}"
    if args.kv_transfer_config:
        kwargs["kv_transfer_config"] = json.loads(args.kv_transfer_config)
    if args.pp > 1:
        kwargs.update(pipeline_parallel_size=args.pp, distributed_executor_backend="mp")
    llm = LLM(
        model=args.model, tensor_parallel_size=args.tp, **reference_engine(args.mtp), enforce_eager=True,
        kv_cache_memory_bytes=args.kv_bytes,
        additional_config=kvpp_config(args.kvpp, args.staging), max_model_len=args.max_model_len, seed=0,
        disable_log_stats=False, **kwargs,  # stats on: the KV usage gauge
    )
    block_ids = record_block_ids(llm)
    base = {"temperature": 0.0, "max_tokens": args.max_tokens, "logprobs": 1, "ignore_eos": True}
    engine = llm.llm_engine

    def serve(items: list, zero_blocks_of: str | None = None) -> None:
        """The items as requests named by their names, stepped to the end (what LLM.generate does)."""
        block_ids.clear()
        start = time.perf_counter()
        for name, ids, *rest in items:
            opts = rest[0] if rest else {}
            prompt = {"prompt_token_ids": ids}
            if "cache_salt" in opts:
                prompt["cache_salt"] = opts["cache_salt"]
            extra = {"kv_transfer_params": opts["kv_transfer_params"]} if "kv_transfer_params" in opts else None
            engine.add_request(name, prompt, SamplingParams(**base, extra_args=extra))
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((out.request_id, out) for out in engine.step() if out.finished)
            if zero_blocks_of in block_ids and zero_blocks_of not in outs:  # then they are someone else's
                llm.collective_rpc("zero_blocks", args=(block_ids[zero_blocks_of],))
        for name, *_ in items:
            out = outs[name]
            comp = out.outputs[0]
            results[name] = {
                "tokens": list(comp.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)],
                "num_cached_tokens": out.num_cached_tokens,
                "seconds": time.perf_counter() - start,
                "block_ids": block_ids.get(name),
            }
        results["kv_usage_after"].append(llm_metric(llm, "vllm:kv_cache_usage_perc"))

    results = {"kv_usage_after": []}
    for action in actions:
        if action[0] == "gen":
            serve([action[1:]])
        elif action[0] == "batch":
            serve(action[1], _batch_opts(action).get("zero_blocks_of"))
        elif action[0] == "kill":
            os.kill(int(action[1]), signal.SIGKILL)
        else:
            raise ValueError(f"unknown action {action!r}")
    results["kvpp_workers"] = llm.collective_rpc("kvpp_stats")
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
