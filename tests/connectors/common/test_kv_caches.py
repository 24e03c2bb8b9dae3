"""What both connectors read of an engine's KV caches: each rank's KV heads, and the caches they refuse to move."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from connectors.common.kv_caches import block_pages_problem, cache_groups_problem, rank_kv_heads

pytestmark = pytest.mark.unit


def _config(mla: bool = False, kv_heads: int = 1, tp: int = 2, block: int = 32, head: int = 32):
    model = SimpleNamespace(use_mla=mla, get_total_num_kv_heads=lambda: kv_heads, get_head_size=lambda: head,
                            get_num_kv_heads=lambda parallel: max(1, kv_heads // parallel.tensor_parallel_size))
    return SimpleNamespace(model_config=model, parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                           cache_config=SimpleNamespace(block_size=block))


def _groups(*specs):
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec) for spec in specs])


def _spec(name: str):
    """A vLLM KV cache spec of that class (its fields are not read)."""
    from vllm.v1 import kv_cache_interface

    cls = getattr(kv_cache_interface, name)
    return object.__new__(cls)


def test_each_rank_holds_the_heads_vllm_gives_it():
    assert [rank_kv_heads(_config(kv_heads=1, tp=2), r) for r in range(2)] == [(0,), (0,)]
    assert [rank_kv_heads(_config(kv_heads=4, tp=8), r) for r in (0, 3, 7)] == [(0,), (1,), (3,)]
    assert [rank_kv_heads(_config(kv_heads=8, tp=2), r) for r in range(2)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert rank_kv_heads(_config(mla=True), 1) is None


def test_hybrid_and_non_full_attention_gqa_caches_are_refused_naming_the_connector():
    full = _spec("FullAttentionSpec")
    assert cache_groups_problem(_config(), None, "C") is None
    assert cache_groups_problem(_config(), _groups(full), "C") is None
    assert cache_groups_problem(_config(mla=True), _groups(_spec("MLAAttentionSpec")), "C") is None
    two = cache_groups_problem(_config(), _groups(full, _spec("SlidingWindowSpec")), "C")
    assert two.startswith("C moves models with one KV cache group") and "this model has 2" in two
    window = cache_groups_problem(_config(), _groups(_spec("SlidingWindowSpec")), "C")
    assert "this model's are SlidingWindowSpec" in window and window.endswith("serve it without C")


def test_a_gqa_cache_whose_backend_keeps_k_and_v_apart_is_refused():
    blocks = 4
    cpu_attn = torch.zeros(blocks, 1, 32, 2 * 32)  # vLLM's CPU attention: a block's K and V heads together
    assert block_pages_problem(_config(), {"l0": cpu_attn}, "C") is None
    flash = torch.zeros(2, blocks, 32, 1, 32)  # FlashAttention's layout: every K block, then every V block
    problem = block_pages_problem(_config(), {"l0": cpu_attn, "l1": flash}, "C")
    assert "layer l1's cache has shape (2, 4, 32, 1, 32)" in problem and "keeps K and V apart" in problem
    assert block_pages_problem(_config(mla=True), {"l1": flash}, "C") is None
