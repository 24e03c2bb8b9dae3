"""A request's pool block hashes with the tenant extras vLLM's prefix-cache hasher adds (LoRA, images,
cache salt, prompt embeddings): they share exactly when vLLM's prefix cache would."""

from __future__ import annotations

import pytest

from connectors.store.keys import block_hashes

pytestmark = pytest.mark.unit


def _request(req_id="r", tokens=None, **kw):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    if "prompt_embeds" in kw:
        tokens = None
    elif tokens is None:
        tokens = list(range(100, 150))  # 3 whole blocks + 2 tokens
    return Request(req_id, tokens, SamplingParams(max_tokens=1), None, **kw)


def _image(identifier="img1", offset=3, length=20):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return [MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                  mm_position=PlaceholderRange(offset=offset, length=length))]


def _lora(name="tenant-a", path="/adapters/a"):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, 1, path)


def _embeds(value=1.0):
    import torch

    return torch.full((50, 8), value)


def _pool_hashes(request):
    from connectors.store.request_keys import prompt_blocks

    return prompt_blocks(request, 16).hashes


def test_vllm_extra_key_shapes():
    """The child processes of test_keys.py hash tuples (tests.helpers.extra_keys) of exactly the shapes vLLM 0.32 produces."""
    from connectors.store.request_keys import block_extra_keys

    req = _request(cache_salt="s", lora_request=_lora("l", "/p"), mm_features=_image())
    assert block_extra_keys(req, 3, 16) == [
        (("lora", "l", "/p"), ("mm", "img1", 3), ("cache_salt", "s")),
        (("lora", "l", "/p"), ("mm", "img1", -13)),
        (("lora", "l", "/p"),),
    ]
    (embeds,) = block_extra_keys(_request(prompt_embeds=_embeds()), 1, 16)[0]
    assert embeds[0] == "prompt_embeds" and isinstance(embeds[1], bytes) and len(embeds[1]) == 32


@pytest.mark.parametrize("tenant", [
    {"cache_salt": "tenant-b"}, {"lora_request": _lora("tenant-b")}, {"lora_request": _lora(path="/adapters/b")},
    {"mm_features": _image("img2")}, {"mm_features": _image(offset=4)},
], ids=["salt", "lora-name", "lora-path", "mm-hash", "mm-offset"])
def test_each_tenant_extra_changes_the_keys(tenant):
    base = {"cache_salt": "tenant-a", "lora_request": _lora(), "mm_features": _image()}
    mine = _pool_hashes(_request(**base))
    assert _pool_hashes(_request("again", **base)) == mine, "same inputs, same keys"
    other = _pool_hashes(_request(**{**base, **tenant}))
    assert len(other) == len(mine) == 3
    first = next(i for i, (a, b) in enumerate(zip(mine, other)) if a != b)
    assert all(a != b for a, b in zip(mine[first:], other[first:])), "the chain carries the change to every later key"
    plain = _pool_hashes(_request())
    assert not set(plain) & set(mine) and not set(plain) & set(other)


def test_salt_is_in_every_key_through_the_chain():
    plain, salted = _pool_hashes(_request()), _pool_hashes(_request(cache_salt="a"))
    assert all(a != b for a, b in zip(plain, salted))
    assert plain == block_hashes(list(range(100, 150)), 16), "requests without extras keep token-only keys"


def test_prompt_embeddings_key_by_their_content():
    one, again, other = (_pool_hashes(_request(prompt_embeds=_embeds(v))) for v in (1.0, 1.0, 2.0))
    assert one == again and len(one) == 3
    assert all(a != b for a, b in zip(one, other))
    assert all(a != b for a, b in zip(one, block_hashes([0] * 50, 16))), "not the placeholder ids alone"


def test_pool_keys_share_exactly_when_vllms_prefix_cache_would():
    """Equal pool hash <=> equal vLLM block hash, block by block, over requests differing in every extra."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    variants = [{}, {"cache_salt": "a"}, {"cache_salt": "b"}, {"lora_request": _lora()},
                {"lora_request": _lora("x")}, {"mm_features": _image()}, {"mm_features": _image("img2", 20)},
                {"cache_salt": "a", "mm_features": _image()}, {"tokens": list(range(100, 132)) + [7] * 18},
                {"prompt_embeds": _embeds()}, {"prompt_embeds": _embeds(3.0)}]
    requests = [_request(f"r{i}", **v) for i, v in enumerate(variants)]
    ours = [_pool_hashes(r) for r in requests]
    theirs = [hasher(r) for r in requests]
    for i in range(len(requests)):
        for j in range(len(requests)):
            for b in range(3):
                assert (ours[i][b] == ours[j][b]) == (theirs[i][b] == theirs[j][b]), (variants[i], variants[j], b)
