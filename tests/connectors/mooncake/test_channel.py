"""MooncakeConnectorV2's real side-channel server (ZeroMQ on loopback, the prefill's responder, hold
table and counters) under hostile peers: wrong or absent tokens, oversize and fuzzed frames, CURVE.
Each test says how many hostile inputs it tried."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from connectors.mooncake import messages as m
from connectors.mooncake.channel import ChannelError, NoAnswer, SideChannelServer, call
from connectors.mooncake.curve import load_curve
from connectors.mooncake.holds import HoldTable
from connectors.mooncake.responder import PrefillResponder
from connectors.mooncake.stats import MooncakeV2Stats
from connectors.mooncake.transfer import MooncakeTransfer
from testbed.mooncake_peer import TOKEN as PEER_TOKEN, pages
from tests.helpers.curve_keys import load
from tests.helpers.mooncake_peers import handle, make_puller
from tests.helpers.mooncake_wire import KEY, OTHER, TOKEN, issued, worker_meta

V = m.PROTOCOL_VERSION


class Prefill:
    """One prefill worker's side channel as the connector builds it: responder, hold table, stats."""

    def __init__(self, port: int, defer_s: float = 0.0, curve=None) -> None:
        self.holds = HoldTable(timeout_s=30, key=KEY)
        self.stats = MooncakeV2Stats()
        self.responder = PrefillResponder(self.holds)
        self.responder.meta = worker_meta()
        self.handled = 0

        def handler(message):
            self.handled += 1
            return self.responder(message)

        self.server = SideChannelServer("127.0.0.1", port, handler, what="test prefill",
                                        on_refused=self.stats.record_refusal, defer_s=defer_s, curve=curve)
        self.port = port

    def counts(self) -> tuple[int, int]:
        return self.stats.data["refused"], self.stats.data["malformed"]


@pytest.fixture
def prefill(free_port):
    servers = []

    def start(**kw) -> Prefill:
        servers.append(Prefill(free_port, **kw))
        return servers[-1]

    yield start
    for p in servers:
        p.server.close()


def raw_request(port: int, frame: bytes, timeout_ms: int = 2000) -> bytes | None:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(frame)
        return sock.recv()
    except zmq.Again:
        return None
    finally:
        sock.close()


def notice(token: str, consumer: str = "decode/pp0/tp0") -> m.DoneNotice:
    return m.DoneNotice(version=V, request_id="r", token=token, consumer=consumer, num_consumers=1, success=True)


def ask(token: str, request_id: str = "r") -> m.MetaRequest:
    return m.MetaRequest(version=V, request_id=request_id, token=token)


@pytest.mark.integration
def test_done_notice_with_wrong_or_absent_token_leaves_blocks_held(prefill):
    p = prefill()
    p.holds.hold("r", 30, TOKEN)
    with pytest.raises(ChannelError, match="refused DoneNotice: unauthorized"):
        call("127.0.0.1", p.port, notice(OTHER), 2.0, m.Released)
    absent = msgspec.msgpack.encode({"type": "done", "version": V, "request_id": "r", "consumer": "c",
                                     "num_consumers": 1, "success": True})
    assert m.decode(raw_request(p.port, absent)) == m.Ack(version=V, ok=False, error="malformed")
    assert p.holds.pop_finished() == (set(), set()) and len(p.holds) == 1
    assert p.counts() == (1, 1)
    assert call("127.0.0.1", p.port, notice(TOKEN), 2.0, m.Released).held is True
    assert p.holds.pop_finished() == ({"r"}, set())
    print("hostile done-notices tried: 2, refused and counted; the blocks stayed held")


@pytest.mark.integration
def test_meta_request_without_the_token_gets_no_addresses(prefill):
    p = prefill(defer_s=0.3)
    p.holds.hold("r", 30, TOKEN)
    hostile = [
        msgspec.msgpack.encode({"type": "get_meta", "version": V}),  # protocol-1 style, no token
        msgspec.msgpack.encode({"type": "get_meta", "version": V, "request_id": "r"}),
        m.encode(ask(OTHER)),
        m.encode(ask(TOKEN, request_id="someone-else")),  # a live token for another request
    ]
    replies = [m.decode(raw_request(p.port, frame)) for frame in hostile]
    # Not even deferred: a token this engine did not issue for that request is refused at once.
    assert [r.error for r in replies] == ["malformed", "malformed", "unauthorized", "unauthorized"]
    assert not any(isinstance(r, m.WorkerMeta) for r in replies)
    assert p.counts() == (2, 2)
    assert call("127.0.0.1", p.port, ask(TOKEN), 2.0, m.WorkerMeta) == p.responder.meta
    print(f"hostile metadata requests tried: {len(hostile)}, none got addresses, all counted")


@pytest.mark.integration
def test_meta_request_before_the_hold_is_answered_once_it_arrives(prefill):
    p = prefill(defer_s=30.0)
    token = issued("r")
    start = time.monotonic()
    threading.Timer(0.3, lambda: p.holds.hold("r", 30, token)).start()
    # Answered once the hold arrives, not when the 30 s deferral ends: the call's own 10 s bound tells them apart
    # with room for a loaded host. It waited for the hold (a lower bound: load only adds to it).
    assert call("127.0.0.1", p.port, ask(token), 10.0, m.WorkerMeta) == p.responder.meta
    assert time.monotonic() - start >= 0.3
    assert p.counts() == (0, 0)


@pytest.mark.integration
def test_oversize_message_is_dropped_and_the_server_keeps_serving(prefill):
    p = prefill()
    p.holds.hold("r", 30, TOKEN)
    for size in (m.MAX_REQUEST_BYTES + 1, 1 << 20, 8 << 20):
        assert raw_request(p.port, b"\x00" * size, timeout_ms=500) is None  # ZeroMQ cut the connection
    assert p.handled == 0
    assert call("127.0.0.1", p.port, ask(TOKEN), 2.0, m.WorkerMeta) == p.responder.meta
    print("oversize frames tried: 3, all dropped without an answer")


@pytest.mark.integration
def test_replies_over_the_decode_limit_are_dropped(free_port):
    """A hostile 'prefill' answering with a huge frame: the decode's socket drops it (MAXMSGSIZE)."""
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.REP)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.bind(f"tcp://127.0.0.1:{free_port}")
    def serve():
        if rogue.poll(3000):
            rogue.recv()
            rogue.send(b"\x00" * (m.MAX_REPLY_BYTES + 1))

    t = threading.Thread(target=serve)
    t.start()
    with pytest.raises(NoAnswer):
        call("127.0.0.1", free_port, ask(TOKEN), 1.5, m.WorkerMeta)
    t.join()
    rogue.close()


INTS = st.integers(-(2 ** 63), 2 ** 64 - 1)  # what msgpack can carry
GARBAGE = st.one_of(
    st.binary(max_size=512),
    st.builds(msgspec.msgpack.encode, st.recursive(
        st.none() | st.booleans() | INTS | st.text(max_size=20) | st.binary(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
        max_leaves=12)),
    # Well-formed requests with guessed tokens: refused (live hold) or unknown, never obeyed.
    st.builds(lambda kind, rid, token: m.encode(
        m.MetaRequest(version=V, request_id=rid, token=token) if kind else
        m.DoneNotice(version=V, request_id=rid, token=token, consumer="c", num_consumers=1, success=True)),
        st.booleans(), st.sampled_from(["r", "r2", "cmpl-1"]),
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-", min_size=32,
                max_size=128)),
    st.builds(lambda d: msgspec.msgpack.encode({"type": "done", "version": V, **d}),
              st.dictionaries(st.sampled_from(["request_id", "token", "consumer", "num_consumers", "success"]),
                              st.one_of(st.text(max_size=60), INTS, st.booleans()), max_size=5)),
)


@pytest.mark.integration
def test_fuzzed_frames_never_crash_the_server_and_are_counted(prefill):
    p = prefill()
    p.holds.hold("r", 30, TOKEN)
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    sock.connect(f"tcp://127.0.0.1:{p.port}")
    tried = []

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(GARBAGE)
    def throw(frame):
        sock.send(frame)
        reply = m.decode(sock.recv())
        assert isinstance(reply, (m.Ack, m.Released)), reply
        if isinstance(reply, m.Ack):
            assert reply.error in ("malformed", "unauthorized", "unknown_request")
        tried.append(frame)

    try:
        throw()
    finally:
        sock.close()
    refused, malformed = p.counts()
    answered_ok = len(tried) - refused - malformed  # a random frame that happens to be valid
    assert answered_ok <= len(tried) // 4 and malformed > len(tried) // 2 and refused > 10
    assert len(p.holds) == 1  # nothing guessed the token
    # Frames that are not a REQ envelope at all (no reply possible) are counted too.
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{p.port}")
    for parts in ([b"x"], [b"a", b"b", b"c"], [b"", b"", b""], [b"x"] * 50):
        dealer.send_multipart(parts)
    deadline = time.monotonic() + 3
    while p.counts()[1] < malformed + 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    dealer.close()
    assert p.counts()[1] == malformed + 4
    assert p.server._thread.is_alive()
    assert call("127.0.0.1", p.port, ask(TOKEN), 2.0, m.WorkerMeta) == p.responder.meta
    print(f"fuzzed frames tried: {len(tried)} + 4 broken envelopes; refused {refused}, malformed "
          f"{malformed + 4}, early notices kept for unknown ids {answered_ok}, server alive")


@pytest.mark.integration
@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_admits_only_trusted_keys(prefill, keys):
    p = prefill(curve=load(keys, "p"))
    p.holds.hold("r", 30, TOKEN)
    p_key = load(keys, "p").public
    stranger = load_curve(str(keys / "x.key_secret"), str(keys / "trusted"))
    attempts = [
        None,  # plaintext client
        stranger.client(p_key),  # a key pair the prefill does not trust, even with the right token
    ]
    for secure in attempts:
        with pytest.raises(NoAnswer):
            call("127.0.0.1", p.port, ask(TOKEN), 1.0, m.WorkerMeta, secure=secure)
    assert p.handled == 0  # nothing reached the responder
    assert p.counts()[0] >= 1  # the ZAP denial of the untrusted key
    d = load(keys, "d")
    assert call("127.0.0.1", p.port, ask(TOKEN), 2.0, m.WorkerMeta, secure=d.client(p_key)) == p.responder.meta
    with pytest.raises(ChannelError, match="unauthorized"):  # CURVE does not replace the token
        call("127.0.0.1", p.port, ask(OTHER), 2.0, m.WorkerMeta, secure=d.client(p_key))
    # The decode's own pull path: the prefill's key comes with the handle and must be trusted.
    from connectors.mooncake.puller import Puller

    h = m.parse_handle(dict(remote_engine_id="pre", remote_request_id="r", remote_token=TOKEN,
                            remote_host="127.0.0.1", remote_kv_port=p.port, remote_tp_size=1,
                            remote_block_ids=[0], remote_num_tokens=16, remote_curve_key=p_key.decode()))
    secure_puller = Puller(None, worker_meta("decode"), timeout_s=2.0, consumer_id="d/pp0/tp0",
                           num_consumers=1, curve=d)
    assert secure_puller.peer_metas(h) == [p.responder.meta]
    with pytest.raises(m.MessageError, match="requires CURVE"):
        _decode_puller(1.0).peer_metas(h)
    print(f"peers without a trusted CURVE key tried: {len(attempts)}, none got an answer")


@pytest.mark.integration
def test_forged_done_notice_does_not_free_a_real_prefills_blocks(peers, free_port):
    """A stand-in prefill process with a real transfer engine: an attacker's notices (wrong token,
    or a live token for another request) are refused and counted; the decode's read is intact and
    its own notice frees the blocks."""
    peer = peers(free_port, layers=2, blocks=8, seed=5, holds={"r1": PEER_TOKEN, "r2": OTHER})
    forged = [
        m.DoneNotice(version=V, request_id="r1", token=OTHER, consumer="x", num_consumers=1, success=True),
        m.DoneNotice(version=V, request_id="r1", token="Z" * 43, consumer="x", num_consumers=1, success=True),
    ]
    for message in forged:
        with pytest.raises(ChannelError, match="unauthorized"):
            call("127.0.0.1", free_port, message, 2.0, m.Released)
        assert peer.line(timeout=5) == {"refused": "unauthorized"}
    te = MooncakeTransfer("127.0.0.1")
    try:
        kv, puller = make_puller(te, layers=2, blocks=8)
        h = handle(free_port, "r1", [1, 2, 3])
        assert h.remote_token == PEER_TOKEN
        puller.read(h, [0, 1, 2], [1, 2, 3])
        assert torch.equal(kv[:, :3], pages(2, 8, 5)[:, [1, 2, 3]])
        assert puller.notify(h, ok=True) == (True, [])
        assert peer.line(timeout=5) == {"released": "r1"}  # the first line after the refusals
    finally:
        te.close()
    print(f"forged done-notices sent to a real prefill: {len(forged)}, refused; its blocks stayed held")


@pytest.mark.integration
def test_transfer_engine_ports_are_not_guarded_by_the_side_channel():
    """What the threat model says about Mooncake's own ports, checked: a stranger's transfer engine
    learns a prefill's first registered buffer from the engine's handshake (no side channel, no
    token) and reads and writes it. If this ever fails, Mooncake gained access control: update
    the threat model in docs/security.md."""
    victim, stranger = MooncakeTransfer("127.0.0.1"), MooncakeTransfer("127.0.0.1")
    try:
        secret = torch.arange(1024, dtype=torch.float32)
        victim.register([(secret.data_ptr(), secret.numel() * 4)])
        buf = torch.zeros(1024)
        stranger.register([(buf.data_ptr(), buf.numel() * 4)])
        engine = stranger._engine
        addr = engine.get_first_buffer_address(victim.session)
        assert addr == secret.data_ptr()
        assert engine.batch_transfer_sync_read(victim.session, [buf.data_ptr()], [addr], [4096]) == 0
        assert torch.equal(buf, secret)
        buf.fill_(-1)
        assert engine.batch_transfer_sync_write(victim.session, [buf.data_ptr()], [addr], [16]) == 0
        assert secret[:4].tolist() == [-1.0] * 4
    finally:
        stranger.close()
        victim.close()


def _decode_puller(timeout_s: float):
    from connectors.mooncake.puller import Puller

    return Puller(None, worker_meta("decode"), timeout_s=timeout_s, consumer_id="decode/pp0/tp0",
                  num_consumers=1)


@pytest.mark.integration
def test_handle_claiming_more_workers_than_the_prefill_advertises_is_refused(prefill):
    p = prefill()
    p.holds.hold("r", 30, TOKEN)
    puller = _decode_puller(2.0)
    for tp, pp in ((2, 1), (1, 3), (16, 64)):
        h = m.parse_handle(dict(remote_engine_id="pre", remote_request_id="r", remote_token=TOKEN,
                                remote_host="127.0.0.1", remote_kv_port=p.port, remote_tp_size=tp,
                                remote_pp_size=pp, remote_block_ids=[0], remote_num_tokens=16))
        with pytest.raises(ChannelError, match=f"runs tp_size 1 x pp_size 1, but kv_transfer_params claim {tp} x {pp}"):
            puller.peer_metas(h)
    assert p.handled == 3  # only the first worker was asked, once per handle
    print("handles with an inflated fan-out tried: 3, refused after one metadata request each")


@pytest.mark.integration
def test_done_notices_to_unreachable_workers_cost_one_timeout(free_port):
    puller = _decode_puller(0.5)
    h = m.parse_handle(dict(remote_engine_id="pre", remote_request_id="r", remote_token=TOKEN,
                            remote_host="127.0.0.1", remote_kv_port=free_port, remote_tp_size=8,
                            remote_pp_size=4, remote_block_ids=[0], remote_num_tokens=16))
    held, errors = puller.notify(h, ok=False)
    # One timeout, counted: the first unreachable worker's error, and the other 31 never tried (not 32 x 0.5 s).
    assert held is None and len(errors) == 1 and "31 more workers not notified" in errors[0]


@pytest.mark.integration
def test_answers_of_a_stalled_peer_are_waited_for_until_the_caller_s_deadline_and_collected_once(free_port):
    """A decode waits for a stalled prefill's lease grant only until its pull's stall deadline, not the
    handshake timeout; a second look at the same answers does not wait again."""
    from connectors.mooncake.channel import Calls

    silent = zmq.Context.instance().socket(zmq.ROUTER)  # accepts the request, never answers: a stopped prefill
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(f"tcp://127.0.0.1:{free_port}")
    try:
        renewal = m.LeaseRenewal(version=m.PROTOCOL_VERSION, claims=[m.LeaseClaim(request_id="r", token=TOKEN)])
        calls = Calls([("127.0.0.1", free_port)], renewal, 30.0, m.LeaseGrant)
        (first,) = calls.results(until=calls.sent_at + 0.3)  # the deadline a caller derives from the send
        waited = time.monotonic() - calls.sent_at
        assert isinstance(first, NoAnswer) and "within 0.3s" in str(first)
        assert calls.results() is calls.results() and calls.results() == [first]  # collected once, not waited for again
        assert waited < 5  # 0.3 s asked for; never the 30 s call timeout
    finally:
        silent.close()


@pytest.mark.integration
def test_the_side_channel_over_ipv6():
    """A prefill on an IPv6 host binds tcp://[::1]:port and a decode dials it from the bare host a
    handle carries (remote_host "::1")."""
    from deploy.services.ports import free_port

    port = free_port("::1")
    seen = []

    def handler(message):
        seen.append(message)
        return m.Ack(version=V, ok=True)

    server = SideChannelServer("::1", port, handler, what="ipv6 prefill")
    try:
        reply = call("::1", port, m.MetaRequest(version=V, request_id="r1", token=TOKEN), 5.0, m.Ack)
    finally:
        server.close()
    assert reply.ok and [s.request_id for s in seen] == ["r1"]


@pytest.mark.unit
def test_refusal_log_lines_are_rate_limited(caplog):
    from connectors.mooncake.channel import _LogLimiter

    limiter = _LogLimiter()
    for i in range(1000):
        limiter.warn("malformed", "test prefill", f"frame {i}")
    limiter.warn("unauthorized", "test prefill", "wrong token")
    lines = [r.getMessage() for r in caplog.records if "refused a side-channel request" in r.getMessage()]
    assert len(lines) == 2 and "frame 0" in lines[0] and "(unauthorized)" in lines[1]
    limiter._last["malformed"] -= 2  # a second later the next line says how many were left out
    limiter.warn("malformed", "test prefill", "frame 1000")
    assert "(+999 more since the last line)" in caplog.records[-1].getMessage()
    print("refusals logged: 1001 malformed, 1 unauthorized -> 3 log lines")


@pytest.mark.integration
def test_the_decode_keeps_the_metadata_of_a_bounded_number_of_prefills(monkeypatch):
    """Least recently used first out: a prefill whose metadata was dropped is simply asked again."""
    from connectors.mooncake import puller as puller_module
    from deploy.services.ports import free_port

    monkeypatch.setattr(puller_module, "MAX_PEERS", 2)
    servers = []
    for _ in range(3):
        servers.append(Prefill(free_port()))
        servers[-1].holds.hold("r", 30, TOKEN)
    try:
        handles = [m.parse_handle(dict(remote_engine_id="pre", remote_request_id="r", remote_token=TOKEN,
                                       remote_host="127.0.0.1", remote_kv_port=s.port, remote_tp_size=1,
                                       remote_block_ids=[0], remote_num_tokens=16)) for s in servers]
        puller = _decode_puller(2.0)
        for i in (0, 1, 0, 2, 1):  # 0 used again before 2 comes: 1 is the one dropped, then 0
            assert puller.peer_metas(handles[i]) == [servers[i].responder.meta]
        assert [s.handled for s in servers] == [1, 2, 1] and len(puller._peers) == 2
    finally:
        for s in servers:
            s.server.close()
