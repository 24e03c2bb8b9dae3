"""Talking to running vLLM servers over HTTP: completions, /metrics, and waiting on them (the engine tests
that drive servers: P/D, multi-host)."""

from __future__ import annotations

import json
import re
import time
import urllib.request

from deploy.harness.engines import engine_metrics, metric_total

MAX_TOKENS = 8


def post(url: str, body: dict, timeout: float = 180, headers: dict[str, str] | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def post_stream(url: str, body: dict, timeout: float = 180, headers: dict[str, str] | None = None) -> list[dict]:
    """A streamed POST's server-sent events (the JSON of each `data:` line) up to `[DONE]`."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            data = line.decode().strip()
            if not data.startswith("data:"):
                continue
            if data[5:].strip() == "[DONE]":
                return events
            events.append(json.loads(data[5:]))
    raise AssertionError(f"{url}: the stream ended without [DONE] after {len(events)} events")


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


def chat(url: str, model: str, content: str, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "logprobs": True, **extra}
    return post(f"{url}/v1/chat/completions", body)


def tokens_and_logprobs(resp: dict) -> tuple[list[str], list[float]]:
    """A completion's or a chat completion's generated tokens and their logprobs."""
    lp = resp["choices"][0]["logprobs"]
    if "content" in lp:  # chat
        return [t["token"] for t in lp["content"]], [t["logprob"] for t in lp["content"]]
    return lp["tokens"], lp["token_logprobs"]


def streamed_tokens_and_logprobs(events: list[dict]) -> tuple[list[str], list[float]]:
    """tokens_and_logprobs of a stream: its chunks' tokens and logprobs, in order."""
    tokens: list[str] = []
    logprobs: list[float] = []
    for event in events:
        for choice in event.get("choices", []):
            if choice.get("logprobs"):
                more = tokens_and_logprobs({"choices": [choice]})
                tokens += more[0]
                logprobs += more[1]
    return tokens, logprobs
