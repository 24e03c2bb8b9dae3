"""The vLLM adapter's pure parts, without an engine: which blocks a step broadcasts, which steps
broadcast at all, and the KV cache config rewrite, bound by vLLM 0.32's own allocator."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvpp_core.allocation import CacheLayer, place
from kvpp_core.ownership import rank_layout
from kvpp_core.vllm_adapter import history_block_ranges, kvpp_cache_config, step_needs_broadcast

pytestmark = pytest.mark.unit

BLOCK = 16


def _state(block_ids, computed):
    return SimpleNamespace(block_ids=(list(block_ids),), num_computed_tokens=computed)


def test_history_is_the_blocks_up_to_each_requests_computed_tokens():
    states = {
        "a": _state([4, 5, 6, 9], 33),  # 33 tokens: blocks 4, 5 and the partial 6
        "b": _state([7, 8], 16),  # exactly one full block
        "fresh": _state([10, 11], 0),  # a fresh prefill has no history
        "idle": _state([20], 16),  # not scheduled this step
    }
    assert history_block_ranges(states, ["a", "b", "fresh"], BLOCK) == [range(4, 8)]
    assert history_block_ranges(states, ["fresh"], BLOCK) == []
    assert history_block_ranges(states, ["b", "idle"], BLOCK) == [range(7, 8), range(20, 21)]


def test_history_falls_back_to_every_block_when_the_runner_keeps_no_usable_state():
    assert history_block_ranges(None, ["a"], BLOCK) is None
    assert history_block_ranges({}, ["unknown"], BLOCK) is None
    two_groups = SimpleNamespace(block_ids=([1], [2]), num_computed_tokens=16)
    assert history_block_ranges({"a": two_groups}, ["a"], BLOCK) is None


def _scheduled(tokens, new_computed=(), running=0):
    return SimpleNamespace(
        total_num_scheduled_tokens=tokens,
        scheduled_new_reqs=[SimpleNamespace(num_computed_tokens=n) for n in new_computed],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[f"r{i}" for i in range(running)]),
    )


@pytest.mark.parametrize("output, expected", [
    (_scheduled(0, running=2), False),  # an empty step (e.g. only finished requests)
    (_scheduled(300, new_computed=(0, 0)), False),  # fresh prefills only
    (_scheduled(300, new_computed=(0, 32)), True),  # a prefix hit or KV load brought history
    (_scheduled(2, running=2), True),  # decodes attend over their history
    (_scheduled(45, new_computed=(0,), running=1), True),
])
def test_step_gating(output, expected):
    assert step_needs_broadcast(output) is expected


def test_rewritten_cache_config_binds_each_cache_where_the_placement_says():
    """vLLM's allocator, given the rewritten config, puts every cache at its planned offset: owned ones
    apart, the foreign layers of one staging slot on the same bytes, and no more bytes than planned."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)] + ["model.layers.6.self_attn.attn"]
    layers = [CacheLayer(n, spec.page_size_bytes, i if i < 6 else None) for i, n in enumerate(names)]
    layout = rank_layout(range(6), 2, 1, staging=2)  # owns 3-5; 0-2 land in two staging slots; 6 is MTP
    num_blocks = 3
    placement = place(layers, layout, num_blocks)
    engine_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )
    config = kvpp_cache_config(engine_config, placement)
    assert config.num_blocks == num_blocks and config.kv_cache_groups == engine_config.kv_cache_groups
    assert sorted(t.layers[0] for t in config.kv_cache_tensors) == sorted(names)

    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    base = caches[names[0]].untyped_storage()
    assert base.nbytes() == placement.total_bytes == (3 + 1 + 2) * num_blocks * spec.page_size_bytes
    for name, cache in caches.items():
        assert cache.untyped_storage().data_ptr() == base.data_ptr()
        assert cache.data_ptr() - base.data_ptr() == placement.offsets[name]
        assert cache.shape[0] == num_blocks and cache.nbytes == num_blocks * spec.page_size_bytes
    # Layers 0 and 2 run at even positions, layer 1 at an odd one: two slots, the even ones aliased.
    assert caches[names[0]].data_ptr() == caches[names[2]].data_ptr() != caches[names[1]].data_ptr()
    caches[names[0]].fill_(1.0)
    assert torch.equal(caches[names[2]], caches[names[0]]) and not caches[names[1]].any()
    persistent = [caches[n] for n in placement.persistent]
    assert len({c.data_ptr() for c in persistent}) == 4 and not any(c.any() for c in persistent)
