"""`kvpp proxy` against real HTTP stub backends: protocol shape, streaming, round-robin, failures."""

import asyncio
import json
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from deploy.processes import ManagedProcess, free_port
from deploy.proxy import PDProxy, Timeouts, decode_body, prefill_body

LOOP = "127.0.0.1"


class Stub:
    """A backend that records what it receives; `mode` selects a failure."""

    def __init__(self, role, name, mode="ok"):
        self.role, self.name, self.mode = role, name, mode
        self.requests = []
        self.port = free_port()
        self.url = f"http://{LOOP}:{self.port}"

    async def start(self):
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, LOOP, self.port).start()
        return self

    async def health(self, request):
        return web.json_response({})

    async def complete(self, request):
        body = await request.json()
        self.requests.append({"body": body, "request_id": request.headers.get("X-Request-Id"),
                              "auth": request.headers.get("Authorization")})
        if self.mode == "fail":
            return web.json_response({"error": {"message": "KV cache is full"}}, status=500)
        if self.mode == "slow":
            await asyncio.sleep(2)
        if self.role == "prefill":
            params = None if self.mode == "no_params" else {
                "remote_host": LOOP, "remote_port": 37000, "remote_engine_id": self.name,
                "remote_block_ids": [3, 4, 5], "remote_request_id": request.headers.get("X-Request-Id")}
            return web.json_response({"choices": [{"text": "x", "index": 0}], "kv_transfer_params": params})
        words = ["alpha", "beta", "gamma"]
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": " ".join(words), "index": 0}], "served_by": self.name,
                                      "got_kv_transfer_params": body.get("kv_transfer_params")})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i, word in enumerate(words):
            await out.write(f"data: {json.dumps({'choices': [{'text': word, 'index': 0}]})}\n\n".encode())
            if self.mode == "die_mid_stream" and i == 0:
                request.transport.close()  # the decode process vanishes after one token
                return out
            if self.mode == "stall_mid_stream" and i == 0:
                await asyncio.sleep(2)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def stop(self):
        await self.runner.cleanup()


async def _serve_proxy(prefills, decodes, timeouts=Timeouts()):
    proxy = PDProxy([s.url if isinstance(s, Stub) else s for s in prefills],
                    [s.url if isinstance(s, Stub) else s for s in decodes], timeouts)
    runner = web.AppRunner(proxy.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, LOOP, port).start()
    return runner, f"http://{LOOP}:{port}"


async def _with(prefills, decodes, body_fn, timeouts=Timeouts()):
    stubs = [s for s in prefills + decodes if isinstance(s, Stub)]
    for s in stubs:
        await s.start()
    runner, url = await _serve_proxy(prefills, decodes, timeouts)
    try:
        async with aiohttp.ClientSession() as session:
            return await body_fn(session, url)
    finally:
        await runner.cleanup()
        for s in stubs:
            await s.stop()


REQUEST = {"model": "tiny", "prompt": "the cache", "max_tokens": 16, "temperature": 0}


@pytest.mark.unit
def test_prefill_and_decode_bodies():
    body = {**REQUEST, "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 9}
    pre = prefill_body(body)
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1 and pre["stream"] is False
    assert "stream_options" not in pre and body["max_tokens"] == 16  # the client's body is not mutated
    params = {"remote_block_ids": [1], "remote_host": "h"}
    assert decode_body(body, params) == {**body, "kv_transfer_params": params}


@pytest.mark.integration
def test_protocol_shape_non_streaming():
    p, d = Stub("prefill", "p0"), Stub("decode", "d0")

    async def go(session, url):
        async with session.post(f"{url}/v1/completions", json=REQUEST,
                                headers={"Authorization": "Bearer k", "X-Request-Id": "req-1"}) as r:
            return r.status, await r.json()

    status, answer = asyncio.run(_with([p], [d], go))
    assert status == 200 and answer["choices"][0]["text"] == "alpha beta gamma"
    pre, dec = p.requests[0], d.requests[0]
    assert pre["body"] == {**REQUEST, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    # The decode gets the client's request plus the prefill's kv_transfer_params, unchanged.
    assert dec["body"] == {**REQUEST, "kv_transfer_params": {
        "remote_host": LOOP, "remote_port": 37000, "remote_engine_id": "p0", "remote_block_ids": [3, 4, 5],
        "remote_request_id": "req-1"}}
    assert pre["request_id"] == dec["request_id"] == "req-1" and pre["auth"] == dec["auth"] == "Bearer k"


@pytest.mark.integration
def test_streaming_relays_every_event():
    p, d = Stub("prefill", "p0"), Stub("decode", "d0")

    async def go(session, url):
        async with session.post(f"{url}/v1/completions", json={**REQUEST, "stream": True}) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            return r.status, (await r.read()).decode()

    status, text = asyncio.run(_with([p], [d], go))
    events = [e.removeprefix("data: ") for e in text.strip().split("\n\n")]
    assert status == 200 and events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["alpha", "beta", "gamma"]
    assert p.requests[0]["body"]["stream"] is False and d.requests[0]["body"]["stream"] is True


@pytest.mark.integration
def test_round_robin_over_prefills_and_decodes():
    ps = [Stub("prefill", f"p{i}") for i in range(2)]
    ds = [Stub("decode", f"d{i}") for i in range(3)]

    async def go(session, url):
        served = []
        for _ in range(6):
            async with session.post(f"{url}/v1/completions", json=REQUEST) as r:
                answer = await r.json()
                served.append((answer["got_kv_transfer_params"]["remote_engine_id"], answer["served_by"]))
        return served

    served = asyncio.run(_with(ps, ds, go))
    assert served == [("p0", "d0"), ("p1", "d1"), ("p0", "d2"), ("p1", "d0"), ("p0", "d1"), ("p1", "d2")]
    assert [len(s.requests) for s in ps + ds] == [3, 3, 2, 2, 2]


def _post_status(body=REQUEST):
    async def go(session, url):
        start = time.monotonic()
        async with session.post(f"{url}/v1/completions", json=body) as r:
            return r.status, await r.json(), time.monotonic() - start
    return go


@pytest.mark.integration
def test_prefill_error_is_a_502_with_the_upstream_reason():
    p, d = Stub("prefill", "p0", mode="fail"), Stub("decode", "d0")
    status, answer, _ = asyncio.run(_with([p], [d], _post_status()))
    assert status == 502
    assert answer["error"]["message"] == f'prefill {p.url} answered HTTP 500: {{"error": {{"message": "KV cache is full"}}}}'
    assert d.requests == []  # no decode without the prefill's KV


@pytest.mark.integration
def test_prefill_without_kv_transfer_params_is_explained():
    p, d = Stub("prefill", "p0", mode="no_params"), Stub("decode", "d0")
    status, answer, _ = asyncio.run(_with([p], [d], _post_status()))
    assert status == 502 and "returned no kv_transfer_params" in answer["error"]["message"]
    assert "kv_producer" in answer["error"]["message"]


@pytest.mark.integration
def test_unreachable_backends_are_502s():
    dead = f"http://{LOOP}:{free_port()}"
    status, answer, _ = asyncio.run(_with([dead], [Stub("decode", "d0")], _post_status()))
    assert status == 502 and answer["error"]["message"].startswith(f"prefill {dead} unreachable:")
    status, answer, _ = asyncio.run(_with([Stub("prefill", "p0")], [dead], _post_status()))
    assert status == 502 and answer["error"]["message"].startswith(f"decode {dead} unreachable:")


@pytest.mark.integration
def test_decode_error_and_slow_prefill_are_bounded():
    status, answer, _ = asyncio.run(_with([Stub("prefill", "p0")], [Stub("decode", "d0", mode="fail")], _post_status()))
    assert status == 502 and "answered HTTP 500" in answer["error"]["message"]
    timeouts = Timeouts(connect=1, prefill=0.5, decode_read=0.5)
    status, answer, elapsed = asyncio.run(_with([Stub("prefill", "p0", mode="slow")], [Stub("decode", "d0")],
                                                _post_status(), timeouts))
    assert status == 502 and answer["error"]["message"].endswith("timed out after 0.5 s") and elapsed < 3


@pytest.mark.integration
@pytest.mark.parametrize("mode,reason", [("die_mid_stream", "failed mid-stream"), ("stall_mid_stream", "went silent")])
def test_decode_failing_mid_stream_ends_with_an_error_event(mode, reason):
    timeouts = Timeouts(connect=1, prefill=5, decode_read=0.5)

    async def go(session, url):
        start = time.monotonic()
        async with session.post(f"{url}/v1/completions", json={**REQUEST, "stream": True}) as r:
            return r.status, (await r.read()).decode(), time.monotonic() - start

    status, text, elapsed = asyncio.run(_with([Stub("prefill", "p0")], [Stub("decode", "d0", mode=mode)], go, timeouts))
    events = [e.removeprefix("data: ") for e in text.strip().split("\n\n")]
    assert status == 200 and json.loads(events[0])["choices"][0]["text"] == "alpha"
    error = json.loads(events[-1])["error"]
    assert error["code"] == 502 and reason in error["message"] and elapsed < 3


@pytest.mark.integration
def test_bad_request_body_is_a_400():
    async def go(session, url):
        async with session.post(f"{url}/v1/completions", data=b"not json") as r:
            return r.status, await r.json()

    status, answer = asyncio.run(_with([Stub("prefill", "p0")], [Stub("decode", "d0")], go))
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"


@pytest.mark.integration
def test_health_shallow_and_with_backends():
    dead = f"http://{LOOP}:{free_port()}"

    async def go(session, url):
        async with session.get(f"{url}/health") as r:
            shallow = r.status
        async with session.get(f"{url}/health?backends=1") as r:
            return shallow, r.status, await r.json()

    p = Stub("prefill", "p0")
    shallow, deep, info = asyncio.run(_with([p], [dead], go))
    assert shallow == 200 and deep == 503 and info["status"] == "degraded"
    assert info["backends"][p.url] == "ok" and info["backends"][dead].startswith("unreachable")


@pytest.mark.integration
def test_kvpp_proxy_command_serves_and_stops_by_pid(tmp_path):
    p, d = Stub("prefill", "p0"), Stub("decode", "d0")
    port = free_port()
    proc = ManagedProcess("kvpp-proxy", [sys.executable, "-m", "deploy.cli", "proxy", "--prefill", p.url,
                                         "--decode", d.url, "--port", str(port)], tmp_path / "proxy.log")

    async def go():
        await p.start()
        await d.start()
        try:
            proc.start()
            await asyncio.get_running_loop().run_in_executor(None, proc.wait_http, f"http://{LOOP}:{port}/health", 30)
            async with aiohttp.ClientSession() as session:
                async with session.post(f"http://{LOOP}:{port}/v1/completions", json=REQUEST) as r:
                    return r.status, await r.json()
        finally:
            assert proc.stop(timeout=10) == 0  # SIGTERM ends aiohttp cleanly
            await p.stop()
            await d.stop()

    status, answer = asyncio.run(go())
    assert status == 200 and answer["got_kv_transfer_params"]["remote_block_ids"] == [3, 4, 5]
