"""MooncakeConnectorV2 pull throughput against the raw Mooncake transfer engine, and P/D TTFT.

Transport part (always): a stand-in prefill worker process (bench/mooncake_peer.py: real TE, the
connector's side channel) holds a long prompt's KV pages; this process pulls them
(a) through the connector's own pull path (Puller: metadata, read plan, coalescing, batch split),
(b) raw `batch_transfer_sync_read` calls moving the same bytes: one entry per layer region, the
same regions cut to the connector's entry size, and one entry per page, between the same two
processes and engines. Reported: seconds (median of --repeat), MB/s, and the connector's
throughput relative to the fastest raw variant (target >= 0.9).

Engine part (--engine; run the command under `flock /tmp/kvpp-engine.lock`): a prefill server (TP=2, KVPP on) and a
decode server (TP=1) joined by the connector plus `kvpp proxy`; TTFT of a streamed completion
through the proxy against the decode server serving the same prompt by itself (colocated), and
the connector's in-engine pull throughput from the decode's /metrics.

    .venv/bin/python bench/pd_transfer.py [--tokens 8192] [--repeat 5] [--engine]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as `python bench/pd_transfer.py` like the other benchmarks
from bench.mooncake_peer import BLOCK_SHAPE, TOKEN, local_meta, pages  # noqa: E402
from connectors.mooncake.messages import PrefillHandle  # noqa: E402
from connectors.mooncake.puller import Puller  # noqa: E402
from connectors.mooncake.transfer import Desc, MooncakeTransfer, cut_entries  # noqa: E402
from deploy.processes import free_port  # noqa: E402
LAYERS = 16
BLOCK_TOKENS = BLOCK_SHAPE[0]


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def transport(tokens: int, repeat: int) -> dict:
    blocks = -(-tokens // BLOCK_TOKENS)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "MC_LOG_LEVEL": "ERROR"}
    peer = subprocess.Popen([sys.executable, str(REPO / "bench" / "mooncake_peer.py"), "--port", str(port),
                             "--layers", str(LAYERS), "--blocks", str(blocks), "--seed", "11", "--hold", "bench"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready = json.loads(peer.stdout.readline())
        te = MooncakeTransfer("127.0.0.1", timeout_s=30)
        kv = torch.zeros((LAYERS, blocks, *BLOCK_SHAPE))
        te.register([(kv.data_ptr(), kv.numel() * kv.element_size())])
        puller = Puller(te, local_meta(kv, "bench-decode", 0, 1, te), mla=True, timeout_s=10,
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
        results = {}
        for name, ts in times.items():
            seconds = statistics.median(ts)
            results[name] = {"seconds": round(seconds, 5), "MBps": round(nbytes / seconds / 1e6, 1)}
        te.close()
        best_raw = min(results[k]["seconds"] for k in ("raw_per_layer", "raw_chunked", "raw_per_page"))
        return {
            "tokens": tokens, "layers": LAYERS, "pages_per_layer": blocks, "bytes": nbytes, "repeat": repeat,
            **results,
            # throughput ratio against the fastest raw way of moving the same bytes
            "ratio_connector_vs_best_raw": round(best_raw / results["connector"]["seconds"], 3),
            "target_ratio": 0.9,
        }
    finally:
        peer.stdin.close()
        try:
            peer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            peer.kill()


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _ttft(url: str, model: str, prompt: str, max_tokens: int = 4) -> float:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
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


def engine(words: int, repeat: int) -> dict:
    from bench.pd_servers import pd_server
    from deploy.processes import ManagedProcess, free_port_range, start_servers
    from deploy.proxy import start_proxy
    from deploy.tiny_model import build_tiny_model, sample_prompt

    tmp = Path(tempfile.mkdtemp(prefix="kvpp-pd-bench-"))
    model = str(build_tiny_model(tmp / "tiny16", layers=LAYERS))
    started: list[ManagedProcess] = []
    try:
        prefill = pd_server("prefill", model, tmp, tp=2, cores=[0, 1], role="kv_producer", kv_port=free_port_range(3),
                         extra_args=["--additional-config", json.dumps({"enable_kvpp": True})])
        decode = pd_server("decode", model, tmp, tp=1, cores=[1], role="kv_consumer", kv_port=free_port_range(2))
        start_servers((prefill, decode), started, timeout=400)
        proxy, proxy_url = start_proxy([prefill.url], [decode.url], tmp / "proxy.log")
        started.append(proxy)
        prompts = [sample_prompt(words, seed=100 + i) for i in range(repeat)]
        _ttft(decode.url, model, sample_prompt(words, seed=99))  # warm both paths
        _ttft(proxy_url, model, sample_prompt(words, seed=98))
        before = {k: _metric(decode.url, f"vllm:mooncake_v2_{k}") for k in ("pulled_bytes_total", "transfer_seconds_total")}
        pd = [_ttft(proxy_url, model, p) for p in prompts]
        time.sleep(12)  # the stats logger flushes connector counters every ~10 s
        moved = {k: _metric(decode.url, f"vllm:mooncake_v2_{k}") - v for k, v in before.items()}
        colocated = [_ttft(decode.url, model, p) for p in prompts]
        return {
            "prompt_tokens": words, "requests": repeat,
            "ttft_pd_proxy_s": round(statistics.median(pd), 4),
            "ttft_colocated_s": round(statistics.median(colocated), 4),
            "ttft_ratio_pd_vs_colocated": round(statistics.median(pd) / statistics.median(colocated), 3),
            "in_engine_pulled_bytes": int(moved["pulled_bytes_total"]),
            "in_engine_transfer_seconds": round(moved["transfer_seconds_total"], 4),
            "in_engine_pull_MBps": round(moved["pulled_bytes_total"] / moved["transfer_seconds_total"] / 1e6, 1)
            if moved["transfer_seconds_total"] else None,
        }
    finally:
        for proc in reversed(started):
            proc.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length of the transport comparison")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--engine", action="store_true", help="also measure TTFT through real servers and the proxy")
    ap.add_argument("--engine-words", type=int, default=1500, help="prompt length (tokens) of the engine part")
    args = ap.parse_args()
    out = {"transport": transport(args.tokens, args.repeat)}
    if args.engine:
        out["engine"] = engine(args.engine_words, args.repeat)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
