"""What the benches of served engines share: one api-server engine per KVPP mode, streamed greedy completions
timed by the client, and their latency percentiles."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp

from bench.anchor_table import MODES
from deploy.services.ports import free_port
from deploy.services.processes import LOOPBACK, REFERENCE, CpuEngine, Engine, cpu_instance, single_instance


def check_modes(ap: argparse.ArgumentParser, modes: list[str]) -> None:
    """Refuse a --modes list that does not start with KVPP off (every ratio is over it) or repeats a mode."""
    if modes[0] != "off" or not set(modes) <= set(MODES) or len(set(modes)) != len(modes):
        ap.error(f"--modes: off first, then any of {', '.join(MODES)} once each, got {','.join(modes)}")


def mode_server(name: str, model: str, log_dir: Path, kv_bytes: int, max_model_len: int, staging: int | None,
                engine: CpuEngine = REFERENCE, extra_args: Sequence[str] = (),
                env: Mapping[str, str] | None = None) -> Engine:
    """A TP2 server on cores 0 and 1 (`staging`: kvpp_staging_buffers, None: KVPP off), stats on, serving the
    model as "tiny"."""
    inst = cpu_instance(name, LOOPBACK, free_port(), 2, [0, 1], kv_cache_bytes=kv_bytes, max_model_len=max_model_len,
                        log_stats=True, env=env, engine=engine, enable_kvpp=staging is not None,
                        additional_config={} if staging is None else {"kvpp_staging_buffers": staging},
                        extra_args=["--served-model-name", "tiny", *extra_args])
    return Engine(single_instance(model, inst), log_dir / f"{name}.log")


def client_session() -> aiohttp.ClientSession:
    """A session for many concurrent long streams: no connection limit, a 30-minute bound per request."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800), connector=aiohttp.TCPConnector(limit=0))


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy completion of a token-id prompt: its text and token ids, the client-side arrival time
    of every chunk that carries tokens, and the prompt tokens the server found cached (None unless it runs with
    --enable-prompt-tokens-details)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    sent, arrivals, text, token_ids, cached = time.perf_counter(), [], [], [], None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in chunk["choices"]:
                if choice.get("token_ids"):
                    arrivals.append(time.perf_counter())
                    token_ids += choice["token_ids"]
                    text.append(choice["text"])
    return {"sent": sent, "arrivals": arrivals, "text": "".join(text), "token_ids": token_ids,
            "cached_tokens": cached}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latencies(answers: list[dict]) -> dict[str, float]:
    """TTFT and TPOT (the mean gap between a stream's later chunks) p50/p99 over streamed answers. An answer that
    arrived in one chunk (vLLM merges a stream's tokens when its client falls behind) has no TPOT: it is counted
    in `one_chunk_answers`, and the TPOT figures are NaN when every answer did."""
    ttft = [a["arrivals"][0] - a["sent"] for a in answers]
    tpot = [(a["arrivals"][-1] - a["arrivals"][0]) / (len(a["arrivals"]) - 1) for a in answers if len(a["arrivals"]) > 1]
    none = float("nan")
    return {"ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "tpot_p50_s": percentile(tpot, 0.5) if tpot else none, "tpot_p99_s": percentile(tpot, 0.99) if tpot else none,
            "one_chunk_answers": len(answers) - len(tpot)}
