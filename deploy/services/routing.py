"""Cache-aware choice of a request's prefill: the instance whose cached prefix of the prompt, net of the prompt
tokens already queued on it, leaves the least to compute. What each prefill holds comes from its KV cache events
(deploy/services/event_stream.py, deploy/services/prefix_index.py); an index not trusted (from a break in its
stream until a sync from the replay endpoint succeeds) is left out, and that prefill is weighed by load alone.

The prompt's tokens come from a prefill's own `/tokenize` (its tokenizer and chat template), or from the
request when it sends token ids. Only full blocks count, and the last prompt token is always computed. The
tokenizer is asked only when some instance may hold the prompt's first block: a prompt whose leading text was
tokenized before is known by it, and a prompt never seen needs an instance holding some first block. Keys are
computed block by block, each looked up once for all instances (their indexes share one table of holders), and stop
at the first block no instance holds.

Every decision weighs load: an instance's cost is the prompt tokens this proxy's prefill legs in flight there
still compute, plus what this prompt would compute there. Without tokens (no index yet, a prompt the proxy does
not tokenize, a failed /tokenize) the prompt's size is estimated from its text and the least loaded instance is
picked; the rotation's turn breaks ties. Every decision is counted on /metrics; none of them can fail a request.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Histogram

from deploy.services.event_stream import EventMetrics, EventStream
from deploy.services.kv_events import MAX_TOKEN_ID
from deploy.services.prefix_index import ROOT, Holders, PrefixIndex, Prompt, block_key

logger = logging.getLogger("kvpp.proxy")

FALLBACKS = ("no_index", "prompt", "tokenize", "miss", "overloaded")
"""Why no cached prefix decided the pick (load did): no instance holds a first block yet; a prompt the proxy does not
tokenize (a batch); /tokenize failed; no instance holds the prompt's first block; the holders' queues outweighed
what their prefix saves."""
COMPLETION_KEYS = ("add_special_tokens",)
CHAT_KEYS = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
             "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs")
"""The request keys vLLM's /tokenize takes that shape a prompt's tokens (its TokenizeChatRequest's)."""
CHARS_PER_TOKEN = 4
"""The estimate of a prompt's tokens from its text when it was not tokenized (English text runs about 4)."""
FINGERPRINT_CHARS_PER_TOKEN = 32
"""Leading prompt text that names its first block: this many characters per token of the largest block size, far
more than any tokenizer puts into a token, so two prompts alike that far begin with the same first block."""
FIRST_BLOCKS = 1 << 16
"""Prompts whose first block the proxy remembers by their leading text (the least recently used forgotten)."""
FULL_REPORT = {"kv_cache_report_mode": "full"}
"""What a prefill leg asks vLLM (`vllm_xargs`): announce again the cached blocks a request hits, so that what
the proxy lost (its restart, a gap) comes back with the next request of each conversation."""


@dataclass(frozen=True)
class PrefixRouting:
    """The cache-aware policy's settings (`kvpp proxy --kv-events ...`)."""

    endpoints: tuple[str, ...]
    """Each prefill's KV event endpoint, in the order of the prefill URLs."""
    replay_endpoints: tuple[str, ...] | None = None
    """Each prefill's replay endpoint (vLLM's `replay_endpoint`), in the same order: the index is rebuilt from it
    at start and after every break, else a break empties it."""
    max_index_blocks: int = 1 << 18
    """Blocks indexed per instance (each about 300 bytes); the least recently announced leaves are forgotten first."""
    event_timeout: float = 5.0
    """A stream silent this long (ZMTP heartbeats unanswered) counts as dropped; a replay silent this long failed."""
    tokenize_timeout: float = 5.0
    block_size: int | None = None
    """The prefills' block size: a stored event of another size is refused; None: each index learns it from the first
    event it applies after it was emptied."""


def tokenize_request(path: str, body: dict) -> dict | list[int] | None:
    """What to ask /tokenize for the prompt of `body` sent to `path`, the token ids themselves when the
    request carries them, or None when the proxy cannot name one prompt (a batch, no prompt)."""
    if path.endswith("/chat/completions"):
        return {k: body[k] for k in CHAT_KEYS if k in body} if isinstance(body.get("messages"), list) else None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return {"prompt": prompt, **{k: body[k] for k in COMPLETION_KEYS if k in body}}
    if isinstance(prompt, list) and prompt and token_ids(prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1:
        return tokenize_request(path, {**body, "prompt": prompt[0]})
    return None


def token_ids(value: list) -> bool:
    """Whether `value` is a list of token ids the index's keys can hold (vLLM refuses the others itself)."""
    return all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in value)


def estimated_tokens(body: dict) -> int:
    """A prompt's size in tokens, guessed from its text (what load counts for a prompt that was not tokenized)."""
    prompt = body.get("messages", body.get("prompt", ""))
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False, default=str)
    return max(1, len(text) // CHARS_PER_TOKEN)


def _fingerprint(ask: dict, chars: int) -> bytes:
    """The leading `chars` of a prompt's text with everything else that shapes its tokens (template, tools...)."""
    text = ask["prompt"] if "prompt" in ask else json.dumps(ask["messages"], ensure_ascii=False, sort_keys=True,
                                                             default=str)
    rest = json.dumps({k: v for k, v in ask.items() if k not in ("prompt", "messages")}, sort_keys=True, default=str)
    return hashlib.blake2b(f"{len(text) > chars}\0{rest}\0{text[:chars]}".encode(), digest_size=16).digest()


class Leg(NamedTuple):
    """A prefill to try for a request, and the prompt tokens it would compute there (what its leg adds to the
    instance's queue while in flight)."""

    backend: object
    tokens: int


class PrefixRouter:
    """The policy over one proxy's prefills: their indexes, fed by one EventStream each."""

    def __init__(self, backends: Sequence, settings: PrefixRouting, registry: CollectorRegistry):
        if len(settings.endpoints) != len(backends):
            raise ValueError(f"--kv-events names {len(settings.endpoints)} endpoint(s) for {len(backends)} prefill "
                             "URL(s): give one per prefill, in the same order")
        replays = settings.replay_endpoints
        if replays is not None and len(replays) != len(backends):
            raise ValueError(f"--kv-events-replay names {len(replays)} endpoint(s) for {len(backends)} prefill "
                             "URL(s): give one per prefill, in the same order")
        self.settings = settings
        self.metrics = metrics = EventMetrics(registry)
        self.holders = Holders()
        self.streams = {b.url: EventStream(b.url, endpoint, PrefixIndex(settings.max_index_blocks, self.holders,
                                                                       settings.block_size),
                                           metrics, settings.event_timeout, replays[i] if replays else None)
                        for i, (b, endpoint) in enumerate(zip(backends, settings.endpoints))}
        self._started = False
        """Every index had its first sync (or the wait for them ended)."""
        self._first_blocks: collections.OrderedDict[bytes, tuple[int, ...]] = collections.OrderedDict()
        """A prompt's fingerprint -> its leading tokens, as /tokenize gave them."""
        self.hits = Counter("kvpp_proxy_prefix_hits", "Prefill legs sent to an instance holding a prefix of their "
                            "prompt.", ["backend"], registry=registry)
        self.hit_blocks = Histogram("kvpp_proxy_prefix_hit_blocks", "Full blocks of the prompt the chosen "
                                    "instance held.", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
                                    registry=registry)
        self.fallbacks = Counter("kvpp_proxy_prefix_fallbacks", "Prefill legs routed by load alone, by reason: "
                                 + ", ".join(FALLBACKS) + ".", ["reason"], registry=registry)
        self.tokenizations = Counter("kvpp_proxy_tokenizations", "Prompts the proxy had a prefill tokenize "
                                     "(asked), and prompts it routed without (skipped: no instance may hold their "
                                     "first block).", ["outcome"], registry=registry)
        self._hits = {url: self.hits.labels(url) for url in self.streams}
        self._fallbacks = {reason: self.fallbacks.labels(reason) for reason in FALLBACKS}
        for outcome in ("asked", "skipped"):
            self.tokenizations.labels(outcome)

    def forget(self, url: str) -> None:
        """An instance left the rotation (down, maybe restarting): what it holds must be checked again."""
        self.streams[url].broke("down")

    def _indexes(self, order: Sequence) -> list[PrefixIndex]:
        """The indexes of `order` routing may read: those trusted (an index that may have missed removals since its
        last sync would attract prompts to an instance that no longer holds them)."""
        streams = (self.streams[b.url] for b in order)
        return [stream.index for stream in streams if stream.trusted]

    def should_tokenize(self, ask: dict, order: Sequence) -> bool:
        """Whether any of `order` may hold the first block of the prompt `ask` names (then its tokens are worth a
        /tokenize): known by its leading text, or, for a prompt never tokenized, any instance holding a first
        block at all."""
        indexes = self._indexes(order)
        sizes = {i.block_size for i in indexes if i.block_size is not None}
        if not sizes:
            return False
        first = self._first_blocks.get(_fingerprint(ask, FINGERPRINT_CHARS_PER_TOKEN * max(sizes)))
        if first is None:
            return any(i.holds_a_first_block for i in indexes)
        return any(i.block_size is not None and (len(first) < i.block_size or i.holds(block_key(ROOT, first[:i.block_size])))
                   for i in indexes)

    def learned(self, ask: dict, tokens: list[int], order: Sequence) -> None:
        """Remember the first block of the prompt `ask` named, by its leading text."""
        sizes = [i.block_size for i in self._indexes(order) if i.block_size is not None]
        if not sizes:
            return
        fingerprint = _fingerprint(ask, FINGERPRINT_CHARS_PER_TOKEN * max(sizes))
        self._first_blocks[fingerprint] = tuple(tokens[:max(sizes)])
        self._first_blocks.move_to_end(fingerprint)
        if len(self._first_blocks) > FIRST_BLOCKS:
            self._first_blocks.popitem(last=False)

    def _matched(self, order: Sequence, prompt: Prompt) -> dict[str, tuple[int, int]]:
        """The instances holding some leading full blocks of the prompt: how many, and their block size. Keys are
        computed only while some instance of a block size holds them all."""
        matched: dict[str, tuple[int, int]] = {}
        by_size: dict[int, dict[int, str]] = collections.defaultdict(dict)  # block size -> an index's bit -> its URL
        for b in order:
            stream = self.streams[b.url]
            if stream.trusted and stream.index.block_size is not None:
                by_size[stream.index.block_size][stream.index.bit] = b.url
        for size, urls in by_size.items():
            for bit, held in self.holders.runs(prompt.keys(size), sum(urls)).items():
                matched[urls[bit]] = held, size
        return matched

    def choose(self, order: list, prompt: Prompt | str, estimate: int) -> list[Leg]:
        """`order` (the rotation's, healthy instances only) as legs, cheapest first: an instance's cost is its
        queued prompt tokens plus what this prompt computes there. `prompt` may be a FALLBACKS reason instead,
        with `estimate` the prompt's guessed size."""
        if isinstance(prompt, str):
            n, matched = estimate, {}
        else:
            n, matched = len(prompt), self._matched(order, prompt)
        most = max(n - 1, 0)  # the last prompt token is always computed
        saved = {url: min(held * size, most) for url, (held, size) in matched.items()}
        legs = [Leg(b, n - saved.get(b.url, 0)) for b in order]
        best = min(legs, key=lambda leg: leg.backend.queued_tokens + leg.tokens)  # ties: the rotation's turn
        if best.backend.url in matched:
            self._hits[best.backend.url].inc()
            self.hit_blocks.observe(matched[best.backend.url][0])
        else:
            reason = prompt if isinstance(prompt, str) else "overloaded" if matched else "miss"
            self._fallbacks[reason].inc()
        return [best, *(leg for leg in legs if leg is not best)]

    async def legs(self, session: aiohttp.ClientSession, path: str, body: dict, order: list) -> list[Leg]:
        """The prefills to try for a request, in order. Finding the prompt's tokens can fail; routing cannot. Right
        after the proxy started, a request waits (at most the event timeout) for the indexes' first syncs."""
        if not self._started:
            try:
                await asyncio.wait_for(asyncio.gather(*(s.started() for s in self.streams.values())),
                                       self.settings.event_timeout)
            except asyncio.TimeoutError:
                pass
            self._started = True
        ask = tokenize_request(path, body)
        if ask is None:
            tokens: list[int] | str = "prompt"
        elif isinstance(ask, list):
            tokens = ask
        elif not self.should_tokenize(ask, order):
            self.tokenizations.labels("skipped").inc()
            tokens = "miss" if any(i.holds_a_first_block for i in self._indexes(order)) else "no_index"
        else:
            self.tokenizations.labels("asked").inc()
            tokens = await prompt_tokens(session, order[0].url, ask, self.settings.tokenize_timeout)
            if not isinstance(tokens, str):
                self.learned(ask, tokens, order)
        return self.choose(order, tokens if isinstance(tokens, str) else Prompt(tokens), estimated_tokens(body))


async def prompt_tokens(session: aiohttp.ClientSession, url: str, ask: dict, timeout: float) -> list[int] | str:
    """The prompt's token ids as the instance at `url` tokenizes `ask`, or the fallback reason."""
    try:
        async with session.post(f"{url}/tokenize", json=ask, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            answer = await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        logger.debug("tokenize on %s failed: %s", url, exc)
        return "tokenize"
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not token_ids(tokens):
        return "tokenize"
    return tokens
