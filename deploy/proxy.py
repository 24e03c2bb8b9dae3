"""`kvpp proxy`: an OpenAI-compatible P/D proxy speaking vLLM's disaggregation protocol.

Each completion runs twice: on a prefill instance with `max_tokens: 1` and
`kv_transfer_params: {"do_remote_decode": true}` (it computes the prompt's KV and keeps it), then on a
decode instance with the `kv_transfer_params` the prefill returned, unchanged (it pulls that KV and
generates). Instances are picked round-robin per side. A failing backend gives the client a 502
naming the backend and its reason, within bounded timeouts, instead of a hang.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import logging
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from deploy import cli_args
from deploy.processes import LOOPBACK, ManagedProcess, free_port

logger = logging.getLogger("kvpp.proxy")

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Headers passed to the backends (auth, tracing); hop-by-hop and body headers are aiohttp's business.
FORWARDED_HEADERS = ("Authorization", "traceparent", "tracestate")


@dataclass(frozen=True)
class Timeouts:
    connect: float = 10.0
    prefill: float = 600.0
    """Whole prefill request (long prompts take long)."""
    decode_read: float = 300.0
    """Longest silence between two chunks of the decode answer."""


class UpstreamError(Exception):
    """A backend failed; the message says which and why."""


class RoundRobin:
    def __init__(self, urls: Sequence[str]):
        if not urls:
            raise ValueError("need at least one backend URL")
        self.urls = [u.rstrip("/") for u in urls]
        self._cycle = itertools.cycle(self.urls)

    def next(self) -> str:
        return next(self._cycle)


def prefill_body(body: dict) -> dict:
    """The client's request turned into a KV-producing prefill: one token, no streaming."""
    req = copy.deepcopy(body)
    req["kv_transfer_params"] = {"do_remote_decode": True}
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    return req


def decode_body(body: dict, kv_transfer_params: dict) -> dict:
    req = copy.deepcopy(body)
    req["kv_transfer_params"] = kv_transfer_params
    return req


def _error(status: int, message: str, kind: str = "upstream_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class PDProxy:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str], timeouts: Timeouts = Timeouts()):
        self.prefill = RoundRobin(prefill)
        self.decode = RoundRobin(decode)
        self.timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None

    # -- app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        for path in COMPLETION_PATHS:
            app.router.add_post(path, self.handle_completion)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/v1/models", self.handle_models)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app) -> None:
        # No total limit: a decode stream may legitimately last long; reads are bounded per chunk.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=self.timeouts.connect))

    async def _stop(self, _app) -> None:
        if self._session is not None:
            await self._session.close()

    # -- handlers ------------------------------------------------------------------------------
    async def handle_health(self, request: web.Request) -> web.Response:
        """Shallow by default (the proxy is up); `?backends=1` also asks every backend's /health."""
        info = {"status": "ok", "prefill": self.prefill.urls, "decode": self.decode.urls}
        if request.query.get("backends") not in ("1", "true"):
            return web.json_response(info)
        urls = self.prefill.urls + self.decode.urls
        results = await asyncio.gather(*(self._backend_ok(u) for u in urls))
        info["backends"] = dict(zip(urls, results))
        healthy = all(r == "ok" for r in results)
        info["status"] = "ok" if healthy else "degraded"
        return web.json_response(info, status=200 if healthy else 503)

    async def _backend_ok(self, url: str) -> str:
        try:
            async with self._session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return "ok" if resp.status == 200 else f"HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"unreachable ({_reason(exc)})"

    async def handle_models(self, request: web.Request) -> web.Response:
        url = self.decode.next()
        try:
            async with self._session.get(f"{url}/v1/models", headers=_forwarded(request),
                                         timeout=aiohttp.ClientTimeout(total=30)) as resp:
                return web.Response(status=resp.status, body=await resp.read(), content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return _error(502, f"decode {url} unreachable: {_reason(exc)}")

    async def handle_completion(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        headers = {**_forwarded(request), "X-Request-Id": request.headers.get("X-Request-Id") or uuid.uuid4().hex}
        try:
            params = await self._prefill(request.path, body, headers)
        except UpstreamError as exc:
            logger.warning("%s", exc)
            return _error(502, str(exc))
        return await self._decode(request, body, params, headers)

    # -- the two legs --------------------------------------------------------------------------
    async def _prefill(self, path: str, body: dict, headers: dict) -> dict:
        url = self.prefill.next()
        timeout = aiohttp.ClientTimeout(total=self.timeouts.prefill, connect=self.timeouts.connect)
        try:
            async with self._session.post(f"{url}{path}", json=prefill_body(body), headers=headers,
                                          timeout=timeout) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise UpstreamError(f"prefill {url} answered HTTP {resp.status}: {_clip(text)}")
        except asyncio.TimeoutError:
            raise UpstreamError(f"prefill {url} timed out after {self.timeouts.prefill:g} s") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"prefill {url} unreachable: {_reason(exc)}") from None
        try:
            params = json.loads(text).get("kv_transfer_params")
        except (json.JSONDecodeError, AttributeError):
            raise UpstreamError(f"prefill {url} answered with non-JSON: {_clip(text)}") from None
        if not isinstance(params, dict):
            raise UpstreamError(
                f"prefill {url} returned no kv_transfer_params; start it with --kv-transfer-config "
                '{"kv_connector": "MooncakeConnectorV2", "kv_role": "kv_producer", ...}')
        return params

    async def _decode(self, request: web.Request, body: dict, params: dict, headers: dict) -> web.StreamResponse:
        url = self.decode.next()
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeouts.connect, sock_read=self.timeouts.decode_read)
        stream = bool(body.get("stream"))
        try:
            resp = await self._session.post(f"{url}{request.path}", json=decode_body(body, params), headers=headers,
                                            timeout=timeout)
        except asyncio.TimeoutError:
            return _error(502, f"decode {url} did not answer within {self.timeouts.decode_read:g} s")
        except aiohttp.ClientError as exc:
            return _error(502, f"decode {url} unreachable: {_reason(exc)}")
        async with resp:
            try:
                if resp.status != 200:
                    return _error(502, f"decode {url} answered HTTP {resp.status}: {_clip(await resp.text())}")
                if not stream:
                    return web.Response(status=200, body=await resp.read(), content_type="application/json")
                return await self._relay(request, resp, url)
            except asyncio.TimeoutError:
                return _error(502, f"decode {url} went silent for {self.timeouts.decode_read:g} s")
            except aiohttp.ClientError as exc:
                return _error(502, f"decode {url} failed: {_reason(exc)}")

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse, url: str) -> web.StreamResponse:
        out = web.StreamResponse(status=200, headers={"Content-Type": resp.headers.get("Content-Type",
                                                                                        "text/event-stream"),
                                                      "Cache-Control": "no-cache"})
        await out.prepare(request)
        try:
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            # Headers are gone already: tell the client in-band, the way vLLM reports stream errors.
            reason = "went silent" if isinstance(exc, asyncio.TimeoutError) else _reason(exc)
            event = {"error": {"message": f"decode {url} failed mid-stream: {reason}", "type": "upstream_error",
                               "code": 502}}
            await out.write(f"data: {json.dumps(event)}\n\n".encode())
            logger.warning("decode %s failed mid-stream: %s", url, reason)
        await out.write_eof()
        return out


def _forwarded(request: web.Request) -> dict[str, str]:
    return {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _clip(text: str, limit: int = 500) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _urls(value: str, flag: str) -> list[str]:
    urls = [u.strip() for u in value.split(",") if u.strip()]
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"{flag}: {u!r} is not an http(s) URL; write e.g. http://127.0.0.1:8100")
    if not urls:
        raise ValueError(f"{flag} needs at least one URL")
    return urls


def start_proxy(prefill_urls: Sequence[str], decode_urls: Sequence[str], log_path: Path) -> tuple[ManagedProcess, str]:
    """Run `kvpp proxy` as a managed process on a free loopback port; returns it and its URL once healthy."""
    port = free_port()
    proc = ManagedProcess("kvpp-proxy", [sys.executable, "-m", "deploy.cli", "proxy",
                                         "--prefill", ",".join(prefill_urls), "--decode", ",".join(decode_urls),
                                         "--port", str(port)], log_path).start()
    url = f"http://{LOOPBACK}:{port}"
    try:
        proc.wait_http(f"{url}/health", timeout=60)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "proxy", help="OpenAI-compatible P/D proxy: prefill with KV export, then decode with the KV",
        description="Serves /v1/completions and /v1/chat/completions (streaming too), /v1/models and /health "
        "(?backends=1 also probes the backends). Prefill and decode instances are used round-robin.",
    )
    p.add_argument("--prefill", type=cli_args.url_list, required=True, metavar="URL[,URL]",
                   help="prefill instance base URL(s)")
    p.add_argument("--decode", type=cli_args.url_list, required=True, metavar="URL[,URL]",
                   help="decode instance base URL(s)")
    p.add_argument("--host", type=cli_args.host, default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=cli_args.port, required=True)
    p.add_argument("--connect-timeout", type=cli_args.seconds, default=Timeouts.connect, metavar="S")
    p.add_argument("--prefill-timeout", type=cli_args.seconds, default=Timeouts.prefill, metavar="S",
                   help=f"whole prefill request (default {Timeouts.prefill:.0f})")
    p.add_argument("--decode-timeout", type=cli_args.seconds, default=Timeouts.decode_read, metavar="S",
                   help=f"longest silence while reading the decode answer (default {Timeouts.decode_read:.0f})")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    prefill, decode = _urls(args.prefill, "--prefill"), _urls(args.decode, "--decode")
    for name in ("connect_timeout", "prefill_timeout", "decode_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kvpp-proxy %(levelname)s %(message)s")
    timeouts = Timeouts(args.connect_timeout, args.prefill_timeout, args.decode_timeout)
    proxy = PDProxy(prefill, decode, timeouts)
    logger.info("P/D proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port, prefill, decode)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0
