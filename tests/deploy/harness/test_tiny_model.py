"""The tiny model served by vLLM (CPU, fp32) gives the same greedy tokens and logprobs as transformers.

This is what makes the tiny model a valid oracle for every KVPP/P-D equality test: if vLLM already
disagreed with the reference implementation, later comparisons would prove nothing.
"""

import json
import math
import urllib.request

import pytest

from deploy.services.processes import VllmServer, free_port
from deploy.harness.tiny_model import sample_prompt

pytestmark = pytest.mark.engine

MAX_TOKENS = 8
# fp32 on both sides; the brief measured exact equality, allow only float reassociation noise.
LOGPROB_TOL = 1e-4


def _hf_greedy(path, prompt_ids, steps):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids, tokens, logprobs = list(prompt_ids), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            lp = torch.log_softmax(logits.double(), dim=-1)
            tok = int(torch.argmax(logits))
            tokens.append(tok)
            logprobs.append(float(lp[tok]))
            ids.append(tok)
    return tokens, logprobs


def _complete(url, prompt):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "logprobs": 1, "return_token_ids": True, "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())["choices"][0]


def test_vllm_matches_transformers_greedy(tiny_model, tmp_path_factory):
    from transformers import AutoTokenizer

    path = tiny_model  # 16 layers (conftest), the model every equality test relies on
    prompts = [sample_prompt(5, seed=1), sample_prompt(70, seed=2)]  # one block; several blocks
    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    server = VllmServer("vllm-tiny", path, free_port(), log, tp=1,
                        extra_args=["--served-model-name", "tiny", "--max-logprobs", "1"],
                        # Plain vLLM: this checks the model against transformers, not the KVPP plugin.
                        env={"VLLM_PLUGINS": ""})
    with server:
        server.wait_ready(timeout=600)
        choices = [_complete(server.url, p) for p in prompts]
    tok = AutoTokenizer.from_pretrained(str(path))
    worst = 0.0
    for prompt, choice in zip(prompts, choices):
        prompt_ids = tok(prompt)["input_ids"]
        assert choice["prompt_token_ids"] == prompt_ids
        hf_tokens, hf_logprobs = _hf_greedy(path, prompt_ids, MAX_TOKENS)
        assert choice["token_ids"] == hf_tokens
        vllm_logprobs = choice["logprobs"]["token_logprobs"]
        worst = max(worst, *(abs(a - b) for a, b in zip(vllm_logprobs, hf_logprobs)))
        assert all(math.isfinite(x) for x in vllm_logprobs)
        # The server detokenizes with the local tokenizer.
        assert choice["text"].split() == tok.decode(hf_tokens).split()
    print(f"max |logprob(vLLM) - logprob(HF)| = {worst:.3e}")
    assert worst <= LOGPROB_TOL
