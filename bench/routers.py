"""The P/D fronts at the same load: `kvpp proxy` against vllm-router (the vLLM project's Rust router, its
vLLM P/D mode), both in front of one prefill (TP=2, KVPP) and one decode (TP=1) joined by
MooncakeConnectorV2, with the decode serving alone (colocated) as the baseline.

vLLM's serving benchmark (vllm.benchmarks.serve, random dataset, --input-len-token prompts, 16 output
tokens, --prompts requests, --concurrency clients) runs once per endpoint per round, --repeat rounds, the
order of the endpoints rotating each round; every run draws its own prompts (its own seed), so no run
finds another's prefixes cached. Reported per endpoint: completed and failed requests, request
throughput, median and p99 TTFT, as min/median/max over the rounds. Run it under the engine lock:

    flock /tmp/kvpp-engine.lock .venv/bin/python -m bench.routers [--repeat 3] [--prompts 16]

It writes bench/results/routers.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.pd_transfer import serving_benchmark
from deploy.harness.routers import start_vllm_router
from deploy.harness.tiny_model import build_tiny_model
from deploy.services.ports import free_port_range
from deploy.services.processes import ManagedProcess, start_servers
from deploy.services.proxy import start_proxy
from testbed.pd_servers import pd_server

RESULTS = Path(__file__).resolve().parent / "results" / "routers.json"
KEYS = ("completed", "failed", "request_throughput", "median_ttft_ms", "p99_ttft_ms")


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run(repeat: int, prompts: int, input_len: int, concurrency: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="kvpp-routers-bench-"))
    model = str(build_tiny_model(tmp / "tiny16", layers=16))
    server = {"kv_cache_bytes": 256 << 20, "max_model_len": 1024}
    started: list[ManagedProcess] = []
    try:
        prefill = pd_server("prefill", model, tmp, tp=2, cores=[0, 1], role="kv_producer", kv_port=free_port_range(3),
                            server={**server, "enable_kvpp": True, "additional_config": {"kvpp_staging_buffers": 2}})
        decode = pd_server("decode", model, tmp, tp=1, cores=[1], role="kv_consumer", kv_port=free_port_range(2),
                           server=server)
        start_servers((prefill, decode), started, timeout=400)
        proxy, proxy_url = start_proxy([prefill.url], [decode.url], tmp / "proxy.log")
        started.append(proxy)
        router, router_url, _ = start_vllm_router([prefill.url], [decode.url], tmp / "vllm-router.log")
        started.append(router)
        endpoints = {"kvpp-proxy": proxy_url, "vllm-router": router_url, "colocated": decode.url}
        names = list(endpoints)
        runs: dict[str, list[dict]] = {name: [] for name in names}
        seed = 100
        for name in names:  # warm-up, not reported
            serving_benchmark(endpoints[name], model, f"warm-{name}", tmp, input_len, concurrency, concurrency, seed)
            seed += 1
        for r in range(repeat):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                print(f"# round {r + 1}/{repeat}: {name}", file=sys.stderr, flush=True)
                runs[name].append(serving_benchmark(endpoints[name], model, f"{name}-{r}", tmp, input_len, prompts,
                                                    concurrency, seed))
                seed += 1
        summary = {name: {"completed": sum(x["completed"] for x in rs), "failed": sum(x["failed"] for x in rs),
                          **{key: _spread([x[key] for x in rs]) for key in KEYS[2:]}}
                   for name, rs in runs.items()}
        return {"setup": {"prefill": "TP=2, KVPP, MooncakeConnectorV2 kv_producer", "decode": "TP=1, kv_consumer",
                          "model": "tiny 16-layer MLA, fp32", "input_len": input_len, "output_len": 16,
                          "prompts_per_run": prompts, "concurrency": concurrency, "repeat": repeat,
                          "vllm_router": "vllm-router 0.1.17 --vllm-pd-disaggregation (defaults otherwise)"},
                "summary": summary, "runs": runs}
    finally:
        for proc in reversed(started):
            proc.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16, help="requests per run")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    out = run(args.repeat, args.prompts, args.input_len, args.concurrency)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
