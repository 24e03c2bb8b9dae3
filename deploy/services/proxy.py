"""`kvpp proxy`: an OpenAI-compatible P/D proxy speaking vLLM's disaggregation protocol.

Each completion normally runs twice: on a prefill instance with `max_tokens: 1` and
`kv_transfer_params: {"do_remote_decode": true}` (it computes the prompt's KV and keeps it), then on a
decode instance with the `kv_transfer_params` the prefill returned, unchanged (it pulls that KV and
generates). Instances are picked round-robin per role; with `routing` (`--kv-events`) a request's prefill
leg goes first to the instance where its cached prefix, net of the load queued there, leaves the least to
compute (deploy/services/routing.py), and asks vLLM to announce its cache hits again (a full report).

The proxy's own ceiling is `Limits.max_in_flight` completions at once: beyond it a client gets an
OpenAI-style 429 with `Retry-After` at once, and no instance is ever blamed for the proxy's own
saturation (the connection pool is as large as the cap, and waiting for a pool slot is not a connect
timeout). Client bodies must arrive within `Timeouts.body_read`, and a non-streamed answer larger
than `Limits.max_upstream_bytes` is refused as that instance's failure.

An outage of one role costs latency, not errors: every instance is a full engine, so when no prefill
answers the request goes to a decode as a plain request (it computes its own prompt), and when no
decode answers a prefill serves the whole request. A failed instance leaves the rotation until its
/health answers again. Only a stream that already reached the client cannot move; it ends with an
in-band error event. A client that disconnects cancels both legs: closing the upstream connection
is what makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import resource
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from connectors.common.hosts import host_url

from deploy.services.event_stream import run_streams
from deploy.services.ports import free_port
from deploy.services.processes import LOOPBACK, ManagedProcess
from deploy.services.routing import FULL_REPORT, Leg, PrefixRouter, PrefixRouting

logger = logging.getLogger("kvpp.proxy")

COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Headers passed to the backends (auth, tracing); hop-by-hop and body headers are aiohttp's business.
FORWARDED_HEADERS = ("Authorization", "traceparent", "tracestate")
# Outcomes counted on /metrics: the path an answered request took, or why it was not answered.
PATHS = ("pd", "decode_only", "prefill_only", "failed", "cancelled", "rejected", "overloaded")
PATH_HEADER = "X-Kvpp-Path"  # on every answer: pd, decode_only or prefill_only
PREFILL_HEADER = "X-Kvpp-Prefill"  # on a pd answer: the prefill instance that computed the prompt
FAILED_MID_STREAM = web.ResponseKey("kvpp_failed_mid_stream", bool)  # marks a relayed stream that ended with an error event


@dataclass(frozen=True)
class Timeouts:
    connect: float = 10.0
    prefill: float = 600.0
    """Whole prefill request (long prompts take long); a prefill silent this long is given up."""
    decode_read: float = 300.0
    """Longest silence between two chunks of an answer (before the first one too)."""
    probe: float = 1.0
    """Seconds between /health probes of instances out of rotation."""
    body_read: float = 30.0
    """Longest a client may take to send its request body (a slow sender then gets a 408)."""
    keepalive: float = 2.0
    """An idle upstream connection is closed after this, before vLLM closes it under a new request
    (its VLLM_HTTP_TIMEOUT_KEEP_ALIVE is 5 s)."""


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 << 20
    """Large enough for a long prompt as text or token ids; larger bodies get a 413."""
    max_depth: int = 32
    """JSON nesting allowed in a request (chat content parts need about 5)."""
    max_in_flight: int = 1024
    """Completions served at once (body reads included); beyond it a client gets a 429."""
    max_upstream_bytes: int = 64 << 20
    """Largest non-streamed answer read from an instance (a prefill's, a whole completion's)."""
    retry_after_s: int = 1
    """What a 429 tells the client to wait before trying again."""

    @property
    def connections(self) -> int:
        """Upstream connections the proxy may hold: one per completion in flight (its legs run one after
        the other), plus room for /v1/models and /health?backends=1."""
        return self.max_in_flight + CONTROL_CONNECTIONS

    @property
    def file_descriptors(self) -> int:
        """What serving at the cap needs: each completion's client and upstream socket, plus slack."""
        return 2 * self.connections + 64


CONTROL_CONNECTIONS = 64
PROBE_CONNECTIONS = 16
"""The /health prober's own pool: it must reach an instance even while every completion slot is taken."""
EVENTS_RESTART_S = 1.0
"""How long after the task running the KV event streams ended it is started again."""


class BackendFailure(Exception):
    """One instance failed to serve a request before anything reached the client."""

    def __init__(self, backend: Backend, reason: str, reached: bool = True):
        super().__init__(f"{backend.role} {backend.url}: {reason}")
        self.backend, self.reason = backend, reason
        self.reached = reached
        """False when the request never got to the instance (connection refused): safe to resend as is."""


class ClientLeft(Exception):
    """Writing to the client failed: it disconnected (not the backend's fault)."""


class Rejected(Exception):
    """An instance refused the request itself (HTTP 4xx): the client's problem, relayed as is."""

    def __init__(self, status: int, body: bytes):
        super().__init__(status)
        self.status, self.body = status, body


class Backend:
    def __init__(self, role: str, url: str):
        self.role, self.url = role, url.rstrip("/")
        self.up = True
        self.reason = ""
        self.failures = 0
        self.queued_tokens = 0
        """Prompt tokens this proxy's prefill legs in flight on the instance compute (the cache-aware policy's
        load)."""


class Rotation:
    """The instances of one role, used round-robin; a failed one stays out until its /health answers."""

    def __init__(self, role: str, urls: Sequence[str]):
        if not urls:
            raise ValueError(f"need at least one {role} backend URL")
        self.role = role
        self.backends = [Backend(role, u) for u in urls]
        self._next = 0

    @property
    def urls(self) -> list[str]:
        return [b.url for b in self.backends]

    def order(self) -> list[Backend]:
        """The instances in rotation, starting with the one whose turn it is."""
        start = self._next
        self._next = (start + 1) % len(self.backends)
        return [b for b in self.backends[start:] + self.backends[:start] if b.up]

    def mark_failed(self, failure: BackendFailure) -> None:
        b = failure.backend
        b.failures += 1
        b.reason = failure.reason
        if b.up:
            b.up = False
            logger.warning("%s %s out of rotation: %s", b.role, b.url, failure.reason)

    def down(self) -> list[Backend]:
        return [b for b in self.backends if not b.up]


def prefill_body(body: dict, full_report: bool = False) -> dict:
    """The client's request turned into a KV-producing prefill: one token, no streaming; with `full_report`, the
    prefill announces again the cached blocks the request hits (vLLM's `kv_cache_report_mode`)."""
    req = plain_body(body)
    req["kv_transfer_params"] = {"do_remote_decode": True}
    if full_report:
        xargs = req.get("vllm_xargs")
        req["vllm_xargs"] = {**(xargs if isinstance(xargs, dict) else {}), **FULL_REPORT}
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    return req


def decode_body(body: dict, kv_transfer_params: dict) -> dict:
    return {**plain_body(body), "kv_transfer_params": kv_transfer_params}


def plain_body(body: dict) -> dict:
    """The request as one engine computes it alone; transfer parameters are the proxy's to set."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


def _error(status: int, message: str, kind: str = "upstream_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _too_deep(value, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth + 1 > limit:
                    return True
                stack.append((child, depth + 1))
    return False


class PDProxy:
    def __init__(self, prefill: Sequence[str], decode: Sequence[str], timeouts: Timeouts = Timeouts(),
                 limits: Limits = Limits(), routing: PrefixRouting | None = None):
        self.prefill = Rotation("prefill", prefill)
        self.decode = Rotation("decode", decode)
        self.timeouts, self.limits = timeouts, limits
        self.registry = CollectorRegistry()
        self.router = PrefixRouter(self.prefill.backends, routing, self.registry) if routing else None
        self._events: asyncio.Task | None = None
        self.outcomes: collections.Counter[str] = collections.Counter({p: 0 for p in PATHS})
        self.in_flight = 0
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self._probe_session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task | None = None

    # -- app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes)
        for path in COMPLETION_PATHS:
            app.router.add_post(path, self.handle_completion)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/v1/models", self.handle_models)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    def runner(self) -> web.AppRunner:
        """The app served so that a client's disconnect cancels its handler (and so both legs)."""
        return web.AppRunner(self.app(), handler_cancellation=True, access_log=None)

    async def _start(self, _app) -> None:
        # No total limit: a decode stream may legitimately last long; reads are bounded per chunk. The pool
        # holds a connection for every completion the proxy admits, and only the socket connect counts
        # against the connect timeout: waiting for a pool slot must never pass for an instance's failure.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(
            limit=self.limits.connections, limit_per_host=0, keepalive_timeout=self.timeouts.keepalive))
        # For the one resend of a request whose pooled connection turned out closed (see _post).
        self._fresh = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(
            limit=self.limits.connections, limit_per_host=0, force_close=True))
        self._prober = asyncio.create_task(self._probe_loop())
        if self.router is not None:
            self._events = asyncio.create_task(self._follow_events())

    async def _stop(self, _app) -> None:
        tasks = [task for task in (self._prober, self._events) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for session in (self._session, self._fresh, self._probe_session):
            if session is not None:
                await session.close()

    async def _follow_events(self) -> None:
        """Run every prefill's KV event stream; should that task end for any reason, log it loudly, count it and
        start it again. Whatever the streams were doing may be half done: every index is emptied and marked not
        followed, and with a replay endpoint rebuilt (and trusted) by the first sync of the new task."""
        streams = list(self.router.streams.values())
        while True:
            error: Exception | None = None
            try:
                await run_streams(streams)
            except Exception as exc:
                error = exc
            why = "it returned" if error is None else _reason(error)
            self.router.metrics.restarts.inc()
            logger.error("the KV event streams' task ended (%s): no prefill's index is followed until it starts "
                         "again in %g s", why, EVENTS_RESTART_S, exc_info=error)
            for stream in streams:
                stream.interrupted(f"the event streams' task ended ({why}), starting again in {EVENTS_RESTART_S:g} s")
            await asyncio.sleep(EVENTS_RESTART_S)

    def _probe_client(self) -> aiohttp.ClientSession:
        if self._probe_session is None or self._probe_session.closed:
            self._probe_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=PROBE_CONNECTIONS))
        return self._probe_session

    async def _probe_loop(self) -> None:
        """Put failed instances back into rotation once their /health answers 200; a round that fails
        in any way is logged and the next one starts on a fresh session (the prober never dies)."""
        while True:
            await asyncio.sleep(self.timeouts.probe)
            try:
                await self._probe_round()
            except Exception as exc:
                logger.warning("health probe round failed (%s); probing again on a new session", _reason(exc))
                if self._probe_session is not None:
                    await self._probe_session.close()
                self._probe_session = None

    async def _probe_round(self) -> None:
        down = self.prefill.down() + self.decode.down()
        session = self._probe_client()
        results = await asyncio.gather(*(self._backend_ok(b.url, session) for b in down))
        for b, result in zip(down, results):
            if result == "ok":
                b.up, b.reason = True, ""
                logger.info("%s %s back in rotation", b.role, b.url)

    # -- handlers ------------------------------------------------------------------------------
    async def handle_health(self, request: web.Request) -> web.Response:
        """Shallow by default (the proxy is up); `?backends=1` also asks every backend's /health and, with
        `--kv-events`, says for each prefill whether its index is followed, or why not (it is then routed by load;
        the proxy still serves, so this alone does not make the answer a 503)."""
        info = {"status": "ok", "prefill": self.prefill.urls, "decode": self.decode.urls}
        if request.query.get("backends") not in ("1", "true"):
            return web.json_response(info)
        urls = self.prefill.urls + self.decode.urls
        results = await asyncio.gather(*(self._backend_ok(u) for u in urls))
        info["backends"] = dict(zip(urls, results))
        if self.router is not None:
            info["kv_indexes"] = {url: stream.health() for url, stream in self.router.streams.items()}
        healthy = all(r == "ok" for r in results)
        info["status"] = "ok" if healthy else "degraded"
        return web.json_response(info, status=200 if healthy else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        """Prometheus text: requests by the path they took, in flight, and each instance's state."""
        lines = ["# HELP kvpp_proxy_requests_total Completions by outcome: the path an answer took "
                 "(pd, decode_only, prefill_only) or failed, cancelled (client left), rejected (bad request), "
                 "overloaded (429: max_in_flight reached).",
                 "# TYPE kvpp_proxy_requests_total counter"]
        lines += [f'kvpp_proxy_requests_total{{path="{p}"}} {self.outcomes[p]}' for p in PATHS]
        lines += ["# HELP kvpp_proxy_requests_in_flight Completions being served.",
                  "# TYPE kvpp_proxy_requests_in_flight gauge", f"kvpp_proxy_requests_in_flight {self.in_flight}"]
        backends = self.prefill.backends + self.decode.backends
        lines += ["# HELP kvpp_proxy_backend_up 1 while the instance is in rotation.",
                  "# TYPE kvpp_proxy_backend_up gauge"]
        lines += [f'kvpp_proxy_backend_up{{role="{b.role}",backend="{b.url}"}} {int(b.up)}' for b in backends]
        if self.router is not None:
            lines += ["# HELP kvpp_proxy_prefill_queued_tokens Prompt tokens this proxy's prefill legs in flight on "
                      "the instance compute (the cache-aware choice's load).",
                      "# TYPE kvpp_proxy_prefill_queued_tokens gauge"]
            lines += [f'kvpp_proxy_prefill_queued_tokens{{backend="{b.url}"}} {b.queued_tokens}'
                      for b in self.prefill.backends]
        lines += ["# HELP kvpp_proxy_backend_failures_total Requests an instance failed to serve.",
                  "# TYPE kvpp_proxy_backend_failures_total counter"]
        lines += [f'kvpp_proxy_backend_failures_total{{role="{b.role}",backend="{b.url}"}} {b.failures}'
                  for b in backends]
        text = "\n".join(lines) + "\n" + generate_latest(self.registry).decode()
        return web.Response(text=text, content_type="text/plain")

    async def _backend_ok(self, url: str, session: aiohttp.ClientSession | None = None) -> str:
        try:
            async with (session or self._session).get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return "ok" if resp.status == 200 else f"HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"unreachable ({_reason(exc)})"

    async def handle_models(self, request: web.Request) -> web.Response:
        reasons = []
        for b in self.decode.order() + self.prefill.order():
            try:
                async with self._session.get(f"{b.url}/v1/models", headers=_forwarded(request),
                                             timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    if resp.status < 500:
                        return web.Response(status=resp.status, body=await self._read_upstream(b, resp),
                                            content_type="application/json")
                    reasons.append(f"{b.role} {b.url}: HTTP {resp.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                reasons.append(f"{b.role} {b.url}: unreachable ({_reason(exc)})")
            except BackendFailure as failure:
                reasons.append(str(failure))
        return _error(502, "no backend answered: " + ("; ".join(reasons) or "none in rotation"))

    async def handle_completion(self, request: web.Request) -> web.StreamResponse:
        if self.in_flight >= self.limits.max_in_flight:
            return self._overloaded(request)
        self.in_flight += 1  # from the first byte of the body on: a slow sender holds a slot too
        try:
            return await self._complete(request)
        finally:
            self.in_flight -= 1

    def _overloaded(self, request: web.Request) -> web.Response:
        """The proxy's own ceiling: the client retries later; no instance is blamed."""
        self.outcomes["overloaded"] += 1
        logger.debug("refused %s from %s: %d completions in flight", request.path, request.remote, self.in_flight)
        response = _error(429, f"the proxy is serving its limit of {self.limits.max_in_flight} requests; "
                          f"retry after {self.limits.retry_after_s} s", "rate_limit_exceeded")
        response.headers["Retry-After"] = str(self.limits.retry_after_s)
        response.force_close()  # the body was not read: the connection cannot carry another request
        return response

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            self.outcomes["rejected"] += 1
            return body
        headers = {**_forwarded(request), "X-Request-Id": request.headers.get("X-Request-Id") or uuid.uuid4().hex}
        try:
            response, outcome = await self._route(request, body, headers)
            outcome = "failed" if response.get(FAILED_MID_STREAM) else outcome
        except (asyncio.CancelledError, ClientLeft) as exc:
            # The client went away; leaving the upstream `async with` blocks closed both connections.
            self.outcomes["cancelled"] += 1
            logger.info("client left %s %s: upstream requests closed", request.path, headers["X-Request-Id"])
            if isinstance(exc, asyncio.CancelledError):
                raise
            return web.Response(status=499)  # never sent: the connection is gone
        self.outcomes[outcome] += 1
        return response

    async def _read_body(self, request: web.Request) -> dict | web.Response:
        """The request as a JSON object, or an OpenAI-style error (logged as one short line)."""
        try:
            async with asyncio.timeout(self.timeouts.body_read):
                data = await request.read()
        except TimeoutError:
            rejected = self._reject(request, 408, f"request body not received within {self.timeouts.body_read:g} s")
            rejected.force_close()
            return rejected
        except web.HTTPRequestEntityTooLarge:
            return self._reject(request, 413, f"request body larger than {self.limits.max_body_bytes} bytes")
        try:
            body = json.loads(data)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return self._reject(request, 400, "request body is not valid JSON")
        except RecursionError:  # the parser itself gave up on the nesting
            return self._reject(request, 400, f"request body nests deeper than {self.limits.max_depth} levels")
        if not isinstance(body, dict):
            return self._reject(request, 400, "request body must be a JSON object")
        if _too_deep(body, self.limits.max_depth):
            return self._reject(request, 400, f"request body nests deeper than {self.limits.max_depth} levels")
        return body

    def _reject(self, request: web.Request, status: int, message: str) -> web.Response:
        logger.info("rejected %s from %s: %s", request.path, request.remote, message)
        return _error(status, message, "invalid_request_error")

    # -- routing -------------------------------------------------------------------------------
    async def _route(self, request: web.Request, body: dict, headers: dict) -> tuple[web.StreamResponse, str]:
        """Serve by P/D when both roles answer, else by whichever role does; returns the answer and its path."""
        prefills, decodes = self.prefill.order(), self.decode.order()
        if not prefills and not decodes:  # every instance failed lately: try them all rather than refuse
            prefills, decodes = list(self.prefill.backends), list(self.decode.backends)
        failures: list[BackendFailure] = []
        stream = body.get("stream") is True
        try:
            params = prefilled = None
            if decodes:  # without a decode there is no one to hand the KV to
                for leg in await self._prefill_order(request.path, body, prefills):
                    try:
                        params, prefilled = await self._prefill(leg, request.path, body, headers), leg.backend
                        break
                    except BackendFailure as failure:
                        failures.append(self._failed(failure))
            for b in decodes:
                # A resend elsewhere pulls the same blocks only if the first decode never got the request.
                send, path = (decode_body(body, params), "pd") if params is not None else (plain_body(body),
                                                                                          "decode_only")
                tag = {PREFILL_HEADER: prefilled.url} if params is not None else {}
                try:
                    return await self._serve(request, b, send, headers, stream, path, tag), path
                except BackendFailure as failure:
                    failures.append(self._failed(failure))
                    params = params if not failure.reached else None
            for b in self.prefill.order() if decodes else prefills:
                try:
                    return await self._serve(request, b, plain_body(body), headers, stream, "prefill_only"), \
                        "prefill_only"
                except BackendFailure as failure:
                    failures.append(self._failed(failure))
        except Rejected as rejected:
            return web.Response(status=rejected.status, body=rejected.body, content_type="application/json"), \
                "rejected"
        reasons = "; ".join(str(f) for f in failures) or "no instance in rotation"
        return _error(502, f"no backend could serve the request: {reasons}"), "failed"

    def _failed(self, failure: BackendFailure) -> BackendFailure:
        (self.prefill if failure.backend.role == "prefill" else self.decode).mark_failed(failure)
        if self.router is not None and failure.backend.role == "prefill":
            self.router.forget(failure.backend.url)  # it may come back restarted, its cache empty
        return failure

    async def _prefill_order(self, path: str, body: dict, order: list[Backend]) -> list[Leg]:
        """The prefills to try, in order: the rotation's, or with the cache-aware policy the cheapest first."""
        if self.router is None or not order:
            return [Leg(b, 0) for b in order]
        return await self.router.legs(self._session, path, body, order)

    async def _prefill(self, leg: Leg, path: str, body: dict, headers: dict) -> dict:
        backend = leg.backend
        timeout = aiohttp.ClientTimeout(total=self.timeouts.prefill, connect=self.timeouts.connect)
        backend.queued_tokens += leg.tokens
        try:
            async with await self._post(backend, path, prefill_body(body, self.router is not None), headers,
                                        timeout) as resp:
                data = await self._read_upstream(backend, resp)
                _check_status(backend, resp.status, data)
        except asyncio.TimeoutError:
            raise BackendFailure(backend, f"no answer within {self.timeouts.prefill:g} s") from None
        except aiohttp.ClientError as exc:
            raise _connection_failure(backend, exc) from None
        finally:
            backend.queued_tokens -= leg.tokens
        try:
            params = json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError):
            raise BackendFailure(backend, "answered with a body that is not a JSON object") from None
        if not isinstance(params, dict):
            raise BackendFailure(backend, "returned no kv_transfer_params; start it with --kv-transfer-config "
                                 '{"kv_connector": "MooncakeConnectorV2", "kv_role": "kv_producer", ...}')
        return params

    async def _serve(self, request: web.Request, backend: Backend, body: dict, headers: dict, stream: bool,
                     path: str, tag: dict[str, str] | None = None) -> web.StreamResponse:
        """One instance answers the client, told the path taken in PATH_HEADER (and `tag`'s headers). Raises
        BackendFailure while nothing has reached the client."""
        tag = {PATH_HEADER: path, **(tag or {})}
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeouts.connect, sock_read=self.timeouts.decode_read)
        silent = f"no answer within {self.timeouts.decode_read:g} s"
        try:
            resp = await self._post(backend, request.path, body, headers, timeout)
        except asyncio.TimeoutError:
            raise BackendFailure(backend, silent) from None
        except aiohttp.ClientError as exc:
            raise _connection_failure(backend, exc) from None
        try:
            try:
                if not stream:
                    data = await self._read_upstream(backend, resp)
                    _check_status(backend, resp.status, data)
                    out = web.Response(status=200, body=data, content_type="application/json", headers=tag)
                    resp.release()
                    return out
                if resp.status != 200:
                    _check_status(backend, resp.status, await self._read_upstream(backend, resp))
                first = await resp.content.readany()
                if not first:
                    raise BackendFailure(backend, "closed the stream before sending anything")
            except asyncio.TimeoutError:
                raise BackendFailure(backend, silent) from None
            except aiohttp.ClientError as exc:
                raise BackendFailure(backend, f"failed while answering ({_reason(exc)})") from None
            return await self._relay(request, resp, backend, first, tag)
        finally:
            resp.close()  # a no-op after release(); otherwise it cuts the connection, which aborts the request

    async def _post(self, backend: Backend, path: str, body: dict, headers: dict,
                    timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        """POST to `backend`, on a pooled connection. One the instance closed while it sat idle fails
        before any answer (it closes idle ones after its keep-alive, and all at once on waking from a
        stall): the request then goes once more on a new connection before the instance is blamed.
        aiohttp resends only idempotent methods so; a completion whose answer reached no one is safe
        to run again."""
        url = f"{backend.url}{path}"
        try:
            return await self._session.post(url, json=body, headers=headers, timeout=timeout)
        except aiohttp.ClientConnectorError:
            raise  # no connection at all: nothing stale to blame
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientConnectionResetError) as exc:
            first = _reason(exc)
        logger.info("%s %s closed the connection under a request (%s): sending it again on a new connection",
                    backend.role, backend.url, first)
        try:
            return await self._fresh.post(url, json=body, headers=headers, timeout=timeout)
        except aiohttp.ClientError as exc:
            raise BackendFailure(backend, f"connection lost ({first}; again on a new connection: {_reason(exc)})") \
                from None

    async def _read_upstream(self, backend: Backend, resp: aiohttp.ClientResponse) -> bytes:
        """A whole answer body, refused as the instance's failure past `max_upstream_bytes` (announced
        or read): one runaway instance cannot make the proxy buffer without bound."""
        limit = self.limits.max_upstream_bytes
        too_big = f"answered with a body over {limit} bytes"
        if (resp.content_length or 0) > limit:
            raise BackendFailure(backend, too_big)
        chunks, size = [], 0
        async for chunk in resp.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise BackendFailure(backend, too_big)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _relay(self, request: web.Request, resp: aiohttp.ClientResponse, backend: Backend,
                     first: bytes, tag: dict[str, str]) -> web.StreamResponse:
        out = web.StreamResponse(status=200, headers={
            "Content-Type": resp.headers.get("Content-Type", "text/event-stream"), "Cache-Control": "no-cache",
            **tag})
        await _to_client(out.prepare(request))
        await _to_client(out.write(first))
        try:
            async for chunk in resp.content.iter_any():
                await _to_client(out.write(chunk))
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            # Headers are gone already: tell the client in-band, the way vLLM reports stream errors.
            reason = "went silent" if isinstance(exc, asyncio.TimeoutError) else _reason(exc)
            self._failed(BackendFailure(backend, f"failed mid-stream ({reason})"))
            event = {"error": {"message": f"{backend.role} {backend.url} failed mid-stream: {reason}",
                               "type": "upstream_error", "code": 502}}
            out[FAILED_MID_STREAM] = True
            await _to_client(out.write(f"data: {json.dumps(event)}\n\n".encode()))
        await _to_client(out.write_eof())
        return out


async def _to_client(write) -> None:
    """Await a write to the client; its disconnect must not pass for the backend's failure."""
    try:
        await write
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one too
        raise ClientLeft() from None


def _check_status(backend: Backend, status: int, data: bytes) -> None:
    if 400 <= status < 500:
        raise Rejected(status, data)
    if status != 200:
        raise BackendFailure(backend, f"answered HTTP {status}")


def _connection_failure(backend: Backend, exc: aiohttp.ClientError) -> BackendFailure:
    reached = not isinstance(exc, aiohttp.ClientConnectorError)
    return BackendFailure(backend, f"{'connection lost' if reached else 'unreachable'} ({_reason(exc)})", reached)


def _forwarded(request: web.Request) -> dict[str, str]:
    return {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def start_proxy(prefill_urls: Sequence[str], decode_urls: Sequence[str], log_path: Path, port: int | None = None,
                extra_args: Sequence[str] = ()) -> tuple[ManagedProcess, str]:
    """Run `kvpp proxy` as a managed process on loopback (a free port unless given); returns it and its
    URL once healthy."""
    port = port or free_port()
    proc = ManagedProcess("kvpp-proxy", [sys.executable, "-m", "deploy.cli.main", "proxy",
                                         "--prefill", ",".join(prefill_urls), "--decode", ",".join(decode_urls),
                                         "--port", str(port), *extra_args], log_path).start()
    url = f"http://{LOOPBACK}:{port}"
    try:
        proc.wait_http(f"{url}/health", timeout=60)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def _open_files_for(limits: Limits) -> None:
    """Raise this process's open-file limit to what serving `max_in_flight` completions needs (up to the
    hard limit); refuse to start, naming the option, where even that is too low."""
    need = limits.file_descriptors
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ValueError(f"--max-in-flight {limits.max_in_flight} needs {need} open files, but this process "
                             f"may open only {hard} (ulimit -Hn): lower --max-in-flight or raise the limit")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def serve(prefill: Sequence[str], decode: Sequence[str], host: str, port: int, timeouts: Timeouts,
          limits: Limits, routing: PrefixRouting | None = None) -> None:
    """What `kvpp proxy` runs: the proxy on host:port until interrupted, this process allowed the open files
    `limits` need."""
    _open_files_for(limits)
    proxy = PDProxy(prefill, decode, timeouts, limits, routing)
    logger.info("P/D proxy on %s: prefill %s, decode %s, prefills chosen by %s", host_url("http", host, port),
                prefill, decode, f"cached prefix (KV events {', '.join(routing.endpoints)})" if routing else "turn")
    # asyncio binds "::" IPv6-only; listen on IPv4 too, as vLLM's own "::" listener (a dual-stack socket) does.
    hosts = [host, "0.0.0.0"] if host == "::" else host
    web.run_app(proxy.app(), host=hosts, port=port, print=None, access_log=None, handler_cancellation=True)
