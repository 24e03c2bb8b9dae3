"""Pool keys: content-addressed, prefix-chained, and the same in every process whatever PYTHONHASHSEED is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

from connectors.store.keys import HASH_HEX_LEN, CacheLayout, ShardKey, block_hashes

pytestmark = pytest.mark.unit

LAYOUT = CacheLayout(model="/models/tiny16", dtype="float32", block_size=16, page_bytes=16 * 576 * 4)


def test_one_hash_per_whole_block_only():
    assert len(block_hashes(list(range(47)), 16)) == 2
    assert len(block_hashes(list(range(48)), 16)) == 3
    assert block_hashes(list(range(15)), 16) == []
    assert all(len(h) == HASH_HEX_LEN and int(h, 16) >= 0 for h in block_hashes(list(range(64)), 16))


def test_chain_covers_the_whole_prefix():
    a = list(range(64))
    b = [7] + a[1:]  # differs only in block 0
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert all(x != y for x, y in zip(ha, hb)), "a changed first block must change every later hash"
    c = a[:48] + [9] * 16  # differs only in block 3
    assert block_hashes(c, 16)[:3] == ha[:3] and block_hashes(c, 16)[3] != ha[3]


def test_same_tokens_in_another_block_give_another_hash():
    block = list(range(16))
    assert block_hashes(block * 2, 16)[0] != block_hashes(block * 2, 16)[1]


def test_large_token_ids_are_encoded_exactly():
    assert block_hashes([2**40] * 16, 16) != block_hashes([2**40 + 1] * 16, 16)


@pytest.mark.parametrize("change", [
    {"model": "/models/other"}, {"dtype": "bfloat16"}, {"block_size": 128}, {"page_bytes": 1},
])
def test_fingerprint_depends_on_the_layout(change):
    other = CacheLayout(**{**LAYOUT.__dict__, **change})
    assert other.fingerprint(range(16)) != LAYOUT.fingerprint(range(16))


def test_fingerprint_depends_on_the_layer_set_not_its_order():
    assert LAYOUT.fingerprint([0, 1, 2]) == LAYOUT.fingerprint([2, 0, 1])
    assert LAYOUT.fingerprint([0, 1, 2]) != LAYOUT.fingerprint([0, 1])
    assert LAYOUT.fingerprint([0, 1]) != LAYOUT.fingerprint([0, 1, "mtp0"])


def test_key_names_stage_and_owner():
    h = block_hashes(list(range(16)), 16)[0]
    fp = LAYOUT.fingerprint(range(8))
    keys = {ShardKey(fp, pp, owner).key(h) for pp in (0, 1) for owner in (0, 1)}
    assert len(keys) == 4
    assert ShardKey(fp, 1, 0).key(h) == f"kvpp/{fp}/pp1/o0/{h}"


# Per-block extra keys in the shapes vLLM 0.32 produces (checked against vLLM in test_vllm_extra_key_shapes).
EXTRAS = [(("lora", "l", "/p"), ("mm", "img1", 3), ("cache_salt", "s"), ("prompt_embeds", b"\x00\xff" * 16)),
          (("lora", "l", "/p"), ("mm", "img1", -13)), None]

_CHILD = """
import json, sys
from connectors.store.keys import CacheLayout, ShardKey, block_hashes
from tests.connectors.store.test_keys import EXTRAS
layout = CacheLayout(model="m", dtype="float32", block_size=16, page_bytes=36864)
hashes = block_hashes(list(range(100)), 16)
print(json.dumps({"hashes": hashes, "key": ShardKey(layout.fingerprint([0, 1, "mtp0"]), 0, 1).key(hashes[-1]),
                  "tenant": block_hashes(list(range(100)), 16, EXTRAS), "salted": hash("x")}))
"""


def test_keys_identical_across_processes_with_different_hash_seeds():
    runs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True,
                             cwd=REPO)
        runs.append(json.loads(out.stdout))
    assert runs[0]["salted"] != runs[1]["salted"], "the two children must really use different hash seeds"
    assert runs[0]["hashes"] == runs[1]["hashes"]
    assert runs[0]["tenant"] == runs[1]["tenant"] != runs[0]["hashes"]
    assert runs[0]["key"] == runs[1]["key"]


# ---- tenant extras: the keys vLLM's prefix-cache hasher adds -------------------------------------
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
    from connectors.store.request_keys import prompt_block_hashes

    return prompt_block_hashes(request, 16)


def test_vllm_extra_key_shapes():
    """The child processes above hash tuples of exactly the shapes vLLM 0.32 produces."""
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


def test_an_extra_key_without_canonical_encoding_refuses_the_request():
    from connectors.store.keys import UnhashableExtraKeys

    with pytest.raises(UnhashableExtraKeys, match="canonical"):
        block_hashes(list(range(16)), 16, [(("future", object()),)])
