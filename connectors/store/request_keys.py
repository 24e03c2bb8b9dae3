"""A request's pool block hashes, with the extra keys vLLM's prefix-cache hasher puts in each block, and
what the pool's KV events say of those blocks in vLLM's own terms.

The extra keys come from vLLM's own `generate_block_hash_extra_keys` (vllm/v1/core/kv_cache_utils.py),
called per block exactly as `get_request_block_hasher` calls it, so the pool and vLLM's prefix cache
can never disagree on which requests may share a block. The hash itself stays this project's
sha256 chain (connectors.store.keys): vLLM's block hashes depend on the configured algorithm and,
for non-cryptographic ones, on a per-process seed, and pool keys must be equal on every node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connectors.store.events import BlockFacts
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


@dataclass(frozen=True)
class PromptBlocks:
    """A request's whole prompt blocks: their pool hashes and vLLM's extra keys of each."""

    hashes: list[str]
    extra_keys: list[tuple[Any, ...] | None]


def prompt_blocks(request: "Request", block_size: int) -> PromptBlocks:
    """The whole blocks of the request's prompt (token ids, or the placeholder ids of prompt embeddings, whose
    digests are in the extra keys). Raises UnhashableExtraKeys if vLLM produced an extra key without a
    canonical encoding."""
    prompt = request.all_token_ids[: request.num_prompt_tokens]
    extra = block_extra_keys(request, len(prompt) // block_size, block_size)
    return PromptBlocks(block_hashes(prompt, block_size, extra), extra)


def block_facts(request: "Request", blocks: PromptBlocks, block_size: int) -> list[BlockFacts] | None:
    """What the pool's BlockStored events say of each prompt block, in vLLM's own terms (its block hashes, as
    its prefix-cache events carry them); None where vLLM hashed the request in blocks of another size (a hybrid
    model's hash block), which the pool's blocks cannot name."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, to_event_extra_keys

    if len(request.block_hashes) != len(request.all_token_ids) // block_size:
        return None
    lora = request.lora_request
    facts, parent = [], None
    for i, extra in enumerate(blocks.extra_keys):
        block_hash = maybe_convert_block_hash(request.block_hashes[i])
        (keys,) = to_event_extra_keys([extra])  # the untagged form vLLM's own events publish
        facts.append(BlockFacts(block_hash, parent, tuple(request.all_token_ids[i * block_size:(i + 1) * block_size]),
                                keys, lora.adapter_id if lora else None, lora.name if lora else None))
        parent = block_hash
    return facts
