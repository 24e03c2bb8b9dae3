"""A request's pool block hashes, with the extra keys vLLM's prefix-cache hasher puts in each block.

The extra keys come from vLLM's own `generate_block_hash_extra_keys` (vllm/v1/core/kv_cache_utils.py),
called per block exactly as `get_request_block_hasher` calls it, so the pool and vLLM's prefix cache
can never disagree on which requests may share a block. The hash itself stays this project's
sha256 chain (connectors.store.keys): vLLM's block hashes depend on the configured algorithm and,
for non-cryptographic ones, on a per-process seed, and pool keys must be equal on every node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from connectors.store.keys import block_hashes

if TYPE_CHECKING:
    from vllm.v1.request import Request


def block_extra_keys(request: "Request", num_blocks: int, block_size: int) -> list[tuple[Any, ...] | None]:
    """vLLM's extra keys of each of the request's first `num_blocks` whole blocks."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    keys, mm_idx = [], 0
    for i in range(num_blocks):
        extra, mm_idx = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, mm_idx)
        keys.append(extra)
    return keys


def prompt_block_hashes(request: "Request", block_size: int) -> list[str]:
    """Pool hashes of the whole blocks of the request's prompt (token ids, or the placeholder ids of
    prompt embeddings, whose digests are in the extra keys). Raises UnhashableExtraKeys if vLLM
    produced an extra key without a canonical encoding."""
    prompt = request.all_token_ids[: request.num_prompt_tokens]
    num_blocks = len(prompt) // block_size
    return block_hashes(prompt, block_size, block_extra_keys(request, num_blocks, block_size))
