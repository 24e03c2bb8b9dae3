"""Stub vLLM engines (aiohttp on loopback) and a `kvpp proxy` in front of them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import aiohttp
from aiohttp import web

from deploy.services.ports import free_port
from deploy.services.proxy import Limits, PDProxy, Timeouts


LOOP = "127.0.0.1"


WORDS = ["alpha", "beta", "gamma"]


REQUEST = {"model": "tiny", "prompt": "the cache", "max_tokens": 16, "temperature": 0}


HUGE = 64 << 10
"""Bytes of a "huge" answer."""


SLOW_STREAM_S = 1.5
"""How long a "slow_stream" answer takes."""


def stub_tokens(prompt: str) -> list[int]:
    """How a Stub tokenizes: one token per character."""
    return [ord(c) for c in prompt]


class Stub:
    """A backend that serves like a vLLM engine and records what it receives; `mode` selects a failure.

    A request with `kv_transfer_params.do_remote_decode` gets a prefill answer; any other gets a full
    answer, streamed when asked (every instance is a full engine); a "slow_stream" backend takes
    SLOW_STREAM_S over it, a "huge" one answers HUGE bytes; a "drop_reused" one closes a connection
    when a second request comes on it, unread (what vLLM's keep-alive timeout does to an idle connection
    just as a request comes), and counts that in `dropped`. Handlers are cancelled when the proxy drops
    the connection, as vLLM aborts a request whose client left; `cancelled` records that.
    """

    def __init__(self, name, mode="ok"):
        self.name, self.mode = name, mode
        self.requests, self.cancelled = [], []
        self.tokenized = 0
        self.dropped, self._served_on = 0, set()
        self.port = free_port()
        self.url = f"http://{LOOP}:{self.port}"

    async def start(self):
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, LOOP, self.port).start()
        return self

    async def health(self, request):
        return web.json_response({}, status=200 if self.mode == "ok" else 503)

    async def tokenize(self, request):
        """One token per character (its code point); a "no_tokenize" backend answers 500."""
        self.tokenized += 1
        if self.mode == "no_tokenize":
            return web.json_response({"error": {"message": "no"}}, status=500)
        return web.json_response({"tokens": stub_tokens((await request.json())["prompt"])})

    async def complete(self, request):
        if self.mode == "drop_reused":
            if request.transport in self._served_on:
                self.dropped += 1
                request.transport.abort()
                await asyncio.sleep(1)
            self._served_on.add(request.transport)
        body = await request.json()
        self.requests.append({"body": body, "request_id": request.headers.get("X-Request-Id"),
                              "auth": request.headers.get("Authorization")})
        try:
            return await self._answer(request, body)
        except asyncio.CancelledError:
            self.cancelled.append(time.monotonic())
            raise

    async def _answer(self, request, body):
        if self.mode == "fail":
            return web.json_response({"error": {"message": "secret internal trace"}}, status=500)
        if self.mode == "reject":
            return web.json_response({"error": {"message": "prompt too long", "type": "BadRequestError",
                                                "code": 400}}, status=400)
        if self.mode == "reset":
            request.transport.close()  # the process vanished before answering
            await asyncio.sleep(1)
        if self.mode == "hang":
            await asyncio.sleep(30)
        if self.mode == "huge":  # a runaway answer, its size announced
            return web.json_response({"choices": [{"text": "x" * HUGE}]})
        if self.mode == "huge_chunked":  # the same, chunked: no size announced
            out = web.StreamResponse(headers={"Content-Type": "application/json"})
            await out.prepare(request)
            for _ in range(HUGE // 1024):
                await out.write(b" " * 1024)
            await out.write_eof()
            return out
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            params = None if self.mode == "no_params" else {
                "remote_host": LOOP, "remote_port": 37000, "remote_engine_id": self.name,
                "remote_block_ids": [3, 4, 5], "remote_request_id": request.headers.get("X-Request-Id")}
            return web.json_response({"choices": [{"text": "x", "index": 0}], "kv_transfer_params": params})
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": " ".join(WORDS), "index": 0, "logprobs": {"tokens": WORDS}}],
                                      "served_by": self.name, "got_kv_transfer_params": body.get("kv_transfer_params")})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i, word in enumerate(WORDS * (1000 if self.mode == "endless_stream" else 1)):
            event = {"choices": [{"text": word, "index": 0, "logprobs": {"tokens": [word]}}], "served_by": self.name}
            await out.write(f"data: {json.dumps(event)}\n\n".encode())
            if self.mode == "die_mid_stream" and i == 0:
                request.transport.close()  # the decode process vanishes after one token
                return out
            if self.mode == "stall_mid_stream" and i == 0:
                await asyncio.sleep(2)
            if self.mode == "endless_stream":
                await asyncio.sleep(0.1)
            if self.mode == "slow_stream":  # a long answer: the stream stays open for a while
                await asyncio.sleep(SLOW_STREAM_S / len(WORDS))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def stop(self):
        await self.runner.cleanup()


async def serve_proxy(proxy):
    runner = proxy.runner()
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, LOOP, port).start()
    return runner, f"http://{LOOP}:{port}"


async def with_proxy(prefills, decodes, body_fn, timeouts=Timeouts(), limits=Limits(), routing=None):
    """Run `body_fn(session, proxy_url, proxy)` against a proxy in front of the given stubs / URLs."""
    stubs = [s for s in prefills + decodes if isinstance(s, Stub)]
    for s in stubs:
        await s.start()
    proxy = PDProxy([getattr(s, "url", s) for s in prefills], [getattr(s, "url", s) for s in decodes],
                    timeouts, limits, routing)
    runner, url = await serve_proxy(proxy)
    try:
        async with aiohttp.ClientSession() as session:
            return await body_fn(session, url, proxy)
    finally:
        await runner.cleanup()
        for s in stubs:
            await s.stop()


@contextlib.contextmanager
def stubs_in_thread(*names: str):
    """Stubs serving from an event loop of their own, for tests whose client or front is a real process."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stubs = [asyncio.run_coroutine_threadsafe(Stub(name).start(), loop).result(10) for name in names]
    try:
        yield stubs
    finally:
        for stub in stubs:
            asyncio.run_coroutine_threadsafe(stub.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
