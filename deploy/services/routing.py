"""Cache-aware choice of a request's prefill: the instance in rotation that holds the longest prefix of its
prompt, from the prefills' KV cache events (deploy/services/kv_events.py).

The prompt's tokens come from a prefill's own `/tokenize` (its tokenizer and chat template), or from the
request when it sends token ids. Only full blocks count. The load rotation decides whenever the index
cannot: no index yet, a prompt the proxy cannot tokenize, no instance holding a block of it, or the one
that does overloaded; among instances holding equally long prefixes the rotation picks. Every decision is
counted on /metrics; none of them can fail a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Histogram

from deploy.services.kv_events import EventMetrics, EventStream, PrefixIndex, prefix_keys

logger = logging.getLogger("kvpp.proxy")

FALLBACKS = ("no_index", "prompt", "tokenize", "miss", "overloaded")
"""Why the load rotation picked: no instance has an index yet; a prompt the proxy does not tokenize (a
batch); /tokenize failed; no instance holds the prompt's first block; the holders are overloaded."""
COMPLETION_KEYS = ("add_special_tokens",)
CHAT_KEYS = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
             "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")
"""The request keys vLLM's /tokenize takes that shape a prompt's tokens (its TokenizeChatRequest's)."""


@dataclass(frozen=True)
class PrefixRouting:
    """The cache-aware policy's settings (`kvpp proxy --kv-events ...`)."""

    endpoints: tuple[str, ...]
    """Each prefill's KV event endpoint, in the order of the prefill URLs."""
    overload_margin: int = 4
    """An instance is overloaded when its prefill legs in flight exceed the least loaded one's by more."""
    max_index_blocks: int = 1 << 18
    """Blocks indexed per instance (each about 200 bytes); the oldest are forgotten first."""
    event_timeout: float = 5.0
    """A stream silent this long (ZMTP heartbeats unanswered) counts as dropped: its index is emptied."""
    tokenize_timeout: float = 5.0


def tokenize_request(path: str, body: dict) -> dict | list[int] | None:
    """What to ask /tokenize for the prompt of `body` sent to `path`, the token ids themselves when the
    request carries them, or None when the proxy cannot name one prompt (a batch, no prompt)."""
    if path.endswith("/chat/completions"):
        return {k: body[k] for k in CHAT_KEYS if k in body} if isinstance(body.get("messages"), list) else None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return {"prompt": prompt, **{k: body[k] for k in COMPLETION_KEYS if k in body}}
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1:
        return tokenize_request(path, {**body, "prompt": prompt[0]})
    return None


class PrefixRouter:
    """The policy over one proxy's prefills: their indexes, fed by one EventStream each."""

    def __init__(self, backends: Sequence, settings: PrefixRouting, registry: CollectorRegistry):
        if len(settings.endpoints) != len(backends):
            raise ValueError(f"--kv-events names {len(settings.endpoints)} endpoint(s) for {len(backends)} prefill "
                             "URL(s): give one per prefill, in the same order")
        self.settings = settings
        metrics = EventMetrics(registry)
        self.streams = {b.url: EventStream(b.url, endpoint, PrefixIndex(settings.max_index_blocks), metrics,
                                           settings.event_timeout)
                        for b, endpoint in zip(backends, settings.endpoints)}
        self.hits = Counter("kvpp_proxy_prefix_hits", "Prefill legs sent to the instance holding the longest "
                            "prefix of their prompt.", ["backend"], registry=registry)
        self.hit_blocks = Histogram("kvpp_proxy_prefix_hit_blocks", "Full blocks of the prompt the chosen "
                                    "instance held.", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
                                    registry=registry)
        self.fallbacks = Counter("kvpp_proxy_prefix_fallbacks", "Prefill legs routed by load, by reason: "
                                 + ", ".join(FALLBACKS) + ".", ["reason"], registry=registry)
        for reason in FALLBACKS:
            self.fallbacks.labels(reason)

    def forget(self, url: str, reason: str) -> None:
        """An instance left the rotation (down, maybe restarting): what it held is no longer known."""
        self.streams[url].reset(reason)

    def indexed(self, order: Sequence) -> bool:
        """Whether any of `order` has an index to consult (else the prompt need not be tokenized)."""
        return any(len(self.streams[b.url].index) for b in order)

    def choose(self, order: list, tokens: list[int] | str) -> list:
        """`order` (the rotation's, healthy instances only) with the instance holding the longest prefix of
        the prompt's `tokens` first; `order` unchanged when the index cannot decide (`tokens` may already
        be the reason: a FALLBACKS entry)."""
        if isinstance(tokens, str):
            return self._fallback(order, tokens)
        keys_by_size: dict[int, list[bytes]] = {}
        matched = {}
        for b in order:
            index = self.streams[b.url].index
            if index.block_size is None:
                matched[b.url] = 0
                continue
            if index.block_size not in keys_by_size:
                keys_by_size[index.block_size] = prefix_keys(tokens, index.block_size)
            matched[b.url] = index.matched_blocks(keys_by_size[index.block_size])
        least = min(b.in_flight for b in order)
        eligible = [b for b in order if b.in_flight <= least + self.settings.overload_margin]
        best = max((matched[b.url] for b in eligible), default=0)
        if best == 0:
            held = any(matched[b.url] for b in order)
            return self._fallback(order, "overloaded" if held else "miss")
        first = next(b for b in eligible if matched[b.url] == best)  # ties: the rotation's turn decides
        self.hits.labels(first.url).inc()
        self.hit_blocks.observe(best)
        return [first, *(b for b in order if b is not first)]

    def _fallback(self, order: list, reason: str) -> list:
        self.fallbacks.labels(reason).inc()
        return order


async def prompt_tokens(session: aiohttp.ClientSession, url: str, path: str, body: dict,
                        timeout: float) -> list[int] | str:
    """The prompt's token ids as the instance at `url` tokenizes it, or the fallback reason."""
    ask = tokenize_request(path, body)
    if ask is None:
        return "prompt"
    if isinstance(ask, list):
        return ask
    try:
        async with session.post(f"{url}/tokenize", json=ask, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            answer = await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        logger.debug("tokenize on %s failed: %s", url, exc)
        return "tokenize"
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        return "tokenize"
    return tokens
