"""The clients of `kvpp chaos`: concurrent completions (plain, streaming, cancelled by their client)
over prompts with shared prefixes, each answer checked against a colocated engine's tokens, and
each request's end (answer, error and its code, cancellation) and latency recorded."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import aiohttp

from deploy.services.proxy import PATH_HEADER
from deploy.harness.tiny_model import sample_prompt

MAX_TOKENS = 8
CLIENT_TIMEOUT_S = 180.0
"""A request still open after this is recorded as an error: the stack hung it."""
CONNECT_RETRIES = 20
"""Attempts while the proxy refuses connections (restarting), 0.5 s apart: what OpenAI clients do."""
MODES = ("plain", "stream", "cancel")


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: tuple[str, ...] = ()
    """The colocated reference engine's greedy answer."""
    prompt_tokens: int = 0


def prompt_texts() -> list[str]:
    """Eight prompts; four share a 160-word prefix (pool hits on the prefill), lengths 30-300 words."""
    shared = sample_prompt(160, seed=101)
    return [shared + " " + sample_prompt(n, seed=200 + n) for n in (20, 60, 100, 140)] + \
        [sample_prompt(n, seed=300 + n) for n in (30, 90, 180, 300)]


def completion_body(model: str, prompt: str, stream: bool, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "stream": stream, **extra}


async def reference_prompts(url: str, model: str, texts: Sequence[str] | None = None, **extra) -> list[Prompt]:
    """Each prompt (default: prompt_texts()) answered by the reference engine alone, one after the
    other; `extra` are further body fields (as Load.extra)."""
    async with aiohttp.ClientSession() as session:
        out = []
        for text in prompt_texts() if texts is None else texts:
            async with session.post(f"{url}/v1/completions", json=completion_body(model, text, False, **extra)) as r:
                answer = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"reference engine {url} answered HTTP {r.status}: {answer}")
            out.append(Prompt(text, tuple(answer["choices"][0]["logprobs"]["tokens"]),
                              answer["usage"]["prompt_tokens"]))
        return out


@dataclass
class Record:
    id: int
    prompt: int
    mode: str
    start: float
    end: float = 0.0
    outcome: str = ""
    """answered | wrong | error | cancelled"""
    status: int | None = None
    error: str = ""
    first_byte: float | None = None
    """Seconds after the start when the first answer bytes arrived."""
    retries: int = 0
    path: str = ""
    """How the proxy served it (pd, decode_only, prefill_only)."""

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def asdict(self) -> dict:
        return {**asdict(self), "seconds": round(self.seconds, 3)}


@dataclass
class Load:
    """`clients` concurrent clients sending requests back to back until stopped; pausable."""
    url: str
    model: str
    prompts: list[Prompt]
    clients: int
    seed: int = 0
    weights: tuple[float, float, float] = (0.45, 0.45, 0.10)
    """Shares of plain, streaming and client-cancelled requests."""
    think_s: float = 0.5
    """A client's mean pause between two requests (uniform on 0..2x): users read answers, and a
    saturated 2-core host would starve a restarting engine for minutes."""
    default_path: str = ""
    """The path of an answer without the proxy's path header: vllm-router sends every request prefill, then
    decode, and says nothing."""
    records: list[Record] = field(default_factory=list)
    in_flight: int = 0
    extra: dict = field(default_factory=dict)
    """Further body fields of every request (e.g. max_tokens, ignore_eos), as the references had."""

    def __post_init__(self):
        self._go = asyncio.Event()
        self._go.set()
        self._stopped = False
        self._rng = random.Random(self.seed)

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)) as session:
            await asyncio.gather(*(self._client(session) for _ in range(self.clients)))

    async def _client(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self._go.wait()
            if self._stopped:
                return
            rec = Record(len(self.records), self._rng.randrange(len(self.prompts)),
                         self._rng.choices(MODES, self.weights)[0], time.monotonic())
            self.records.append(rec)
            await self._timed(session, rec)
            await asyncio.sleep(self._rng.uniform(0, 2 * self.think_s))

    async def _timed(self, session: aiohttp.ClientSession, rec: Record) -> None:
        """One request, counted in flight meanwhile; its end time recorded whatever happens."""
        self.in_flight += 1
        try:
            await self.one(session, rec)
        finally:
            rec.end = time.monotonic()
            self.in_flight -= 1

    async def pause(self) -> None:
        """Stop sending and wait until every request in flight has ended."""
        self._go.clear()
        while self.in_flight:
            await asyncio.sleep(0.1)

    def resume(self) -> None:
        self._go.set()

    async def stop(self) -> None:
        await self.pause()
        self._stopped = True
        self._go.set()

    async def one(self, session: aiohttp.ClientSession, rec: Record) -> None:
        prompt = self.prompts[rec.prompt]
        body = completion_body(self.model, prompt.text, rec.mode != "plain", **self.extra)
        for attempt in range(CONNECT_RETRIES):
            try:
                async with session.post(f"{self.url}/v1/completions", json=body) as resp:
                    rec.status = resp.status
                    rec.first_byte = time.monotonic() - rec.start
                    rec.path = resp.headers.get(PATH_HEADER, self.default_path)
                    if resp.status != 200:
                        rec.outcome, rec.error = "error", _error_text(await resp.text())
                        return
                    tokens = await self._read(resp, rec)
                break
            except aiohttp.ClientConnectorError:  # nobody listening: the proxy is restarting
                rec.retries = attempt + 1
                await asyncio.sleep(0.5)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                rec.outcome, rec.error = "error", f"{type(exc).__name__}: {exc}"[:200]
                return
        else:
            rec.outcome, rec.error = "error", "proxy refused connections"
            return
        if rec.outcome:
            return
        rec.outcome = "answered" if tuple(tokens) == prompt.tokens else "wrong"
        if rec.outcome == "wrong":
            rec.error = f"tokens {tokens} != reference {list(prompt.tokens)}"

    async def _read(self, resp: aiohttp.ClientResponse, rec: Record) -> list[str]:
        if rec.mode == "plain":
            return (await resp.json())["choices"][0]["logprobs"]["tokens"]
        if rec.mode == "cancel":
            await resp.content.readany()
            resp.close()  # the client leaves after the first chunk
            rec.outcome = "cancelled"
            return []
        tokens: list[str] = []
        for event in await _events(resp):
            if "error" in event:
                rec.outcome, rec.error = "error", _error_text(json.dumps(event))
                return tokens
            tokens += event["choices"][0]["logprobs"]["tokens"]
        return tokens

    async def burst(self, modes: Sequence[str], timeout_s: float = CLIENT_TIMEOUT_S) -> list[Record]:
        """A crowd arriving together: one request per entry of `modes`, all at once, each on its own
        connection (no client-side pool limit), cycling through the prompts, each given `timeout_s`;
        returns their records."""
        start = time.monotonic()
        recs = [Record(len(self.records) + i, i % len(self.prompts), mode, start) for i, mode in enumerate(modes)]
        self.records += recs
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            await asyncio.gather(*(self._timed(session, rec) for rec in recs))
        return recs

    async def each_prompt_once(self) -> None:
        """Every prompt once, plain, one after the other."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)) as session:
            for i in range(len(self.prompts)):
                rec = Record(len(self.records), i, "plain", time.monotonic())
                self.records.append(rec)
                await self.one(session, rec)
                rec.end = time.monotonic()

    def summary(self) -> dict:
        counts = {o: 0 for o in ("answered", "wrong", "error", "cancelled")}
        for rec in self.records:
            if rec.outcome:
                counts[rec.outcome] += 1
        return {"requests": len(self.records), **counts, "in_flight": self.in_flight}


async def _events(resp: aiohttp.ClientResponse) -> list[dict]:
    text = (await resp.read()).decode()
    return [json.loads(e.removeprefix("data: ")) for e in re.split(r"\n\n+", text.strip())
            if e.startswith("data: ") and e != "data: [DONE]"]


def _error_text(text: str) -> str:
    try:
        error = json.loads(text)["error"]
        return f"{error.get('code')}: {error.get('message')}"[:300]
    except (ValueError, KeyError, TypeError):
        return " ".join(text.split())[:300]


async def cancel_probe(url: str, model: str, prompt: str, stream: bool, decode_running) -> float:
    """A long generation the client abandons: after the first chunk (stream), or once the decode runs
    it (plain). Returns when the client left; the caller then times the engines becoming idle."""
    body = completion_body(model, prompt, stream, max_tokens=600, ignore_eos=True)
    async with aiohttp.ClientSession() as session:
        resp_cm = session.post(f"{url}/v1/completions", json=body)
        if stream:
            async with resp_cm as resp:
                await resp.content.readany()
                left = time.monotonic()
                resp.close()
                return left
        task = asyncio.ensure_future(resp_cm)
        deadline = time.monotonic() + 60
        while not await asyncio.to_thread(decode_running):
            if time.monotonic() > deadline:
                raise RuntimeError("the decode never ran the cancel probe's request")
            await asyncio.sleep(0.2)
        left = time.monotonic()
        task.cancel()  # the client gives up: its connection closes
        try:
            await task
        except asyncio.CancelledError:
            pass
        return left
