"""Plain vLLM (no KVPP plugin, no connector) serving the tiny model over HTTP, started once for every test
that needs its answers (tests/conftest.py: plain_tiny_answers)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from deploy.harness.tiny_model import sample_prompt
from deploy.services.ports import free_port
from deploy.services.processes import VllmServer

TEXT_PROMPTS = (sample_prompt(5, seed=1), sample_prompt(70, seed=2))  # one block; several blocks
TEXT_MAX_TOKENS = 8


def complete(url: str, prompt: str | list[int], max_tokens: int) -> dict:
    """One greedy completion's choice, with its token ids and logprobs."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 1, "return_token_ids": True, "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]


def serve_plain(model: str, log: Path, token_prompts: dict[str, list[int]], max_tokens: int) -> dict:
    """TEXT_PROMPTS' choices under "text"; each of `token_prompts` alone under "tokens", as
    {"tokens", "logprobs"} (the shape of testbed/script.py's answers). The server is stopped
    before this returns."""
    server = VllmServer("vllm-tiny", model, free_port(), log, tp=1,
                        extra_args=["--served-model-name", "tiny", "--max-logprobs", "1"],
                        # Plain vLLM: the reference for transformers and for the plugin's engines alike.
                        env={"VLLM_PLUGINS": ""})
    with server:
        server.wait_ready(timeout=600)
        text = [complete(server.url, p, TEXT_MAX_TOKENS) for p in TEXT_PROMPTS]
        tokens = {}
        for name, ids in token_prompts.items():
            choice = complete(server.url, ids, max_tokens)
            tokens[name] = {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}
    return {"text": text, "tokens": tokens}
