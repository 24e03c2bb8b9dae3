"""Talking to running vLLM servers over HTTP: completions, /metrics, and waiting on them (the engine tests
that drive servers: P/D, multi-host)."""

from __future__ import annotations

import json
import re
import time
import urllib.request

from deploy.harness.engines import engine_metrics, metric_total

MAX_TOKENS = 8


def post(url: str, body: dict, timeout: float = 180) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def metric(base_url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples (all label sets) on a server's /metrics; a metric the server
    does not export fails the test instead of reading as 0."""
    text = engine_metrics(base_url)
    if not re.search(rf"^{re.escape(name)}[{{ ]", text, re.M):
        raise AssertionError(f"{name} not on {base_url}/metrics")
    return metric_total(text, name)


def wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not within {timeout}s")
        time.sleep(0.25)
    return time.monotonic() - start


def completion(url: str, model: str, prompt: str, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1, **extra}
    return post(f"{url}/v1/completions", body)


def tokens_and_logprobs(resp: dict) -> tuple[list[str], list[float]]:
    lp = resp["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]
