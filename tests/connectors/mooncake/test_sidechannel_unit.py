"""MooncakeConnectorV2's side channel under hostile input, pure-Python parts: tokens, handle bounds,
frame and message limits, the prefill's verdicts, counters and CURVE configuration. Each test that
throws hostile inputs says how many it tried (tests/connectors/mooncake/test_channel_server.py: the real server)."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import msgspec
import pytest
from hypothesis import given, settings, strategies as st
from tests.connectors.mooncake.test_mooncake_unit import _scheduler

from connectors.mooncake import messages as m
from connectors.mooncake.curve import CurveConfigError, create_keys, load_curve, server_key
from connectors.mooncake.holds import HoldTable
from connectors.mooncake.responder import PrefillResponder
from connectors.mooncake.settings import parse_settings
from connectors.mooncake.stats import MooncakeV2Stats

pytestmark = pytest.mark.unit

V = m.PROTOCOL_VERSION
TOKEN = "A" * 43
OTHER = "B" * 43


def worker_meta(engine: str = "pre") -> m.WorkerMeta:
    layer = m.LayerDesc(name="model.layers.0.self_attn.attn", base_addr=4096, num_blocks=8, block_len=64,
                        block_stride=64)
    return m.WorkerMeta(version=V, engine_id=engine, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                        te_host="127.0.0.1", te_rpc_port=12345, model="M/layers=1", dtype="float32",
                        block_size=16, kvpp=False, layers=[layer])


def params(**over):
    p = dict(remote_engine_id="pre", remote_request_id="cmpl-1-0-abcd", remote_token=TOKEN,
             remote_host="127.0.0.1", remote_kv_port=37000, remote_tp_size=2, remote_block_ids=[3, 4, 5],
             remote_num_tokens=40, do_remote_prefill=True)
    p.update(over)
    return p


# ---- handle bounds (unit) ----------------------------------------------------------------------

HOSTILE_HANDLES = [
    ({"remote_host": "127.0.0.1; touch /tmp/x"}, "remote_host"),
    ({"remote_host": "evil.example\n"}, "remote_host"),
    ({"remote_host": "host name"}, "remote_host"),
    ({"remote_host": "a\x00b"}, "remote_host"),
    ({"remote_host": "tcp://1.2.3.4:5"}, "remote_host"),
    ({"remote_host": "-lead.example"}, "remote_host"),
    ({"remote_host": "a..b"}, "remote_host"),
    ({"remote_host": "x" * 254}, "remote_host"),
    ({"remote_host": ""}, "remote_host"),
    ({"remote_host": "fe80::1%eth0 x"}, "remote_host"),
    ({"remote_host": 12}, "remote_host"),
    ({"remote_kv_port": 0}, "remote_kv_port"),
    ({"remote_kv_port": 65536}, "remote_kv_port"),
    ({"remote_kv_port": -1}, "remote_kv_port"),
    ({"remote_kv_port": 65535}, "beyond 65535"),  # the derived range of 2 workers + control port
    ({"remote_kv_port": 65000, "remote_dp_size": 300}, "beyond 65535"),
    ({"remote_tp_size": 1025}, "remote_tp_size"),
    ({"remote_tp_size": 64, "remote_pp_size": 32}, "more than 1024"),
    ({"remote_tp_size": 0}, "remote_tp_size"),
    ({"remote_dp_rank": 2, "remote_dp_size": 2}, "remote_dp_rank 2 outside"),
    ({"remote_engine_id": ""}, "remote_engine_id"),
    ({"remote_engine_id": "e" * 257}, "remote_engine_id"),
    ({"remote_engine_id": "pre\nFAKE LOG LINE"}, "remote_engine_id"),
    ({"remote_request_id": "r 1"}, "remote_request_id"),
    ({"remote_request_id": "r\x1b[31m"}, "remote_request_id"),
    ({"remote_request_id": "r\u00e9"}, "remote_request_id"),
    ({"remote_token": "short"}, "remote_token"),
    ({"remote_token": TOKEN + "\n"}, "remote_token"),
    ({"remote_token": "A" * 42 + "!"}, "remote_token"),
    ({"remote_token": None}, "remote_token"),
    ({"remote_block_ids": [1, 2 ** 31]}, "remote_block_ids"),
    ({"remote_block_ids": [1, 2 ** 70]}, "remote_block_ids"),
    ({"remote_curve_key": "x" * 39}, "remote_curve_key"),
    ({"remote_curve_key": "x" * 39 + " "}, "remote_curve_key"),
]


def test_hostile_handles_are_refused_before_any_connection():
    refused = 0
    for over, fragment in HOSTILE_HANDLES:
        with pytest.raises(m.MessageError, match="kv_transfer_params") as info:
            m.parse_handle(params(**over))
        assert fragment in str(info.value), (over, str(info.value))
        refused += 1
    missing = params()
    del missing["remote_token"]
    with pytest.raises(m.MessageError, match="remote_token"):
        m.parse_handle(missing)
    refused += 1
    print(f"hostile kv_transfer_params tried: {refused}, all refused")
    for host in ("10.0.0.7", "::1", "prefill-0.kvpp.svc.cluster.local", "node.", "localhost"):
        assert m.parse_handle(params(remote_host=host)).remote_host == host


@pytest.mark.parametrize("blocks, tokens, fragment", [
    ([3, 4], 40, "2 remote_block_ids for 40 tokens"),  # too few: claimed tokens would stay unread
    (list(range(8)), 40, "8 remote_block_ids"),  # far more than the prompt needs
    ([], 1, "0 remote_block_ids"),
    (list(range(300)), 4097, "exceeds this decode's max_model_len"),
])
def test_block_counts_must_match_tokens(blocks, tokens, fragment):
    h = m.parse_handle(params(remote_block_ids=blocks, remote_num_tokens=tokens))
    with pytest.raises(m.MessageError, match=fragment):
        h.check_blocks(block_size=16, max_tokens=4096)


def test_block_counts_allow_prompt_plus_lookahead():
    for n in (3, 3 + m.EXTRA_BLOCKS):
        m.parse_handle(params(remote_block_ids=list(range(n)))).check_blocks(block_size=16, max_tokens=4096)


def _decode_scheduler(curve_dir=None):
    keys = {} if curve_dir is None else dict(curve_secret_key_file=str(curve_dir / "d.key_secret"),
                                             curve_public_keys_dir=str(curve_dir / "trusted"))
    return _scheduler(**keys)


def _decode_request(p):
    return SimpleNamespace(request_id="d-1", kv_transfer_params=p, status=None, num_prompt_tokens=40,
                           num_computed_tokens=0)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)
TEXT = st.text(max_size=40) | st.text(alphabet=st.characters(max_codepoint=127), max_size=300)
INT = st.integers(-(2 ** 70), 2 ** 70) | st.integers(0, 70000)
# Per field a value of the right type most of the time (so one bad field at a time gets through the
# others), anything JSON otherwise.
HOSTILE_FIELDS = {
    **dict.fromkeys(["remote_engine_id", "remote_request_id", "remote_token", "remote_host", "remote_curve_key"],
                    TEXT | JSON),
    **dict.fromkeys(["remote_kv_port", "remote_tp_size", "remote_pp_size", "remote_pcp_size", "remote_dp_size",
                     "remote_dp_rank", "remote_num_tokens"], INT | JSON),
    "remote_block_ids": st.lists(INT, max_size=20) | JSON,
    "remote_hold_expires_at": st.floats() | JSON,
}


def test_fuzzed_handles_are_validated_or_refused_never_crash():
    """Whatever an HTTP client puts into kv_transfer_params: a valid handle within bounds, or a
    MessageError the decode turns into a local prefill; never another exception."""
    tried, refused = [], []

    @settings(max_examples=500, deadline=None)
    @given(st.fixed_dictionaries({}, optional=HOSTILE_FIELDS))
    def throw(over):
        tried.append(over)
        try:
            h = m.parse_handle(params(**over))
        except m.MessageError:
            refused.append(over)
            return
        m.check_host(h.remote_host, "remote_host")
        assert h.remote_tp_size * h.remote_pp_size * h.remote_pcp_size <= m.MAX_FANOUT
        assert m.is_ident(h.remote_request_id) and m.is_ident(h.remote_engine_id)

    throw()
    assert len(refused) > len(tried) // 3
    print(f"fuzzed kv_transfer_params tried: {len(tried)}, refused {len(refused)}, the rest within bounds")


def test_decode_scheduler_computes_bad_handles_locally(caplog):
    sched = _decode_scheduler()
    tried = 0
    for over, _ in HOSTILE_HANDLES + [({"remote_block_ids": [3]}, ""), ({"remote_curve_key": "k" * 40}, "")]:
        req = _decode_request(params(**over))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False), over
        assert req.kv_transfer_params["do_remote_prefill"] is False
        tried += 1
    assert "computing its prompt locally" in caplog.text
    assert sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1)).loads == []
    print(f"hostile handles given to the decode scheduler: {tried}, all computed locally")
    assert sched.get_num_new_matched_tokens(_decode_request(params()), 0) == (40, True)


def test_prefill_does_not_hold_a_request_whose_id_cannot_travel():
    from vllm.v1.request import RequestStatus

    sched = _decode_scheduler()
    req = SimpleNamespace(request_id="user id with spaces", kv_transfer_params={"do_remote_decode": True},
                          status=RequestStatus.FINISHED_LENGTH_CAPPED, num_prompt_tokens=20, num_computed_tokens=20)
    assert sched.request_finished(req, [1, 2]) == (False, None)
    assert not sched.has_pending_block_frees()


def test_tokens_are_fresh_per_request():
    from vllm.v1.request import RequestStatus

    sched = _decode_scheduler()
    tokens = set()
    for i in range(50):
        req = SimpleNamespace(request_id=f"p-{i}", kv_transfer_params={"do_remote_decode": True},
                              status=RequestStatus.FINISHED_LENGTH_CAPPED, num_prompt_tokens=20,
                              num_computed_tokens=20)
        _, p = sched.request_finished(req, [1, 2])
        tokens.add(m.parse_handle(p).remote_token)
    assert len(tokens) == 50 and all(len(t) >= 43 for t in tokens)  # 256 random bits each


# ---- messages and frames (unit) ----------------------------------------------------------------

def test_requests_without_token_or_with_bad_fields_do_not_decode():
    raw = msgspec.msgpack.encode
    frames = [
        raw({"type": "get_meta", "version": V}),
        raw({"type": "get_meta", "version": V, "request_id": "r"}),
        raw({"type": "get_meta", "version": V, "request_id": "r", "token": "short"}),
        raw({"type": "get_meta", "version": V, "request_id": "r\n", "token": TOKEN}),
        raw({"type": "done", "version": V, "request_id": "r", "consumer": "c", "num_consumers": 1, "success": True}),
        raw({"type": "done", "version": V, "request_id": "r", "token": TOKEN, "consumer": "c",
             "num_consumers": 5000, "success": True}),
        raw({"type": "get_meta", "version": V - 1, "request_id": "r", "token": TOKEN}),
    ]
    for frame in frames:
        with pytest.raises(m.MessageError):
            m.decode(frame, max_bytes=m.MAX_REQUEST_BYTES)
    print(f"hostile request frames tried: {len(frames)}, all refused")


def test_oversize_frames_are_refused_before_decoding():
    big = m.encode(m.Ack(version=V, ok=True)) + b" " * m.MAX_REQUEST_BYTES
    with pytest.raises(m.MessageError, match=f"exceeds the {m.MAX_REQUEST_BYTES}-byte limit"):
        m.decode(big, max_bytes=m.MAX_REQUEST_BYTES)
    with pytest.raises(m.MessageError, match="limit"):
        m.decode(b"\x00" * (m.MAX_REPLY_BYTES + 1))


def test_worker_meta_from_a_peer_is_bounded():
    good = msgspec.to_builtins(worker_meta()) | {"type": "meta"}
    hostile = [
        {"te_host": "1.2.3.4\nX"},
        {"te_host": "a b"},
        {"pp_rank": 1, "pp_size": 1},
        {"tp_size": 4096, "tp_rank": 0},
        {"engine_id": "x" * 300},
        {"model": "m\x00"},
        {"layers": [good["layers"][0]] * (m.MAX_LAYERS + 1)},
    ]
    for over in hostile:
        with pytest.raises(m.MessageError):
            m.decode(msgspec.msgpack.encode(good | over))
    print(f"hostile WorkerMeta replies tried: {len(hostile)}, all refused")


# ---- prefill hold table and responder (unit) ---------------------------------------------------

def test_done_notice_needs_the_live_token():
    table = HoldTable(timeout_s=30)
    table.hold("r", 30, TOKEN)
    assert table.authorize("r", OTHER) == "unauthorized"
    assert table.release("r", "attacker", 1, OTHER) == "unauthorized"
    assert table.pop_finished() == (set(), set()) and len(table) == 1  # still held
    assert table.authorize("r", TOKEN) == "ok" and table.authorize("nope", TOKEN) == "unknown"
    assert table.release("r", "decode/pp0/tp0", 1, TOKEN) == "ok"
    assert table.pop_finished() == ({"r"}, set())


def test_early_notice_with_wrong_token_is_dropped_when_the_hold_arrives():
    table = HoldTable(timeout_s=30)
    assert table.release("r", "attacker", 1, OTHER) == "unknown"
    assert table.release("r", "decode/pp0/tp0", 2, TOKEN) == "unknown"
    assert table.hold("r", 30, TOKEN) == 1  # the attacker's notice, counted by the caller
    assert table.pop_finished() == (set(), set())  # one genuine consumer of two so far
    table.release("r", "decode/pp0/tp1", 2, TOKEN)
    assert table.pop_finished() == ({"r"}, set())


def test_responder_verdicts():
    from connectors.mooncake.channel import Refused

    table = HoldTable(timeout_s=30)
    responder = PrefillResponder(table)
    ask = m.MetaRequest(version=V, request_id="r", token=TOKEN)
    assert responder(ask) is None  # hold not announced yet: the server defers
    table.hold("r", 30, TOKEN)
    with pytest.raises(Refused) as info:
        responder(ask)
    assert info.value.code == "not_ready"
    responder.meta = worker_meta()
    assert responder(ask) == responder.meta
    with pytest.raises(Refused) as info:
        responder(m.MetaRequest(version=V, request_id="r", token=OTHER))
    assert info.value.code == "unauthorized"
    with pytest.raises(Refused) as info:
        responder(m.DoneNotice(version=V, request_id="r", token=OTHER, consumer="c", num_consumers=1, success=True))
    assert info.value.code == "unauthorized"
    with pytest.raises(Refused) as info:
        responder(m.Ack(version=V, ok=True))
    assert info.value.code == "malformed"


def test_lease_renewal_needs_the_live_token():
    from connectors.mooncake.channel import Refused

    clock = [100.0]
    table = HoldTable(timeout_s=30, lease_s=3, clock=lambda: clock[0])
    granted = []
    responder = PrefillResponder(table, on_renewed=granted.append)
    table.hold("r", 5, TOKEN)
    table.hold("s", 5, TOKEN)

    def renewal(*claims):
        return m.LeaseRenewal(version=V, claims=[m.LeaseClaim(request_id=r, token=t) for r, t in claims])

    with pytest.raises(Refused) as info:  # only forged claims: refused like a forged notice
        responder(renewal(("r", OTHER)))
    assert info.value.code == "unauthorized" and info.value.reply is None
    clock[0] += 4
    with pytest.raises(Refused) as info:  # a batch with one forged claim: counted, the rest granted
        responder(renewal(("r", OTHER), ("s", TOKEN)))
    assert info.value.code == "unauthorized" and info.value.reply == m.LeaseGrant(version=V, seconds=[0.0, 3.0])
    clock[0] += 1
    assert table.pop_finished() == (set(), {"r"})  # the forged renewals did not keep r's blocks
    assert responder(renewal(("s", TOKEN))) == m.LeaseGrant(version=V, seconds=[3.0])
    assert granted == [0, 1, 1]  # per renewal: the claims that kept a live hold (forged ones never count)


def test_ended_hold_is_not_revived_by_a_late_or_replayed_notice():
    table = HoldTable(timeout_s=30)
    table.hold("r", 30, TOKEN)
    assert table.release("r", "d0", 1, TOKEN) == "ok"
    assert table.pop_finished() == ({"r"}, set())
    assert table.release("r", "d0", 1, TOKEN) == "ok"  # a repeated notice: the read was held
    assert table.release("r", "d1", 1, TOKEN) == "expired"  # anyone else: the blocks are gone
    assert table.release("r", "d0", 1, OTHER) == "unauthorized"
    assert table.renew([("r", TOKEN)]) == [(0.0, "expired")]
    assert table.authorize("r", TOKEN) == "expired"
    assert not table._unknown and len(table) == 0 and table.pop_finished() == (set(), set())


def test_refusals_and_leases_are_counted_in_stats_and_prometheus_keys():
    from connectors.mooncake.stats import MooncakeV2PromMetrics

    stats = MooncakeV2Stats()
    for code in ("unauthorized", "unknown_request", "malformed", "malformed", "expired", "internal"):
        stats.record_refusal(code)
    stats.record_leases(renewed=3)
    stats.record_leases(lapsed=1)
    assert not stats.is_empty()
    out = stats.clone_and_reset().reduce()
    assert (out["refused_requests"], out["malformed_frames"]) == (2, 2)
    assert (out["lease_renewals"], out["lapsed_holds"]) == (3, 1)
    assert {"refused", "malformed", "renewed", "lapsed"} <= set(MooncakeV2PromMetrics.COUNTERS)


# ---- settings and CURVE configuration (unit) ---------------------------------------------------

def test_settings_report_every_problem_at_once():
    with pytest.raises(ValueError) as info:
        parse_settings({"curve_secret_key": "/x", "hold_timout_s": 3, "transfer_timeout_s": 2,
                        "handshake_timeout_s": "5", "protocol": "tcp"})
    text = str(info.value)
    for fragment in ("unknown key 'curve_secret_key' (did you mean 'curve_secret_key_file'?)",
                     "unknown key 'hold_timout_s' (did you mean 'hold_timeout_s'?)",
                     "`$.transfer_timeout_s`", "`$.handshake_timeout_s`",
                     "accepted keys: protocol, device_name"):
        assert fragment in text, text
    assert parse_settings({"protocol": "rdma", "hold_timeout_s": 9}).hold_timeout_s == 9


@pytest.fixture
def keys(tmp_path):
    """Key pairs of a prefill (p), a decode (d) and a stranger (x); p and d trust each other."""
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    for name in ("p", "d", "x"):
        public, _ = create_keys(str(tmp_path), name)
        if name != "x":
            (trusted / public.name).write_bytes(public.read_bytes())
    return tmp_path


def load(keys_dir, name):
    return load_curve(str(keys_dir / f"{name}.key_secret"), str(keys_dir / "trusted"))


def test_keygen_writes_an_owner_only_secret(keys):
    assert stat.S_IMODE(os.stat(keys / "p.key_secret").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(keys / "p.key").st_mode) == 0o644
    with pytest.raises(FileExistsError):
        create_keys(str(keys), "p")
    k = load(keys, "p")
    assert k.public in k.trusted and len(k.trusted) == 2


@pytest.mark.parametrize("secret, directory, fragments", [
    ("p.key_secret", None, ["curve_public_keys_dir is missing"]),
    (None, "trusted", ["curve_secret_key_file is missing"]),
    ("p.key", "trusted", ["holds no secret key"]),
    ("nope.key_secret", "nowhere", ["cannot be read", "is not a directory"]),  # all problems at once
    ("p.key_secret", "empty", ["holds no public certificates"]),
])
def test_curve_settings_errors_name_the_key(keys, secret, directory, fragments):
    (keys / "empty").mkdir()
    with pytest.raises(CurveConfigError) as info:
        load_curve(str(keys / secret) if secret else "", str(keys / directory) if directory else "")
    for fragment in fragments:
        assert fragment in str(info.value)
    assert "python -m connectors.mooncake.curve" in str(info.value)


def test_world_readable_secret_is_refused(keys):
    os.chmod(keys / "p.key_secret", 0o644)
    with pytest.raises(CurveConfigError, match="readable by others.*chmod 600"):
        load(keys, "p")


def test_curve_agreement_between_handle_and_decode(keys):
    d = load(keys, "d")
    p_key = load(keys, "p").public.decode()
    x_key = load_curve(str(keys / "x.key_secret"), str(keys / "trusted")).public.decode()
    assert server_key(None, None) is None and server_key(d, p_key) == p_key.encode()
    for local, advertised, fragment in ((None, p_key, "requires CURVE"), (d, None, "unencrypted"),
                                        (d, x_key, "not among the trusted keys")):
        with pytest.raises(m.MessageError, match=fragment):
            server_key(local, advertised)


def test_decode_scheduler_refuses_untrusted_or_missing_curve_key(keys, caplog):
    sched = _decode_scheduler(keys)
    x_key = load(keys, "x").public.decode()
    p_key = load(keys, "p").public.decode()
    assert sched.get_num_new_matched_tokens(_decode_request(params(remote_curve_key=x_key)), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(_decode_request(params()), 0) == (0, False)
    assert "not among the trusted keys" in caplog.text and "unencrypted" in caplog.text
    assert sched.get_num_new_matched_tokens(_decode_request(params(remote_curve_key=p_key)), 0) == (40, True)


def test_curve_keygen_cli(tmp_path, capsys):
    from connectors.mooncake.curve import main

    assert main([str(tmp_path / "k"), "node1"]) == 0
    assert "node1.key" in capsys.readouterr().out
    assert main([str(tmp_path / "k"), "node1"]) == 1
    assert main([]) == 2





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
