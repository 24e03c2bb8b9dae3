"""MooncakeConnectorV2 pull throughput against the raw Mooncake transfer engine, and P/D TTFT.

Transport part (always): a stand-in prefill worker process (testbed/mooncake_peer.py: real TE, the
connector's side channel) holds a long prompt's KV pages; this process pulls them
(a) through the connector's own pull path (Puller: metadata, read plan, coalescing, batch split),
(b) raw `batch_transfer_sync_read` calls moving the same bytes: one entry per layer region, the
same regions cut to the connector's entry size, and one entry per page, between the same two
processes and engines, the four interleaved in each of --repeat rounds. Reported: seconds and MB/s
as min/median/max over the rounds, and the connector's throughput relative to the fastest raw variant
of the same round (target: median >= 0.9).

Engine part (--engine; run the command under `flock /tmp/kvpp-engine.lock`): the raw transfer time
of each prompt length's bytes (as above, before any engine runs), then a prefill server (TP=2,
KVPP on) and a decode server (TP=1) joined by the connector. Per prompt length (--lengths) and at
concurrency 1 and 4: the decode leg's TTFT for prompts whose KV arrives by transfer (prefill leg
driven by hand, as the proxy does) next to the decode computing the same prompts itself and the raw
transfer time, the target (local + raw + 30 ms, at concurrency 1) and the decode's per-phase means
from its /metrics. Then vLLM's serving benchmark (vllm.benchmarks.serve, random dataset, 256-token
prompts, 4 concurrent clients) through `kvpp proxy` and against the decode server alone (colocated).
--readers runs the engine part once per shared-memory reader mode of vLLM on CPU: `spin` (vLLM's
own, `KVPP_SHM_READERS_SPIN=1`) and `poll` (the connectors' default there), for before/after in one run.

    .venv/bin/python -m bench.pd_transfer [--tokens 8192] [--repeat 5] [--engine] [--lengths 256,1024,4096]
        [--readers spin,poll] [--out bench/results/pd_transfer.json]
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.summary import host, spread
from connectors.mooncake.messages import PrefillHandle
from connectors.mooncake.puller import Puller
from connectors.mooncake.transfer import Desc, MooncakeTransfer, cut_entries
from deploy.services.ports import free_port
from testbed.mooncake_peer import BLOCK_SHAPE, TOKEN, PeerJob, local_meta, pages, start as start_peer, stop as stop_peer

LAYERS = 16
BLOCK_TOKENS = BLOCK_SHAPE[0]
RAW = ("raw_per_layer", "raw_chunked", "raw_per_page")
TARGET_RATIO = 0.9


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def transport(tokens: int, repeat: int) -> dict:
    blocks = -(-tokens // BLOCK_TOKENS)
    port = free_port()
    peer = start_peer(PeerJob(port=port, layers=LAYERS, blocks=blocks, seed=11, holds={"bench": TOKEN}))
    try:
        ready = json.loads(peer.stdout.readline())
        te = MooncakeTransfer("127.0.0.1")
        kv = torch.zeros((LAYERS, blocks, *BLOCK_SHAPE))
        te.register([(kv.data_ptr(), kv.numel() * kv.element_size())])
        puller = Puller(te, local_meta(kv, "bench-decode", 0, 1, te), timeout_s=10,
                        consumer_id="bench/pp0/tp0", num_consumers=1)
        handle = PrefillHandle(remote_engine_id="peer", remote_request_id="bench", remote_token=TOKEN,
                               remote_host="127.0.0.1",
                               remote_kv_port=port, remote_tp_size=1, remote_block_ids=list(range(blocks)),
                               remote_num_tokens=tokens)
        ids = list(range(blocks))
        metas = puller.peer_metas(handle)  # first handshake outside the timing, as in steady state
        remote = {layer.name: layer for layer in metas[0].layers}
        page = remote[next(iter(remote))].block_len
        nbytes = LAYERS * blocks * page

        def connector():
            puller.read(handle, ids, ids)

        def raw(shape: str):
            descs = []
            for name, mine in puller.local_layers.items():
                theirs = remote[name]
                if shape == "page":
                    descs += [Desc(mine.base_addr + b * page, theirs.base_addr + b * page, page) for b in ids]
                else:
                    descs.append(Desc(mine.base_addr, theirs.base_addr, blocks * page))
            if shape == "chunk":
                descs = cut_entries(descs, te.max_entry_bytes)
            for i in range(0, len(descs), 1024):
                batch = descs[i:i + 1024]
                rc = te._engine.batch_transfer_sync_read(ready["te"], [d.local for d in batch],
                                                         [d.remote for d in batch], [d.length for d in batch])
                if rc != 0:
                    raise RuntimeError(f"raw batch_transfer_sync_read returned {rc}")

        connector()
        if not torch.equal(kv, pages(LAYERS, blocks, 11)):
            raise RuntimeError("connector pull did not reproduce the peer's pages")
        variants = {"connector": connector, "raw_per_layer": lambda: raw("layer"),
                    "raw_chunked": lambda: raw("chunk"), "raw_per_page": lambda: raw("page")}
        for fn in variants.values():
            fn()  # warm every path once
        # Interleaved rounds, so load from other processes on the host hits every variant alike.
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeat):
            for name, fn in variants.items():
                times[name].append(_seconds(fn))
        te.close()
        # Throughput against the fastest raw way of moving the same bytes, within each round (the
        # variants next to each other), so a slow round of the shared host slows both sides alike.
        ratios = [min(times[k][r] for k in RAW) / times["connector"][r] for r in range(repeat)]
        ratio = spread(ratios)
        return {
            "tokens": tokens, "layers": LAYERS, "pages_per_layer": blocks, "bytes": nbytes, "repeat": repeat,
            **{name: {"seconds": spread(ts), "MBps": spread(nbytes / t / 1e6 for t in ts)}
               for name, ts in times.items()},
            "ratio_connector_vs_best_raw": ratio,
            "target_ratio": TARGET_RATIO, "meets_target": ratio["median"] >= TARGET_RATIO,
        }
    finally:
        stop_peer(peer)


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _ttft(url: str, model: str, prompt: str, max_tokens: int = 4, **extra) -> float:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, **extra}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data:") and b'"text"' in line:
                first = time.perf_counter() - start
                for _ in resp:
                    pass
                return first
    raise RuntimeError(f"no streamed token from {url}")


def _pd_legs(prefill_url: str, decode_url: str, model: str, prompt: str) -> tuple[float, float]:
    """(prefill leg seconds, decode leg TTFT) of one request driven by hand, as the proxy does."""
    start = time.perf_counter()
    params = _post(f"{prefill_url}/v1/completions",
                   {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]
    prefill_s = time.perf_counter() - start
    return prefill_s, _ttft(decode_url, model, prompt, kv_transfer_params=params)


def _together(fn, args_list: list[tuple]) -> list:
    """Run fn(*args) for every args tuple at once (one thread each); results in order."""
    with ThreadPoolExecutor(max_workers=len(args_list)) as pool:
        return list(pool.map(lambda args: fn(*args), args_list))


def _phase_counters(url: str) -> dict[str, float]:
    from connectors.mooncake.stats import PHASES

    out = {}
    for phase in PHASES:
        out[f"{phase}_s"] = _metric(url, f"vllm:mooncake_v2_{phase}_seconds_total")
        out[f"{phase}_n"] = _metric(url, f"vllm:mooncake_v2_{phase}_requests_total")
    out["read_s"] = _metric(url, "vllm:mooncake_v2_transfer_seconds_total")
    out["read_n"] = _metric(url, "vllm:mooncake_v2_pulls_total")
    return out


def _phase_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    phases = sorted({key[:-2] for key in after})
    return {f"{p}_ms": round(1000 * (after[f"{p}_s"] - before[f"{p}_s"]) / (after[f"{p}_n"] - before[f"{p}_n"]), 2)
            for p in phases if after[f"{p}_n"] > before[f"{p}_n"]}


STATS_FLUSH_S = 11  # vLLM's stats logger pushes connector counters to /metrics about every 10 s


def ttft_table(prefill_url: str, decode_url: str, model: str, lengths: list[int], repeat: int,
               concurrency: int, raw_s: dict[int, float]) -> list[dict]:
    """Per prompt length: decode-leg TTFT of transferred prompts against the decode computing the
    same prompts itself and the raw transfer time of their bytes, plus the decode's phase means."""
    from deploy.harness.tiny_model import sample_prompt

    rows = []
    for tokens in lengths:
        local, legs = [], []
        before = _phase_counters(decode_url)
        for r in range(repeat):
            prompts = [sample_prompt(tokens, seed=1000 * tokens + 10 * r + c) for c in range(concurrency)]
            local += _together(lambda p: _ttft(decode_url, model, p), [(p,) for p in prompts])
            legs += _together(lambda p: _pd_legs(prefill_url, decode_url, model, p), [(p,) for p in prompts])
            print(f"# c={concurrency} {tokens} tokens: round {r + 1}/{repeat}", file=sys.stderr, flush=True)
        time.sleep(STATS_FLUSH_S)
        phases = _phase_means_ms(before, _phase_counters(decode_url))
        decode_ttft = statistics.median(d for _, d in legs)
        local_ttft = statistics.median(local)
        budget = local_ttft + raw_s[tokens] + 0.030
        rows.append({
            "concurrency": concurrency, "prompt_tokens": tokens, "requests": len(legs),
            "decode_leg_ttft_s": round(decode_ttft, 4),
            "decode_leg_ttft_max_s": round(max(d for _, d in legs), 4),
            "local_compute_ttft_s": round(local_ttft, 4),
            "raw_transfer_s": round(raw_s[tokens], 4),
            "prefill_leg_s": round(statistics.median(p for p, _ in legs), 4),
            "target_s": round(budget, 4),
            "meets_target": decode_ttft <= budget if concurrency == 1 else None,
            "decode_phases_ms": phases,
        })
    return rows


def serving_benchmark(url: str, model: str, label: str, out_dir: Path, input_len: int, num_prompts: int,
                      concurrency: int, seed: int = 7) -> dict:
    """vLLM's own serving benchmark (vllm.benchmarks.serve, random dataset) against one endpoint; another
    `seed` draws other prompts (none shares a prefix with an earlier run's)."""
    result = out_dir / f"serve-{label}.json"
    runner = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "from vllm.benchmarks.serve import add_cli_args, main; "
              "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
    argv = [sys.executable, "-c", runner, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", "16", "--ignore-eos", "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--seed", str(seed), "--save-result",
            "--result-dir", str(out_dir), "--result-filename", result.name, "--label", label]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, timeout=1200)
    data = json.loads(result.read_text())
    keys = ("completed", "failed", "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "median_e2el_ms")
    return {key: round(data[key], 2) if isinstance(data.get(key), float) else data.get(key) for key in keys}


def engine(lengths: list[int], repeat: int, serve_prompts: int, raw_s: dict[int, float], readers: str) -> dict:
    from testbed.pd_servers import pd_server
    from deploy.services.ports import free_port_range
    from deploy.services.processes import ManagedProcess, start_servers
    from deploy.services.proxy import start_proxy
    from deploy.harness.tiny_model import build_tiny_model, sample_prompt

    from kvpp_core.vllm_adapter import SPINNING_READERS_ENV

    env = {SPINNING_READERS_ENV: "1" if readers == "spin" else "0"}
    tmp = Path(tempfile.mkdtemp(prefix="kvpp-pd-bench-"))
    model = str(build_tiny_model(tmp / "tiny16", layers=LAYERS))
    server = {"kv_cache_bytes": 1 << 30, "max_model_len": max(lengths) + 64}
    started: list[ManagedProcess] = []
    try:
        prefill = pd_server("prefill", model, tmp, tp=2, cores=[0, 1], role="kv_producer", kv_port=free_port_range(3),
                            server={**server, "enable_kvpp": True, "additional_config": {"kvpp_staging_buffers": 2}},
                            env=env)
        decode = pd_server("decode", model, tmp, tp=1, cores=[1], role="kv_consumer", kv_port=free_port_range(2),
                           server=server, env=env)
        start_servers((prefill, decode), started, timeout=400)
        proxy, proxy_url = start_proxy([prefill.url], [decode.url], tmp / "proxy.log")
        started.append(proxy)
        _ttft(decode.url, model, sample_prompt(64, seed=99))  # warm both paths
        _pd_legs(prefill.url, decode.url, model, sample_prompt(64, seed=98))
        out: dict = {"readers": readers, "ttft": []}
        for concurrency in (1, 4):
            out["ttft"] += ttft_table(prefill.url, decode.url, model, lengths, repeat, concurrency, raw_s)
        if serve_prompts:
            print("# vllm.benchmarks.serve through kvpp proxy and against the colocated decode", file=sys.stderr,
                  flush=True)
            out["serving_benchmark"] = {
                "input_len": 256, "num_prompts": serve_prompts, "max_concurrency": 4,
                "pd_proxy": serving_benchmark(proxy_url, model, "pd-proxy", tmp, 256, serve_prompts, 4),
                "colocated": serving_benchmark(decode.url, model, "colocated", tmp, 256, serve_prompts, 4),
            }
        return out
    finally:
        for proc in reversed(started):
            proc.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length of the transport comparison")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--engine", action="store_true", help="also measure TTFT with real servers and the proxy")
    ap.add_argument("--lengths", default="256,1024,4096", help="prompt lengths (tokens) of the engine part")
    ap.add_argument("--serve-prompts", type=int, default=32,
                    help="requests of vLLM's serving benchmark per endpoint (0: skip it)")
    ap.add_argument("--readers", default="poll", help="comma-separated vLLM shm reader modes of the engine part: "
                    "spin (vLLM's) and/or poll (the connectors' default on CPU)")
    ap.add_argument("--out", help="also write the JSON, with this command, to this file "
                    "(bench/results/pd_transfer.json for the transport part)")
    ap.add_argument("--note", default="", help="what the results file says about the host (e.g. shared)")
    args = ap.parse_args()
    if args.repeat < 3:
        ap.error("--repeat: at least 3 (min/median/max need them)")
    readers = args.readers.split(",")
    if not set(readers) <= {"spin", "poll"}:
        ap.error(f"--readers takes spin and/or poll, not {args.readers!r}")
    out = {"transport": transport(args.tokens, args.repeat)}
    if args.engine:
        lengths = [int(x) for x in args.lengths.split(",")]
        # Raw transfer time of each length's bytes, between two processes, before any engine competes.
        raw_s = {tokens: min(transport(tokens, args.repeat)[k]["seconds"]["median"] for k in RAW)
                 for tokens in lengths}
        out["raw_transfer_s"] = {str(k): round(v, 5) for k, v in raw_s.items()}
        out["engine"] = [engine(lengths, args.repeat, args.serve_prompts, raw_s, mode) for mode in readers]
    if args.out:
        command = "python -m bench.pd_transfer " + shlex.join(sys.argv[1:])
        Path(args.out).write_text(json.dumps({"command": command, "host": host(args.note), **out}, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
