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


def test_a_gqa_key_names_the_kv_heads_so_two_heads_of_one_layer_never_collide():
    h = block_hashes(list(range(16)), 16)[0]
    fp = LAYOUT.fingerprint(range(8))
    assert ShardKey(fp, 0, 1, (0,)).key(h) == f"kvpp/{fp}/pp0/h0/o1/{h}"
    assert ShardKey(fp, 0, 0, (4, 5, 6, 7)).key(h) == f"kvpp/{fp}/pp0/h4-7/o0/{h}"
    keys = {ShardKey(fp, 0, owner, heads).key(h) for owner in (0, 1) for heads in ((0,), (1,), None)}
    assert len(keys) == 6


_CHILD = """
import json, sys
from connectors.store.keys import CacheLayout, ShardKey, block_hashes
from tests.helpers.extra_keys import EXTRAS
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


def test_an_extra_key_without_canonical_encoding_refuses_the_request():
    from connectors.store.keys import UnhashableExtraKeys

    with pytest.raises(UnhashableExtraKeys, match="canonical"):
        block_hashes(list(range(16)), 16, [(("future", object()),)])
