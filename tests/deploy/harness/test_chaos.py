"""`kvpp chaos` machinery without engines: fault bookkeeping, schedules, the clients' records, and
kill/restart/stall of real processes (`kvpp proxy` in front of real aiohttp backends, the Mooncake pool)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import urllib.request

import pytest
from aiohttp import web

from connectors.store.settings import parse_store_settings
from deploy.cli.chaos import _engine_urls
from deploy.harness.chaos import SHORT_SCHEDULE, _by_kind, _front_counts, _tally, check_attached, soak_schedule
from deploy.harness.chaos_load import Load, Prompt, Record, cancel_probe
from deploy.harness.chaos_stack import Member, Stack, StackSettings, adopt_pool, inject, start_front
from deploy.services.ports import free_port
from deploy.services.processes import http_ok, port_open
from deploy.services.proxy import PDProxy, Timeouts, start_proxy
from tests.helpers.pd_http import post
from tests.helpers.stub_engine import REQUEST, WORDS, Stub, stubs_in_thread, with_proxy


def _rec(mode, outcome, status=200, start=4.5, path="pd", first_byte=0.2, seconds=1.0):
    return Record(0, 0, mode, start, start + seconds, outcome, status, first_byte=first_byte, path=path)


def _kill(target, start=5.0, back=15.0, kind="kill", down=None):
    """A fault record: `down` is when the member was dead or stopped (default: at once)."""
    return {"kind": kind, "target": target, "start": start, "down": start if down is None else down, "back": back}


@pytest.mark.unit
def test_only_streams_relayed_from_the_killed_instance_and_requests_cut_by_a_proxy_kill_are_excused():
    relayed = _rec("stream", "error")  # headers at 4.7, the decode killed at 5.0
    records = [relayed, _rec("plain", "error", 502), _rec("stream", "error", 502),
               _rec("plain", "answered", path="prefill_only"), _rec("stream", "wrong")]
    row = _tally(records, [_kill("decode")])
    assert (row["errors"], row["errors_unexcused"], row["wrong"], row["answered"]) == (3, 2, 1, 1)
    assert row["paths"] == {"pd": 4, "prefill_only": 1}
    assert _tally([relayed], [_kill("decode", kind="stop")])["errors_unexcused"] == 1  # a stall is not a death
    # The killed instance must be the one streaming: a decode's stream outlives a prefill's death,
    # and a prefill serving alone is not hurt by the decode's.
    assert _tally([relayed], [_kill("prefill")])["errors_unexcused"] == 1
    assert _tally([_rec("stream", "error", path="prefill_only")], [_kill("decode")])["errors_unexcused"] == 1
    assert _tally([_rec("stream", "error", path="prefill_only")], [_kill("prefill")])["errors_unexcused"] == 0
    # Not yet relayed when the kill came: the proxy could still have moved it (headers at 5.3).
    assert _tally([_rec("stream", "error", first_byte=0.8)], [_kill("decode")])["errors_unexcused"] == 1
    assert _tally([_rec("stream", "error", start=6.0)], [_kill("decode")])["errors_unexcused"] == 1  # born after

    inside, after = _rec("plain", "error", None, start=4.0), _rec("plain", "error", None, start=6.0)
    assert _tally([inside, after], [_kill("proxy")])["errors_unexcused"] == 1
    # Sent after the SIGKILL but before the proxy was dead (the kernel still accepted it), then reset: cut off
    # by the kill too. One sent once it was dead is not (clients retry a refused connection).
    dying = _rec("stream", "error", None, start=5.01, seconds=0.002, first_byte=None)
    assert _tally([dying], [_kill("proxy", down=5.02)])["errors_unexcused"] == 0
    assert _tally([dying], [_kill("proxy", down=5.005)])["errors_unexcused"] == 1
    assert _tally([_rec("plain", "error", 502, start=4.0)], [_kill("proxy")])["errors_unexcused"] == 1  # its own 502
    assert _tally([inside], [])["errors_unexcused"] == 1
    # A request counted in a stall's window that the next fault, a proxy kill, ended is excused there too.
    assert _tally([inside], [_kill("pool_holder", 3.0, kind="stop"), _kill("proxy")])["errors_unexcused"] == 0


@pytest.mark.unit
def test_any_error_is_excused_only_while_no_engine_of_either_role_is_alive():
    failed = _rec("plain", "error", 502, start=8.0)  # ends at 9.0
    assert _tally([failed], [_kill("prefill", 3.0, 20.0)])["errors_unexcused"] == 1  # the decode was alive
    assert _tally([failed], [_kill("prefill", 3.0, 20.0), _kill("decode", 4.0, 20.0)])["errors_unexcused"] == 0
    assert _tally([failed], [_kill("prefill", 3.0, 20.0), _kill("decode", 4.0, 8.5)])["errors_unexcused"] == 1
    assert _tally([failed], [_kill("prefill", 3.0, 20.0), _kill("decode", 4.0, 20.0, kind="stop")]) \
        ["errors_unexcused"] == 1


@pytest.mark.unit
def test_a_soak_s_table_has_one_row_per_fault_kind_counting_each_request_once():
    faults = [{**_kill("decode", 5.0, 9.0), "end": 6.0, "down_s": 1, "recovered_s": 4.0, "label": "kill decode"},
              {**_kill("decode", 8.0, 20.0), "end": 9.0, "down_s": 1, "recovered_s": 12.0, "label": "kill decode"},
              {**_kill("proxy", 30.0, 31.0, kind="stop"), "end": 31.0, "down_s": 1, "recovered_s": 1.0,
               "label": "stop proxy"}]
    spanning = _rec("plain", "error", 502, start=5.5, seconds=3.0)  # overlaps both decode kills
    records = [spanning, _rec("plain", "answered", start=9.5), _rec("plain", "answered", start=29.0)]
    decode, proxy = _by_kind(records, faults)
    assert (decode["fault"], decode["injected"], decode["recovered_s"]) == ("kill decode", 2, 12.0)
    assert (decode["affected"], decode["answered"], decode["errors"], decode["errors_unexcused"]) == (2, 1, 1, 1)
    assert (proxy["fault"], proxy["injected"], proxy["affected"], proxy["errors"]) == ("stop proxy", 1, 1, 0)


@pytest.mark.unit
def test_attach_mode_names_every_bad_option_before_any_load():
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ValueError) as info:
        check_attached(dead, {"prefill": dead, "decoder": "nope"}, dead)
    assert str(info.value).split("\n") == [
        "--engines names decoder, prefill; name the P/D decode `decode` (its pulls are checked against the proxy's "
        "P/D requests), e.g. prefill=http://P:8100,decode=http://D:8200",
        f"--engines prefill={dead}: {dead}/metrics unreachable (<urlopen error [Errno 111] Connection refused>)",
        "--engines decoder=nope: nope/metrics unreachable (unknown url type: 'nope/metrics')",
        f"--proxy {dead}: {dead}/health does not answer 200",
        f"--reference {dead}: {dead}/health does not answer 200"]
    assert _engine_urls(" prefill=http://a:1/ , decode=http://b:2,") == {"prefill": "http://a:1", "decode": "http://b:2"}
    with pytest.raises(ValueError, match="'decod' is not NAME=URL"):
        _engine_urls("prefill=http://a:1,decod")


@pytest.mark.unit
def test_soak_rounds_hold_every_fault_of_the_short_schedule():
    n = len(SHORT_SCHEDULE)
    soak = list(itertools.islice(soak_schedule(seed=3), 7 * n))  # as many rounds as the time allows
    for i in range(7):
        assert sorted(soak[i * n:(i + 1) * n], key=str) == sorted(SHORT_SCHEDULE, key=str)
    assert soak == list(itertools.islice(soak_schedule(seed=3), 7 * n))
    assert soak != list(itertools.islice(soak_schedule(seed=4), 7 * n))
    kinds = {(f.kind, f.target) for f in SHORT_SCHEDULE}
    for target in ("prefill", "decode", "pool_master", "pool_holder", "proxy"):
        assert {("kill", target), ("stop", target)} <= kinds


def _answer(url, timeout):
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(REQUEST).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): state T in /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.integration
def test_kill_restarts_on_the_same_port_and_stop_stalls_until_resumed(tmp_path):
    p, d = Stub("p0"), Stub("d0")

    async def go():
        await p.start()
        await d.start()
        stack = Stack()
        try:
            proxy, url = await asyncio.to_thread(start_proxy, [p.url], [d.url], tmp_path / "proxy.log")
            member = Member.of(proxy, lambda proc: proc.wait_http(f"{url}/health", 30))
            stack.members["proxy"] = member
            first_pid = member.pid
            await asyncio.to_thread(inject, member, "kill", 0.5, stack)
            assert member.pid != first_pid and member.restarts == 1
            assert (await asyncio.to_thread(_answer, url, 10))["served_by"] == "d0"

            task = asyncio.ensure_future(asyncio.to_thread(inject, member, "stop", 2.0, stack))
            while not _stopped(member.pid):  # the stop has landed: asked from now on, it can only stall
                await asyncio.sleep(0.01)
            stalled = await asyncio.to_thread(http_ok, f"{url}/health", 0.5)
            answer = await asyncio.to_thread(_answer, url, 10)  # waits out the stall, then is answered
            answered = time.monotonic()
            stopped = await task
            return stalled, answered - stopped, answer
        finally:
            stack.stop()
            await p.stop()
            await d.stop()

    stalled, after_stop, answer = asyncio.run(go())
    # In order: asked while stopped, answered only after SIGCONT (2 s after SIGSTOP), within _answer's 10 s.
    assert not stalled and after_stop >= 2.0 and answer["served_by"] == "d0"


@pytest.mark.integration
def test_pool_master_restarts_on_its_port_and_the_holder_registers_again(tmp_path):
    from mooncake.store import MooncakeDistributedStore

    stack = Stack(members=adopt_pool(tmp_path / "pool"))
    master, holder = stack.members["pool_master"], stack.members["pool_holder"]
    address = parse_store_settings(master.pool_extra).mooncake.master_server_address
    try:
        pids = (master.pid, holder.pid)
        inject(master, "kill", 0.2, stack)
        assert (master.restarts, holder.restarts) == (1, 1) and pids != (master.pid, holder.pid)
        host, port = address.split(":")
        assert port_open(host, int(port))
        # The new pool has memory again: a client without a segment of its own can store and read.
        client = MooncakeDistributedStore()
        assert client.setup(host, "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", address) == 0
        assert client.put("chaos-key", b"x" * 4096) == 0 and client.get("chaos-key") == b"x" * 4096
        client.close()
    finally:
        stack.stop()
    assert not any(m._alive() for m in (master, holder))


@pytest.mark.integration
def test_clients_record_answers_wrong_answers_cancellations_errors_and_retry_a_restarting_proxy():
    p, d = Stub("p0"), Stub("d0")
    right = Prompt("the cache", tuple(WORDS), 2)
    wrong = Prompt("another prompt", ("alpha", "beta", "delta"), 2)

    async def go():
        await p.start()
        await d.start()
        proxy = PDProxy([p.url], [d.url], Timeouts(connect=1, prefill=2, decode_read=2, probe=0.1))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        load = Load(url, "tiny", [right, wrong], clients=3, seed=1, think_s=0.01)
        runner = proxy.runner()
        try:
            async def serve_later():  # the proxy comes up 1 s after the clients start: they retry
                await asyncio.sleep(1)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", port).start()
                await asyncio.sleep(1.5)
                d.mode = "fail"  # the decode breaks: requests go to the prefill alone
                p.mode = "fail"  # and then nothing answers
                await asyncio.sleep(0.5)
                await load.stop()

            await asyncio.gather(load.run(), serve_later())
            return load
        finally:
            await runner.cleanup()
            await p.stop()
            await d.stop()

    load = asyncio.run(go())
    recs = load.records
    by = {o: [r for r in recs if r.outcome == o] for o in ("answered", "wrong", "cancelled", "error")}
    assert sum(map(len, by.values())) == len(recs) > 20 and load.in_flight == 0
    assert {r.prompt for r in by["answered"]} == {0} and {r.prompt for r in by["wrong"]} == {1}
    assert all(r.mode == "cancel" for r in by["cancelled"]) and by["cancelled"]
    assert recs[0].retries >= 1 and recs[0].outcome != "error"  # connection refused, retried, then served
    assert {r.path for r in by["answered"]} >= {"pd"}
    assert by["error"] and all(r.status == 502 and "no backend could serve" in r.error for r in by["error"])
    assert load.summary()["requests"] == len(recs)


@pytest.mark.integration
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_cancel_probe_leaves_and_the_decode_sees_it(stream):
    p, d = Stub("p0"), Stub("d0", mode="endless_stream" if stream else "hang")

    async def go(session, url, proxy):
        left = await cancel_probe(url, "tiny", "the cache", stream, lambda: bool(d.requests))
        while not d.cancelled and time.monotonic() - left < 15:
            await asyncio.sleep(0.05)
        return left

    left = asyncio.run(with_proxy([p], [d], go, Timeouts(connect=1, prefill=30, decode_read=30)))
    assert d.requests[0]["body"]["max_tokens"] == 600 and d.requests[0]["body"]["ignore_eos"] is True
    assert d.cancelled and d.cancelled[0] - left < 15  # liveness: the client left; the 30 s timeouts come later


@pytest.mark.integration
def test_the_front_is_swapped_between_kvpp_proxy_and_vllm_router_and_counted_by_each(tmp_path):
    """`kvpp chaos --front`: start_front puts either front in front of the stack's engines (here stub engines,
    the fronts real), replacing the one there, and the report counts each front's requests from its own
    metrics (vllm-router's on their own port)."""
    with stubs_in_thread("prefill", "decode") as stubs:
        stack = Stack(engines={"prefill": stubs[0].url, "decode": stubs[1].url})
        try:
            counts = {}
            for front in ("vllm-router", "kvpp-proxy"):
                start_front(stack, front, tmp_path, StackSettings())
                assert stack.front == front and list(stack.members) == ["proxy"]
                post(f"{stack.proxy_url}/v1/completions", dict(REQUEST))
                counts[front] = _front_counts(stack)
        finally:
            stack.stop()
    assert counts["vllm-router"] == {"requests": 1, "prefill_errors": 0, "decode_errors": 0, "stream_errors": 0}
    assert counts["kvpp-proxy"]["pd"] == 1
    assert len(stubs[0].requests) == len(stubs[1].requests) == 2  # each front: prefill leg, then decode leg


@pytest.mark.unit
def test_a_pull_probe_fails_on_a_wrong_answer_a_request_past_the_bound_plus_a_recompute_or_no_stalled_pull():
    from deploy.harness.chaos_pulls import PROBE_SLACK_S, judge, pull_limit_s

    assert pull_limit_s(2.0, 0.8) == 2.0 + 2 + 0.8 + PROBE_SLACK_S
    assert pull_limit_s(1.5, 0.8) == 1.5 + 2 + 0.8 + PROBE_SLACK_S  # Mooncake's progress timeout: whole seconds
    recompute = [{"outcome": "answered", "seconds": 0.5}, {"outcome": "answered", "seconds": 0.8}]
    answered = {"outcome": "answered", "seconds": 2.3}
    stalled = {"stalled_pulls": 2, "failed_pulls": 2, "pulls": 0, "retried_reads": 0}
    probe = {"requests": [answered] * 3, "warm_up": answered, "stopped_s": 2.5, "counters": stalled}
    ok = judge("stall prefill", probe, recompute, 2.0)
    assert ok["problems"] == [] and (ok["recompute_s"], ok["limit_s"], ok["slowest_s"]) == (0.8, 5.8, 2.3)
    slow = judge("stall prefill", {**probe, "requests": [answered, {"outcome": "answered", "seconds": 6.0}]},
                 recompute, 2.0)
    assert slow["problems"] == ["stall prefill: a request took 6.0 s, over the limit 5.8 s (stall bound 2 s + its "
                                "reads ending + recompute 0.8 s + 1 s)"]
    wrong = judge("idle pd", {"requests": [answered, {"outcome": "wrong", "seconds": 1.0}], "gap_s": 8,
                              "counters": stalled}, recompute, 2.0)
    assert wrong["problems"] == ["idle pd: a request wrong"]
    untested = judge("stall prefill", {**probe, "counters": {**stalled, "stalled_pulls": 0}}, recompute, 2.0)
    assert untested["problems"] == ["stall prefill: no pull met the stopped prefill (the decode counted no stalled pull)"]


@pytest.mark.unit
def test_a_slow_probe_request_names_the_pull_failures_the_decode_logged_during_the_probe(tmp_path):
    from deploy.harness.chaos_pulls import judge, pull_log

    log = tmp_path / "decode.log"
    log.write_text("ERROR [worker.py:205] request r0: pulling KV from prefill p failed: an earlier probe's\n")
    offset = log.stat().st_size
    with open(log, "a") as out:
        out.write("INFO [metrics.py:103] KV Transfer metrics: failed_pulls=1\n"
                  "ERROR [worker.py:205] request r1: pulling KV from prefill p failed: no answer within 2 s\n"
                  "ERROR [worker.py:300] request r2: 4 reads of its failed pull were still in flight for Mooncake 4 s "
                  "after the pull ended, past its own bound (MC_TCP_PROGRESS_TIMEOUT_SEC=3); reporting the blocks\n")
    lines = pull_log(log, offset)
    assert [line.split()[3] for line in lines] == ["r1:", "r2:"]
    answered = {"outcome": "answered", "seconds": 7.2}
    probe = {"requests": [answered], "counters": {"stalled_pulls": 1}, "decode_log": lines}
    (problem,) = judge("idle pd", probe, [{"outcome": "answered", "seconds": 0.4}], 2.0)["problems"]
    assert problem.endswith("the decode logged: " + " | ".join(lines))


@pytest.mark.unit
def test_the_short_schedule_stalls_the_prefill_s_pulls_and_idles_past_mooncake_s_lane_timeout():
    from deploy.harness.chaos import PROBES
    from deploy.harness.chaos_pulls import IDLE_GAP_S

    from deploy.harness.chaos_pool import POOL_PROBE_CLIENTS, POOL_STALL_S
    from tests.helpers.store_config import BASE
    from connectors.store.settings import parse_store_settings

    probes = [(f.kind, f.target) for f in SHORT_SCHEDULE if f.kind in PROBES]
    assert probes == [("cancel", "stream"), ("cancel", "plain"), ("stall", "prefill"), ("idle", "pd"), ("stall", "pool")]
    assert IDLE_GAP_S > 5  # Mooncake #4209: lanes rejected transfers after about 5 s idle
    defaults = parse_store_settings(BASE)
    assert POOL_STALL_S > max(defaults.request_budget_s, defaults.call_policy.ceiling_s) and POOL_PROBE_CLIENTS >= 4


@pytest.mark.unit
def test_a_pool_probe_fails_on_a_wrong_answer_a_request_waiting_out_the_stall_or_a_breaker_never_opened():
    from deploy.harness.chaos_pool import judge
    from deploy.harness.chaos_pulls import PROBE_SLACK_S

    recompute = [{"outcome": "answered", "seconds": 0.5}, {"outcome": "answered", "seconds": 0.9}]
    answered = {"outcome": "answered", "seconds": 3.1}
    counters = {"breaker_opens": 2, "load_timeouts": 3}
    probe = {"requests": [answered] * 4, "counters": counters, "clients": 4, "stopped_s": 12.0, "pool_answered": True}
    ok = judge("stall pool", probe, recompute, 4.0)
    assert ok["problems"] == [] and (ok["limit_s"], ok["slowest_s"], ok["over_limit"]) == (
        4.0 + 0.9 + PROBE_SLACK_S, 3.1, 0)
    late = judge("stall pool", {**probe, "requests": [answered, {"outcome": "answered", "seconds": 7.0}]}, recompute,
                 4.0)
    assert late["problems"] == [] and late["over_limit"] == 1, "past the limit is counted, not a failed verdict"
    slow = judge("stall pool", {**probe, "requests": [answered, {"outcome": "answered", "seconds": 12.4}]},
                 recompute, 4.0)
    assert slow["problems"] == ["stall pool: a request took 12.4 s, waiting out the pool's 12 s stall"]
    wrong = judge("stall pool", {**probe, "requests": [{"outcome": "wrong", "seconds": 1.0}]}, recompute, 4.0)
    assert wrong["problems"] == ["stall pool: a request wrong"]
    untested = judge("stall pool", {**probe, "counters": {"breaker_opens": 0}}, recompute, 4.0)
    assert untested["problems"] == ["stall pool: the prefill's breaker never opened (no store call met the stall)"]
    assert judge("stall pool", {**probe, "requests": []}, recompute, 4.0)["problems"] == [
        "stall pool: no request overlapped the stall"]
    assert judge("stall pool", {**probe, "pool_answered": False}, recompute, 4.0)["problems"] == [
        "stall pool: the prefill counted no pool hit within 90 s: the pool was not stopped"]
