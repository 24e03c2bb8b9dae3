"""`kvpp proxy` against real aiohttp backends on loopback: protocol shape, streaming, round-robin,
degradation when instances fail in each way, client disconnects, hostile request bodies."""

import asyncio
import json
import logging
import random
import re
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from deploy.services.ports import free_port
from deploy.services.processes import ManagedProcess
from deploy.services.proxy import Limits, PDProxy, Timeouts, decode_body, plain_body, prefill_body, start_proxy
from tests.helpers.stub_engine import LOOP, REQUEST, WORDS, Stub, with_proxy

FAST = Timeouts(connect=1, prefill=0.5, decode_read=0.5, probe=0.1)
BOUNDED_S = 15
"""Liveness: a request the FAST bounds cut short ends far inside this even on a loaded host, where one waiting
for a hung stub would take its 30 s (what each test counts, the path taken, is the proof of which happened)."""


def dead_url():
    return f"http://{LOOP}:{free_port()}"


async def metrics(session, url) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    return {m[0]: float(m[1]) for m in re.findall(r"^(\S+) (\S+)$", text, re.M) if not m[0].startswith("#")}


def _events(text):
    return [e.removeprefix("data: ") for e in text.strip().split("\n\n")]


def _post(body=REQUEST):
    """Send one completion; returns (status, answer: parsed JSON or the event texts, seconds, metrics)."""
    async def go(session, url, proxy):
        start = time.monotonic()
        async with session.post(f"{url}/v1/completions", json=body) as r:
            answer = _events(await r.text()) if body.get("stream") and r.status == 200 else await r.json()
            status = r.status
        return status, answer, time.monotonic() - start, await metrics(session, url)
    return go


@pytest.mark.unit
def test_prefill_and_decode_bodies():
    body = {**REQUEST, "stream": True, "stream_options": {"include_usage": True}, "max_completion_tokens": 9}
    pre = prefill_body(body)
    assert pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1 and pre["stream"] is False
    assert "stream_options" not in pre and body["max_tokens"] == 16  # the client's body is not mutated
    params = {"remote_block_ids": [1], "remote_host": "h"}
    assert decode_body(body, params) == {**body, "kv_transfer_params": params}
    # Transfer parameters are the proxy's: a client cannot point an engine at someone's blocks.
    assert plain_body({**body, "kv_transfer_params": params}) == body


@pytest.mark.integration
def test_protocol_shape_non_streaming():
    p, d = Stub("p0"), Stub("d0")

    async def go(session, url, proxy):
        async with session.post(f"{url}/v1/completions", json=REQUEST,
                                headers={"Authorization": "Bearer k", "X-Request-Id": "req-1"}) as r:
            return r.status, await r.json(), r.headers["X-Kvpp-Path"], await metrics(session, url)

    status, answer, path, m = asyncio.run(with_proxy([p], [d], go))
    assert status == 200 and answer["choices"][0]["text"] == "alpha beta gamma"
    assert path == "pd"
    pre, dec = p.requests[0], d.requests[0]
    assert pre["body"] == {**REQUEST, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    # The decode gets the client's request plus the prefill's kv_transfer_params, unchanged.
    assert dec["body"] == {**REQUEST, "kv_transfer_params": {
        "remote_host": LOOP, "remote_port": 37000, "remote_engine_id": "p0", "remote_block_ids": [3, 4, 5],
        "remote_request_id": "req-1"}}
    assert pre["request_id"] == dec["request_id"] == "req-1" and pre["auth"] == dec["auth"] == "Bearer k"
    assert m['kvpp_proxy_requests_total{path="pd"}'] == 1 and m["kvpp_proxy_requests_in_flight"] == 0


@pytest.mark.integration
def test_streaming_relays_every_event():
    p, d = Stub("p0"), Stub("d0")

    async def go(session, url, proxy):
        async with session.post(f"{url}/v1/completions", json={**REQUEST, "stream": True}) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            return r.status, (await r.read()).decode()

    status, text = asyncio.run(with_proxy([p], [d], go))
    events = _events(text)
    assert status == 200 and events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == WORDS
    assert p.requests[0]["body"]["stream"] is False and d.requests[0]["body"]["stream"] is True


@pytest.mark.integration
def test_round_robin_over_prefills_and_decodes():
    ps = [Stub(f"p{i}") for i in range(2)]
    ds = [Stub(f"d{i}") for i in range(3)]

    async def go(session, url, proxy):
        served = []
        for _ in range(6):
            async with session.post(f"{url}/v1/completions", json=REQUEST) as r:
                answer = await r.json()
                served.append((answer["got_kv_transfer_params"]["remote_engine_id"], answer["served_by"]))
        return served

    served = asyncio.run(with_proxy(ps, ds, go))
    assert served == [("p0", "d0"), ("p1", "d1"), ("p0", "d2"), ("p1", "d0"), ("p0", "d1"), ("p1", "d2")]
    assert [len(s.requests) for s in ps + ds] == [3, 3, 2, 2, 2]


# -- degradation -------------------------------------------------------------------------------------
PREFILL_FAULTS = ["refused", "reset", "fail", "hang", "no_params"]


def _instance(name, fault):
    return dead_url() if fault == "refused" else Stub(name, mode=fault)


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("fault", PREFILL_FAULTS)
def test_no_prefill_answering_means_the_decode_computes_the_prompt(fault, stream):
    p, d = _instance("p0", fault), Stub("d0")
    status, answer, elapsed, m = asyncio.run(with_proxy([p], [d], _post({**REQUEST, "stream": stream}), FAST))
    assert status == 200 and elapsed < BOUNDED_S
    texts = [json.loads(e)["choices"][0]["text"] for e in answer[:-1]] if stream else [answer["choices"][0]["text"]]
    assert " ".join(texts) == "alpha beta gamma"
    # A plain request: the decode must not try to pull from a prefill that failed its leg.
    assert d.requests[0]["body"] == {**REQUEST, "stream": stream}
    assert m['kvpp_proxy_requests_total{path="decode_only"}'] == 1
    assert m[f'kvpp_proxy_backend_up{{role="prefill",backend="{getattr(p, "url", p)}"}}'] == 0


DECODE_FAULTS = ["refused", "reset", "fail", "hang"]


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("fault", DECODE_FAULTS)
def test_decode_failing_before_the_first_byte_moves_to_another_decode(fault, stream):
    p, bad, good = Stub("p0"), _instance("d0", fault), Stub("d1")
    status, answer, elapsed, m = asyncio.run(with_proxy([p], [bad, good], _post({**REQUEST, "stream": stream}), FAST))
    assert status == 200 and elapsed < BOUNDED_S
    served = json.loads(answer[0]) if stream else answer
    assert served["served_by"] == "d1"
    got = good.requests[0]["body"].get("kv_transfer_params")
    if fault == "refused":  # d0 never saw the request: d1 pulls the prefill's blocks instead
        assert got["remote_engine_id"] == "p0" and m['kvpp_proxy_requests_total{path="pd"}'] == 1
    else:  # d0 may have pulled and released them already: d1 computes the prompt itself
        assert got is None and m['kvpp_proxy_requests_total{path="decode_only"}'] == 1
    assert m[f'kvpp_proxy_backend_up{{role="decode",backend="{getattr(bad, "url", bad)}"}}'] == 0


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("fault", DECODE_FAULTS)
def test_no_decode_answering_means_a_prefill_serves_the_whole_request(fault, stream):
    p, d = Stub("p0"), _instance("d0", fault)
    status, answer, elapsed, m = asyncio.run(with_proxy([p], [d], _post({**REQUEST, "stream": stream}), FAST))
    assert status == 200 and elapsed < BOUNDED_S
    served = json.loads(answer[0]) if stream else answer
    assert served["served_by"] == "p0"
    # First the prefill leg, then the whole request, plain, with the client's max_tokens and stream flag.
    assert [r["body"] for r in p.requests][-1] == {**REQUEST, "stream": stream}
    assert m['kvpp_proxy_requests_total{path="prefill_only"}'] == 1


@pytest.mark.integration
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_pooled_connection_the_instance_closed_is_resent_fresh_and_nobody_is_blamed(role):
    """The second request finds its pooled connection closed under it (vLLM's keep-alive race): it is
    sent again on a new connection, served P/D as usual, and the instance stays in rotation."""
    p, d = (Stub("p0", mode="drop_reused"), Stub("d0")) if role == "prefill" else (Stub("p0"), Stub("d0", "drop_reused"))

    async def go(session, url, proxy):
        paths = []
        for _ in range(2):
            async with session.post(f"{url}/v1/completions", json=REQUEST) as r:
                assert r.status == 200 and (await r.json())["served_by"] == "d0"
                paths.append(r.headers["X-Kvpp-Path"])
        return paths, await metrics(session, url)

    paths, m = asyncio.run(with_proxy([p], [d], go, FAST))
    stale = p if role == "prefill" else d
    assert stale.dropped == 1 and paths == ["pd", "pd"]
    assert m[f'kvpp_proxy_backend_up{{role="{role}",backend="{stale.url}"}}'] == 1
    assert m[f'kvpp_proxy_backend_failures_total{{role="{role}",backend="{stale.url}"}}'] == 0


@pytest.mark.integration
def test_failed_instance_leaves_rotation_and_is_probed_back():
    p0, p1, d = Stub("p0", mode="fail"), Stub("p1"), Stub("d0")

    async def go(session, url, proxy):
        served = []

        async def one():
            async with session.post(f"{url}/v1/completions", json=REQUEST) as r:
                assert r.status == 200
                served.append((await r.json())["got_kv_transfer_params"]["remote_engine_id"])

        for _ in range(4):
            await one()
        out_of_rotation = await metrics(session, url)
        p0.mode = "ok"  # recovered: its /health answers 200 again
        await asyncio.sleep(0.5)
        for _ in range(4):
            await one()
        return served, out_of_rotation, await metrics(session, url)

    served, before, after = asyncio.run(with_proxy([p0, p1], [d], go, FAST))
    # p0 failed once (that request went on to p1), then stayed out until probed back in.
    assert served[:4] == ["p1"] * 4 and sorted(served[4:]) == ["p0", "p0", "p1", "p1"]
    assert len(p0.requests) == 3
    assert before[f'kvpp_proxy_backend_up{{role="prefill",backend="{p0.url}"}}'] == 0
    assert before[f'kvpp_proxy_backend_failures_total{{role="prefill",backend="{p0.url}"}}'] == 1
    assert after[f'kvpp_proxy_backend_up{{role="prefill",backend="{p0.url}"}}'] == 1
    assert after['kvpp_proxy_requests_total{path="pd"}'] == 8


@pytest.mark.integration
def test_nothing_answering_is_a_502_naming_each_backend_without_their_bodies():
    p, d = Stub("p0", mode="fail"), dead_url()
    status, answer, _, m = asyncio.run(with_proxy([p], [d], _post(), FAST))
    message = answer["error"]["message"]
    assert status == 502 and answer["error"]["code"] == 502 and answer["error"]["type"] == "upstream_error"
    assert f"prefill {p.url}: answered HTTP 500" in message and f"decode {d}: unreachable" in message
    assert "secret" not in message
    assert m['kvpp_proxy_requests_total{path="failed"}'] == 1


@pytest.mark.integration
def test_a_backend_refusing_the_request_itself_is_relayed():
    p, d = Stub("p0", mode="reject"), Stub("d0")
    status, answer, _, m = asyncio.run(with_proxy([p], [d], _post(), FAST))
    assert status == 400 and answer["error"]["message"] == "prompt too long"
    assert d.requests == [] and m['kvpp_proxy_requests_total{path="rejected"}'] == 1
    assert m[f'kvpp_proxy_backend_up{{role="prefill",backend="{p.url}"}}'] == 1  # not the instance's fault


@pytest.mark.integration
@pytest.mark.parametrize("mode,reason", [("die_mid_stream", "failed mid-stream"), ("stall_mid_stream", "went silent")])
def test_decode_failing_mid_stream_ends_with_an_error_event(mode, reason):
    status, events, elapsed, m = asyncio.run(with_proxy([Stub("p0")], [Stub("d0", mode=mode)],
                                                   _post({**REQUEST, "stream": True}), FAST))
    assert status == 200 and json.loads(events[0])["choices"][0]["text"] == "alpha"
    error = json.loads(events[-1])["error"]
    assert error["code"] == 502 and reason in error["message"] and elapsed < BOUNDED_S
    assert m['kvpp_proxy_requests_total{path="failed"}'] == 1


# -- client disconnects --------------------------------------------------------------------------
async def _leave(url, body, after_first_chunk):
    """A client that sends `body`, then drops the connection (after the first chunk of the answer, or
    after 0.3 s of waiting for it): a closed browser tab, a killed client. Returns when it left."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps(body).encode()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    if after_first_chunk:
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and await reader.read(1)
    else:
        await asyncio.sleep(0.3)
    left = time.monotonic()
    writer.transport.abort()
    return left


@pytest.mark.integration
@pytest.mark.parametrize("leg", ["prefill", "decode_plain", "decode_stream"])
def test_client_disconnect_cancels_the_upstream_request(leg):
    p = Stub("p0", mode="hang" if leg == "prefill" else "ok")
    d = Stub("d0", mode={"prefill": "ok", "decode_plain": "hang", "decode_stream": "endless_stream"}[leg])
    body = {**REQUEST, "stream": leg == "decode_stream"}

    async def go(session, url, proxy):
        left = await _leave(url, body, after_first_chunk=leg == "decode_stream")
        waited = p if leg == "prefill" else d
        while not waited.cancelled and time.monotonic() - left < BOUNDED_S:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        return left, await metrics(session, url)

    left, m = asyncio.run(with_proxy([p], [d], go, Timeouts(connect=1, prefill=30, decode_read=30)))
    waited = p if leg == "prefill" else d
    # Cancelled by the client's leaving, within the liveness bound: the 30 s timeouts would end it only later.
    assert waited.cancelled and waited.cancelled[0] - left < BOUNDED_S, f"{leg} upstream not cancelled"
    if leg == "prefill":
        assert d.requests == []
    assert m['kvpp_proxy_requests_total{path="cancelled"}'] == 1 and m["kvpp_proxy_requests_in_flight"] == 0
    # The client left: no instance is blamed for it.
    assert all(v == 1 for k, v in m.items() if k.startswith("kvpp_proxy_backend_up"))
    assert all(v == 0 for k, v in m.items() if k.startswith("kvpp_proxy_backend_failures_total"))


# -- hostile bodies --------------------------------------------------------------------------------
def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def _hostile_bodies(n_fuzz: int) -> list[bytes]:
    valid = json.dumps({**REQUEST, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    crafted = [b"", b"not json", b"\xff\xfe\x00garbage", b"[1, 2, 3]", b'"a string"', b"42", b"null",
               b'{"prompt": "unterminated', b"{" * 100_000, b"[" * 100_000, b"[" * 50 + b"]" * 50,
               json.dumps({"prompt": "x", "a": _nested(40)}).encode()]
    rng = random.Random(11)
    fuzz = []
    for _ in range(n_fuzz):
        data = bytearray(valid.encode())
        for _ in range(rng.randint(1, 4)):
            op, i = rng.randrange(3), rng.randrange(len(data))
            if op == 0:
                data[i] = rng.randrange(256)
            elif op == 1:
                del data[i:i + rng.randint(1, 8)]
            else:
                data[i:i] = bytes(rng.choice(b'{}[]":,\\') for _ in range(rng.randint(1, 4)))
        fuzz.append(bytes(data))
    return crafted + fuzz


@pytest.mark.integration
def test_hostile_bodies_get_openai_errors_and_one_short_log_line_each(caplog):
    bodies = _hostile_bodies(300)
    oversized = json.dumps({**REQUEST, "prompt": "x" * 5000}).encode()
    p, d = Stub("p0"), Stub("d0")

    async def go(session, url, proxy):
        results = []
        for data in [*bodies, oversized]:
            async with session.post(f"{url}/v1/completions", data=data,
                                    headers={"Content-Type": "application/json"}) as r:
                results.append((r.status, r.headers.get("Content-Type", ""), await r.read()))
        async with session.post(f"{url}/v1/completions", json=REQUEST) as r:  # still serving
            results.append((r.status, "", b""))
        return results

    with caplog.at_level(logging.INFO, logger="kvpp.proxy"):
        results = asyncio.run(with_proxy([p], [d], go, FAST, Limits(max_body_bytes=4096)))
    *hostile, (status_big, type_big, big), (status_ok, _, _) = results
    assert status_big == 413 and json.loads(big)["error"]["code"] == 413 and status_ok == 200
    rejected = 0
    for data, (status, ctype, raw) in zip(bodies, hostile):
        assert status in (200, 400, 413), (data[:80], status)  # a mutation may still be a valid request
        if status != 200:
            rejected += 1
            error = json.loads(raw)["error"]
            assert ctype.startswith("application/json") and error["type"] == "invalid_request_error"
            assert error["code"] == status and len(error["message"]) < 100
    assert rejected >= 12 + 250, f"of {len(bodies)} hostile bodies only {rejected} were refused"
    # Every refused body reached no backend, and cost one log line under 200 characters.
    assert len(p.requests) == len(bodies) - rejected + 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rejected")]
    assert len(lines) == rejected + 1 and max(map(len, lines)) < 200
    print(f"{len(bodies) + 1} hostile bodies tried, {rejected + 1} refused with JSON errors")


@pytest.mark.integration
def test_deep_nesting_and_non_objects_are_named():
    async def go(session, url, proxy):
        out = []
        for data in (b"[1]", b"[" * 100_000, json.dumps({"a": _nested(40)}).encode()):
            async with session.post(f"{url}/v1/completions", data=data) as r:
                out.append((await r.json())["error"]["message"])
        return out

    messages = asyncio.run(with_proxy([Stub("p0")], [Stub("d0")], go))
    assert messages[0] == "request body must be a JSON object"
    assert messages[1] == "request body nests deeper than 32 levels"
    assert messages[2] == "request body nests deeper than 32 levels"


@pytest.mark.integration
def test_health_shallow_and_with_backends():
    dead = dead_url()

    async def go(session, url, proxy):
        async with session.get(f"{url}/health") as r:
            shallow = r.status
        async with session.get(f"{url}/health?backends=1") as r:
            return shallow, r.status, await r.json()

    p = Stub("p0")
    shallow, deep, info = asyncio.run(with_proxy([p], [dead], go))
    assert shallow == 200 and deep == 503 and info["status"] == "degraded"
    assert info["backends"][p.url] == "ok" and info["backends"][dead].startswith("unreachable")


@pytest.mark.integration
def test_kvpp_proxy_command_serves_and_stops_by_pid(tmp_path):
    p, d = Stub("p0"), Stub("d0")
    port = free_port()
    proc = ManagedProcess("kvpp-proxy", [sys.executable, "-m", "deploy.cli.main", "proxy", "--prefill", p.url,
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


@pytest.mark.integration
def test_a_write_to_a_departed_client_is_not_blamed_on_the_decode():
    """Served without handler cancellation, the proxy learns of the disconnect from a failed write:
    the request still counts as cancelled, its upstream is closed, and the decode stays in rotation."""
    p, d = Stub("p0"), Stub("d0", mode="endless_stream")

    async def go():
        for s in (p, d):
            await s.start()
        proxy = PDProxy([p.url], [d.url], Timeouts(connect=1, prefill=30, decode_read=30))
        runner = web.AppRunner(proxy.app())  # no handler_cancellation
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, LOOP, port).start()
        try:
            left = await _leave(f"http://{LOOP}:{port}", {**REQUEST, "stream": True}, after_first_chunk=True)
            while not d.cancelled and time.monotonic() - left < BOUNDED_S:
                await asyncio.sleep(0.05)
            return left, proxy
        finally:
            await runner.cleanup()
            for s in (p, d):
                await s.stop()

    left, proxy = asyncio.run(go())
    assert d.cancelled and d.cancelled[0] - left < BOUNDED_S  # liveness: the 30 s timeouts would end it later
    assert proxy.outcomes["cancelled"] == 1 and proxy.outcomes["failed"] == 0
    assert proxy.decode.backends[0].up and proxy.decode.backends[0].failures == 0


def test_a_proxy_on_the_ipv6_wildcard_serves_both_families(tmp_path):
    """`--host ::` (what kvpp render gives a proxy on an IPv6 host): asyncio alone would listen on IPv6
    only; IPv6 backends are dialled at their bracketed URLs."""
    import urllib.error
    import urllib.request

    proc, url = start_proxy(["http://[::1]:1"], ["http://[::1]:2"], tmp_path / "proxy.log",
                            extra_args=["--host", "::"])  # start_proxy waits for it on 127.0.0.1
    try:
        port = int(url.rsplit(":", 1)[1])
        with urllib.request.urlopen(f"http://[::1]:{port}/health", timeout=10) as resp:
            assert json.loads(resp.read())["prefill"] == ["http://[::1]:1"]
        with pytest.raises(urllib.error.HTTPError) as err:  # 503: no backend listens there
            urllib.request.urlopen(f"http://[::1]:{port}/health?backends=1", timeout=10)
        backends = json.loads(err.value.read())["backends"]
        assert backends["http://[::1]:2"].startswith("unreachable (Cannot connect to host ::1:2"), backends
    finally:
        proc.stop()


# -- production concurrency ----------------------------------------------------------------------
def _many():
    """A session that itself imposes no pool limit (aiohttp's default is 100 connections)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))


async def _stream(session, url) -> tuple[int, str, dict]:
    async with session.post(f"{url}/v1/completions", json={**REQUEST, "stream": True}) as r:
        return r.status, (await r.read()).decode(), dict(r.headers)


@pytest.mark.integration
def test_more_concurrent_streams_than_aiohttp_s_default_pool_are_all_served():
    """150 streams of 1.5 s at once, with a 1 s connect timeout: with a 100-connection pool whose slot
    wait counted as connecting, 50 would time out and the healthy decode would leave rotation. (1 s, not
    less: `make test` runs this beside the engine tier, and 150 loopback connects to a busy stub on two
    busy cores can take half a second.)"""
    p, d = Stub("p0"), Stub("d0", mode="slow_stream")

    async def go(session, url, proxy):
        async with _many() as many:
            answers = await asyncio.gather(*(_stream(many, url) for _ in range(150)))
        return answers, await metrics(session, url)

    answers, m = asyncio.run(with_proxy([p], [d], go, Timeouts(connect=1.0, prefill=10, decode_read=5)))
    assert [status for status, _, _ in answers] == [200] * 150
    assert all(_events(text)[-1] == "[DONE]" and len(_events(text)) == len(WORDS) + 1 for _, text, _ in answers)
    assert m['kvpp_proxy_requests_total{path="pd"}'] == 150 and m['kvpp_proxy_requests_total{path="failed"}'] == 0
    assert all(v == 0 for k, v in m.items() if k.startswith("kvpp_proxy_backend_failures_total"))
    assert all(v == 1 for k, v in m.items() if k.startswith("kvpp_proxy_backend_up"))


@pytest.mark.integration
def test_beyond_max_in_flight_clients_get_429_with_retry_after_and_no_backend_is_blamed():
    p, d = Stub("p0"), Stub("d0", mode="slow_stream")

    async def go(session, url, proxy):
        async with _many() as many:
            admitted = [asyncio.create_task(_stream(many, url)) for _ in range(10)]
            while proxy.in_flight < 10:
                await asyncio.sleep(0.01)
            refused = []
            for _ in range(5):
                async with many.post(f"{url}/v1/completions", json=REQUEST) as r:
                    refused.append((r.status, r.headers.get("Retry-After"), await r.json()))
            served = await asyncio.gather(*admitted)
            async with many.post(f"{url}/v1/completions", json=REQUEST) as r:  # below the cap again
                after = r.status
        return served, refused, after, await metrics(session, url)

    served, refused, after, m = asyncio.run(with_proxy([p], [d], go, Timeouts(connect=1, prefill=10, decode_read=5),
                                                      Limits(max_in_flight=10)))
    assert [status for status, _, _ in served] == [200] * 10 and after == 200
    for status, retry_after, answer in refused:
        assert status == 429 and retry_after == "1"
        assert answer["error"]["code"] == 429 and answer["error"]["type"] == "rate_limit_exceeded"
        assert "limit of 10 requests" in answer["error"]["message"]
    assert len(d.requests) == 11  # a refused request reached no instance
    assert m['kvpp_proxy_requests_total{path="overloaded"}'] == 5 and m['kvpp_proxy_requests_total{path="pd"}'] == 11
    assert all(v == 0 for k, v in m.items() if k.startswith("kvpp_proxy_backend_failures_total"))


@pytest.mark.integration
def test_the_prober_has_its_own_connections_and_outlives_a_failed_round(caplog):
    """A failed prefill is probed back in while every completion slot is held by a stream, and after
    a probe round that raised (a bug injected into one round: the loop must not die of it)."""
    p0, p1, d = Stub("p0", mode="fail"), Stub("p1"), Stub("d0", mode="slow_stream")

    async def go(session, url, proxy):
        async with session.post(f"{url}/v1/completions", json=REQUEST) as r:  # p0 fails, p1 serves
            assert r.status == 200
        assert not proxy.prefill.backends[0].up
        rounds = []
        real_down = proxy.prefill.down

        def down_failing_once():
            rounds.append(time.monotonic())
            if len(rounds) == 1:
                raise RuntimeError("injected probe bug")
            return real_down()

        proxy.prefill.down = down_failing_once
        async with _many() as many:
            streams = [asyncio.create_task(_stream(many, url)) for _ in range(4)]
            while proxy.in_flight < 4:
                await asyncio.sleep(0.01)
            p0.mode = "ok"
            while not proxy.prefill.backends[0].up and len(rounds) < 30:
                await asyncio.sleep(0.05)
            back, busy = proxy.prefill.backends[0].up, proxy.in_flight
            await asyncio.gather(*streams)
        return back, busy, len(rounds)

    with caplog.at_level(logging.WARNING, logger="kvpp.proxy"):
        back, busy, rounds = asyncio.run(with_proxy([p0, p1], [d], go, Timeouts(connect=1, prefill=10, decode_read=5,
                                                                               probe=0.05), Limits(max_in_flight=4)))
    assert back and busy == 4 and rounds >= 2
    assert "health probe round failed (injected probe bug)" in caplog.text


async def _slow_body(url: str, sent: bytes, length: int) -> tuple[bytes, float]:
    """A client that announces `length` body bytes, sends `sent`, then stalls; returns the answer's
    head and how long it took."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    start = time.monotonic()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {length}\r\n\r\n".encode() + sent)
    await writer.drain()
    try:
        head = await asyncio.wait_for(reader.read(4096), 10)
    finally:
        writer.close()
    return head, time.monotonic() - start


@pytest.mark.integration
def test_a_client_slow_to_send_its_body_gets_a_408_and_holds_its_slot_only_that_long():
    async def go(session, url, proxy):
        slow = asyncio.create_task(_slow_body(url, b'{"prompt": ', 500))
        while proxy.in_flight < 1:
            await asyncio.sleep(0.01)
        async with session.post(f"{url}/v1/completions", json=REQUEST) as r:  # the slow sender holds the slot
            during = r.status
        head, took = await slow
        async with session.post(f"{url}/v1/completions", json=REQUEST) as r:
            after = r.status
        return during, head, took, after, proxy.prefill.backends[0].failures

    during, head, took, after, failures = asyncio.run(with_proxy(
        [Stub("p0")], [Stub("d0")], go, Timeouts(connect=1, prefill=5, decode_read=5, body_read=0.5),
        Limits(max_in_flight=1)))
    assert head.startswith(b"HTTP/1.1 408") and b"request body not received within 0.5 s" in head
    # It held its slot until the 0.5 s body bound (a lower bound: load only adds), and the 408 names that bound;
    # without it the client's own 10 s wait would have given up first.
    assert took > 0.4 and during == 429 and after == 200 and failures == 0


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["huge", "huge_chunked"])
def test_an_oversize_upstream_answer_is_that_instance_s_failure(mode):
    """A decode answering more than max_upstream_bytes is given up (the next decode serves), and a
    prefill doing so leaves the request to the decode alone; nothing is buffered past the limit."""
    async def go(session, url, proxy):
        return await _post()(session, url, proxy)

    limits = Limits(max_upstream_bytes=4096)
    runaway = Stub("d0", mode=mode)
    status, answer, _, m = asyncio.run(with_proxy([Stub("p0")], [runaway, Stub("d1")], go, FAST, limits))
    assert status == 200 and answer["served_by"] == "d1"
    assert m[f'kvpp_proxy_backend_up{{role="decode",backend="{runaway.url}"}}'] == 0
    bad = Stub("p0", mode=mode)
    status, answer, _, m = asyncio.run(with_proxy([bad], [Stub("d0")], go, FAST, limits))
    assert status == 200 and answer["served_by"] == "d0" and answer["got_kv_transfer_params"] is None
    assert m['kvpp_proxy_requests_total{path="decode_only"}'] == 1
    assert m[f'kvpp_proxy_backend_up{{role="prefill",backend="{bad.url}"}}'] == 0


@pytest.mark.integration
def test_max_in_flight_is_refused_where_the_open_file_limit_cannot_serve_it(tmp_path):
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    too_many = min(1 << 16, hard)  # needs twice as many sockets as this
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard open-file limit to exceed")
    out = subprocess.run([sys.executable, "-m", "deploy.cli.main", "proxy", "--prefill", "http://127.0.0.1:1",
                          "--decode", "http://127.0.0.1:2", "--port", str(free_port()), "--max-in-flight",
                          str(too_many)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"--max-in-flight {too_many} needs" in out.stderr and "lower --max-in-flight or raise the limit" in out.stderr
