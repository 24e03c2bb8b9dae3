"""The tiny model served by vLLM (CPU, fp32) gives the same greedy tokens and logprobs as transformers.

This is what makes the tiny model a valid oracle for every KVPP/P-D equality test: if vLLM already
disagreed with the reference implementation, later comparisons would prove nothing.
"""

import math

import pytest

from tests.helpers.plain_tiny import TEXT_MAX_TOKENS as MAX_TOKENS, TEXT_PROMPTS

pytestmark = pytest.mark.engine

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


def test_vllm_matches_transformers_greedy(tiny_model, plain_tiny_answers):
    """The session's plain vLLM server (no KVPP plugin) of the 16-layer model every equality test relies on."""
    from transformers import AutoTokenizer

    path = tiny_model
    tok = AutoTokenizer.from_pretrained(str(path))
    worst = 0.0
    for prompt, choice in zip(TEXT_PROMPTS, plain_tiny_answers["text"]):
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
