"""Run one real vLLM engine over a fixed workload and print tokens, logprobs and KVPP reports as JSON.

Tests compare two runs of this script (KVPP off and on) in separate processes, since one process
can host only one vLLM engine configuration. Requests arrive in two waves so that later steps mix
fresh prefills with decodes that need history (the steps where KVPP broadcasts). With --references the
same engine then answers further prompts, each alone and after the KVPP reports were taken: the
reference answers another test needs from an engine of this shape, without starting one more.

With --worker-extension CLS every worker imports CLS (vLLM's `worker_extension_cls`): a test's patches in
the worker processes, e.g. a negative control's (tests/helpers/early_reader.py).

With --load the same engine then serves a capacity load: every prompt of that file submitted at once,
with vLLM's own scheduler metrics (running requests, KV cache usage, preemptions; `LLM.get_metrics()`)
read after every step, so a test sees how many ran together and how many blocks they held. With
--corrupt-above N the load is served a second time while every worker zeroes each KV block numbered N
or higher after every step: the negative control of a capacity test (answers that depended on blocks
past N must change).

Tests and benchmarks call `run()` (which starts this file in a process group of its own) and
`write_prompts()`, and compare two runs with `assert_same_outputs()`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

RESULT_PREFIX = "KVPP_RESULT "


def token_draws(model: str, seed: int) -> Callable[[int], list[int]]:
    """`draw(n)`: the next n token ids of one seeded stream over the model's vocabulary (ids 5 and up:
    never a special token), so a test's prompts are the same in every process that draws them."""
    rng = random.Random(seed)
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    return lambda n: [rng.randrange(5, vocab) for _ in range(n)]


def write_prompts(path: Path, model: str, lengths: Sequence[int], seed: int = 0) -> Path:
    """Random token-id prompts of the given lengths, drawn from the model's vocabulary."""
    draw = token_draws(model, seed)
    path.write_text(json.dumps([draw(n) for n in lengths]))
    return path


def run(model: str, prompts: Path, *args: str, env: Mapping[str, str] | None = None, timeout: float = 900) -> dict:
    """One engine run of this script; its result, or RuntimeError with the end of its output."""
    from deploy.services.processes import run_in_group

    workers = 1
    for flag in ("--tp", "--pp"):
        if flag in args:
            workers *= int(args[args.index(flag) + 1])
    # One OpenMP core per worker, the TP ranks of a stage on different cores (PP stages take turns).
    bind = "|".join(str(i % 2) for i in range(workers))
    full_env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": bind, **(env or {})}
    proc = run_in_group([sys.executable, __file__, "--model", model, "--prompts", str(prompts), *args],
                        timeout=timeout, env=full_env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line.removeprefix(RESULT_PREFIX))
    raise RuntimeError(f"engine run {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
                       f"\n{proc.stdout[-4000:]}")


def assert_same_outputs(ref: dict, got: dict, num_prompts: int, max_tokens: int, logprob_tol: float = 1e-5) -> None:
    """Two runs answered every prompt with the same tokens, and logprobs equal within `logprob_tol` (fp32)."""
    assert sorted(ref["outputs"]) == sorted(got["outputs"]) == sorted(str(i) for i in range(num_prompts))
    for req, want in ref["outputs"].items():
        have = got["outputs"][req]
        assert len(want["token_ids"]) == max_tokens
        assert have["token_ids"] == want["token_ids"], f"request {req}"
        worst = max(abs(a - b) for a, b in zip(have["logprobs"], want["logprobs"]))
        assert worst <= logprob_tol, f"request {req}: logprobs differ by {worst}"


class BlockZeroing:
    """Worker extension (vLLM's `worker_extension_cls`, set only for a negative control): methods that
    `collective_rpc` calls by name, so no code object crosses vLLM's IPC."""

    def zero_blocks_from(self, first: int) -> None:
        """Zero blocks `first`.. of every KV cache this worker bound."""
        for cache in self.model_runner.kv_caches:
            cache[first:].zero_()

    def zero_blocks(self, ids: list[int]) -> None:
        """Zero blocks `ids` of every KV cache this worker bound."""
        for cache in self.model_runner.kv_caches:
            cache[ids] = 0


def kvpp_config(kvpp: bool, staging: int | None) -> dict:
    """The engine's additional_config for --kvpp and --staging (None: the default staging buffers)."""
    if not kvpp:
        return {}
    return {"enable_kvpp": True} if staging is None else {"enable_kvpp": True, "kvpp_staging_buffers": staging}


def llm_metric(llm, name: str) -> float:
    """One of vLLM's own metrics of an offline engine, summed over its label sets."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def serve_load(llm, prompts: list[list[int]], params, tag: str, corrupt_above: int | None = None) -> dict:
    """Every prompt submitted at once, stepped to the end; outputs plus the peaks of vLLM's own gauges
    and the preemptions its counter added meanwhile."""
    engine = llm.llm_engine
    preempted_before = llm_metric(llm, "vllm:num_preemptions")
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": ids}, params)
    outputs, peak_running, peak_usage = {}, 0.0, 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                comp = out.outputs[0]
                outputs[out.request_id.removeprefix(tag)] = {
                    "token_ids": list(comp.token_ids),
                    "logprobs": [lp[tok].logprob for tok, lp in zip(comp.token_ids, comp.logprobs)],
                }
        if corrupt_above is not None:
            llm.collective_rpc("zero_blocks_from", args=(corrupt_above,))
        peak_running = max(peak_running, llm_metric(llm, "vllm:num_requests_running"))
        peak_usage = max(peak_usage, llm_metric(llm, "vllm:kv_cache_usage_perc"))
    return {"outputs": outputs, "peak_running": peak_running, "peak_kv_usage": peak_usage,
            "preemptions": llm_metric(llm, "vllm:num_preemptions") - preempted_before}


def logprob_agreement(ref: dict, got: dict) -> dict:
    """How closely two runs' logprobs agree: how many are bit-identical out of all, and the largest gap."""
    pairs = [(a, b) for req, want in ref["outputs"].items()
             for a, b in zip(want["logprobs"], got["outputs"][req]["logprobs"])]
    return {"bit_identical": sum(a == b for a, b in pairs), "total": len(pairs),
            "max_abs_diff": max((abs(a - b) for a, b in pairs), default=0.0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1, help="PP stages (the split: VLLM_PP_LAYER_PARTITION)")
    ap.add_argument("--compiled", action="store_true", help="torch.compile instead of --enforce-eager")
    ap.add_argument("--mtp", type=int, default=0, help="MTP speculative tokens (the model needs MTP layers)")
    ap.add_argument("--kvpp", action="store_true")
    ap.add_argument("--staging", type=int, default=None)
    ap.add_argument("--kv-bytes", type=int, default=64 << 20)
    ap.add_argument("--prompts", required=True, help="JSON file: list of lists of token ids")
    ap.add_argument("--first-wave", type=int, default=2, help="prompts submitted before the first step")
    ap.add_argument("--steps-between-waves", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--references", help="JSON file: {name: token ids}, each served alone after the workload")
    ap.add_argument("--reference-max-tokens", type=int, default=8)
    ap.add_argument("--load", help="JSON file: list of token-id prompts, all submitted at once after the workload")
    ap.add_argument("--load-max-tokens", type=int, default=8)
    ap.add_argument("--corrupt-above", type=int, help="serve --load again, zeroing KV blocks >= this after each step")
    ap.add_argument("--worker-extension", default="",
                    help="a worker_extension_cls (qualified name) every worker imports: a test's patches there")
    args = ap.parse_args()
    if args.worker_extension and args.corrupt_above is not None:
        ap.error("--worker-extension and --corrupt-above each set the worker extension; pass one of them")

    # The engine core in this process: one Python start-up (~20 s here) less per run, and the step at which
    # the second wave joins no longer depends on wall-clock time, so runs that step at different speeds
    # (KVPP off and on) batch alike. With TP or PP > 1 the workers are still processes of their own.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from deploy.services.processes import reference_engine

    llm = LLM(
        model=args.model,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        distributed_executor_backend="mp",
        **reference_engine(args.mtp),
        enforce_eager=not args.compiled,
        kv_cache_memory_bytes=args.kv_bytes,
        additional_config=kvpp_config(args.kvpp, args.staging),
        max_model_len=1024,
        seed=0,
        disable_log_stats=False,  # the scheduler's gauges and counters, read by --load
        worker_extension_cls=("deploy.harness.engine_run.BlockZeroing" if args.corrupt_above is not None
                              else args.worker_extension),
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
    references = {}
    if args.references:
        with open(args.references) as f:
            wanted = json.load(f)
        ref_params = SamplingParams(temperature=0.0, max_tokens=args.reference_max_tokens, logprobs=1, ignore_eos=True)
        for name, ids in wanted.items():
            (out,) = llm.generate([{"prompt_token_ids": ids}], ref_params, use_tqdm=False)
            comp = out.outputs[0]
            references[name] = {"tokens": list(comp.token_ids),
                                "logprobs": [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]}
    load = {}
    if args.load:
        with open(args.load) as f:
            load_prompts = json.load(f)
        load_params = SamplingParams(temperature=0.0, max_tokens=args.load_max_tokens, logprobs=1, ignore_eos=True)
        load["clean"] = serve_load(llm, load_prompts, load_params, "load-")
        if args.corrupt_above is not None:
            load["corrupted"] = serve_load(llm, load_prompts, load_params, "corrupt-", args.corrupt_above)
    print(RESULT_PREFIX + json.dumps({"outputs": outputs, "workers": reports, "step_seconds": step_seconds,
                                      "references": references, "load": load}), flush=True)


if __name__ == "__main__":
    main()
