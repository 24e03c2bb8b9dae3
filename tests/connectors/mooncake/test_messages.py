"""Side-channel messages and kv_transfer_params: typed round trips, and every bound a hostile peer or
HTTP client meets (each test that throws hostile inputs says how many it tried)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings, strategies as st

from connectors.mooncake import messages as m
from tests.helpers.mooncake_wire import HOSTILE_HANDLES, TOKEN, V, handle_params, layer, meta, names, worker_meta

pytestmark = pytest.mark.unit


def test_messages_round_trip_typed():
    sent = meta(1, [layer(names(1)[0], 4096, owner=1)], kvpp=True)
    got = m.decode(m.encode(sent), m.WorkerMeta)
    assert got == sent and got.te_session == "127.0.0.1:20001"
    notice = m.DoneNotice(version=V, request_id="r", token=TOKEN, consumer="d/pp0/tp0", num_consumers=1,
                          success=True)
    assert m.decode(m.encode(notice)) == notice


def _raw(**fields):
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize("frame, fragment", [
    (_raw(type="ack", version=V + 1, ok=True), "protocol version"),
    (_raw(type="ack", version=V), "ok"),
    (_raw(type="ack", version=V, ok=True, extra=1), "extra"),
    (_raw(type="pickle", version=V), "pickle"),
    (b"\x80\x04not msgpack", "invalid"),
    (_raw(type="done", version=V, request_id="r", token=TOKEN, consumer="c", num_consumers=0, success=True), ">= 1"),
])
def test_decode_rejects_bad_frames(frame, fragment):
    with pytest.raises(m.MessageError, match="invalid MooncakeConnectorV2") as info:
        m.decode(frame)
    assert fragment in str(info.value)


def test_decode_rejects_unexpected_type():
    with pytest.raises(m.MessageError, match="expected a WorkerMeta"):
        m.decode(m.encode(m.Ack(version=V, ok=True)), m.WorkerMeta)


def test_worker_meta_rejects_foreign_owner_under_kvpp():
    frame = _raw(type="meta", version=V, engine_id="e", tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, te_host="h",
                 te_rpc_port=1, model="x", dtype="float32", block_size=16, kvpp=True, kv_heads=None,
                 layers=[dict(name="model.layers.0.a", base_addr=1, num_blocks=1, block_len=8,
                              block_stride=8, owner=1)])
    with pytest.raises(m.MessageError, match="owned by TP rank 1"):
        m.decode(frame)


def test_layer_desc_rejects_overlapping_blocks():
    frame = _raw(type="meta", version=V, engine_id="e", tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, te_host="h",
                 te_rpc_port=1, model="x", dtype="f", block_size=16, kvpp=False, kv_heads=None,
                 layers=[dict(name="l", base_addr=1, num_blocks=1, block_len=16, block_stride=8)])
    with pytest.raises(m.MessageError, match="block_stride 8 < block_len 16"):
        m.decode(frame)


def _params(**over):
    p = dict(remote_engine_id="e", remote_request_id="r", remote_token=TOKEN, remote_host="127.0.0.1",
             remote_kv_port=37000,
             remote_tp_size=2, remote_block_ids=[3, 4], remote_num_tokens=20, do_remote_prefill=True,
             proxy_added_key="ignored")
    p.update(over)
    return p


def test_parse_handle_accepts_params_and_ignores_foreign_keys():
    h = m.parse_handle(_params())
    assert h.remote_block_ids == [3, 4] and h.remote_pp_size == 1 and h.remote_dp_rank == 0
    assert m.parse_handle(h.to_params()) == h


@pytest.mark.parametrize("over, fragment", [
    ({"remote_kv_port": 70000}, "remote_kv_port"),
    ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
    ({"remote_tp_size": "2"}, "remote_tp_size"),
    ({"protocol_version": V + 1}, "protocol version"),
    ({"remote_dp_rank": 1}, "remote_dp_rank 1 outside"),
])
def test_parse_handle_rejects_bad_params(over, fragment):
    with pytest.raises(m.MessageError, match="kv_transfer_params") as info:
        m.parse_handle(_params(**over))
    assert fragment in str(info.value)


def test_parse_handle_names_missing_field():
    params = _params()
    del params["remote_host"]
    with pytest.raises(m.MessageError, match="remote_host"):
        m.parse_handle(params)


def test_lease_renewal_size_is_bounded():
    frame = _raw(type="lease", version=V, claims=[{"request_id": str(i), "token": TOKEN} for i in range(m.MAX_CLAIMS + 1)])
    with pytest.raises(m.MessageError, match="length"):
        m.decode(frame)


def test_hostile_handles_are_refused_before_any_connection():
    refused = 0
    for over, fragment in HOSTILE_HANDLES:
        with pytest.raises(m.MessageError, match="kv_transfer_params") as info:
            m.parse_handle(handle_params(**over))
        assert fragment in str(info.value), (over, str(info.value))
        refused += 1
    missing = handle_params()
    del missing["remote_token"]
    with pytest.raises(m.MessageError, match="remote_token"):
        m.parse_handle(missing)
    refused += 1
    print(f"hostile kv_transfer_params tried: {refused}, all refused")
    for host in ("10.0.0.7", "::1", "prefill-0.kvpp.svc.cluster.local", "node.", "localhost"):
        assert m.parse_handle(handle_params(remote_host=host)).remote_host == host


@pytest.mark.parametrize("blocks, tokens, fragment", [
    ([3, 4], 40, "2 remote_block_ids for 40 tokens"),  # too few: claimed tokens would stay unread
    (list(range(8)), 40, "8 remote_block_ids"),  # far more than the prompt needs
    ([], 1, "0 remote_block_ids"),
    (list(range(300)), 4097, "exceeds this decode's max_model_len"),
])
def test_block_counts_must_match_tokens(blocks, tokens, fragment):
    h = m.parse_handle(handle_params(remote_block_ids=blocks, remote_num_tokens=tokens))
    with pytest.raises(m.MessageError, match=fragment):
        h.check_blocks(block_size=16, max_tokens=4096)


def test_block_counts_allow_prompt_plus_lookahead():
    for n in (3, 3 + m.EXTRA_BLOCKS):
        m.parse_handle(handle_params(remote_block_ids=list(range(n)))).check_blocks(block_size=16, max_tokens=4096)


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
            h = m.parse_handle(handle_params(**over))
        except m.MessageError:
            refused.append(over)
            return
        m.check_host(h.remote_host, "remote_host")
        assert h.remote_tp_size * h.remote_pp_size * h.remote_pcp_size <= m.MAX_FANOUT
        assert m.is_ident(h.remote_request_id) and m.is_ident(h.remote_engine_id)

    throw()
    assert len(refused) > len(tried) // 3
    print(f"fuzzed kv_transfer_params tried: {len(tried)}, refused {len(refused)}, the rest within bounds")


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
        {"kv_heads": []},
        {"kv_heads": [-1]},
        {"kv_heads": [0, 2]},  # not a run of heads vLLM gives one rank
        {"kv_heads": [1, 0]},
        {"kv_heads": list(range(m.MAX_KV_HEADS + 1))},
        {"kv_heads": "0"},
        {"version": V - 1, "kv_heads": None},  # a release whose decode would not check heads
        {"layers": [good["layers"][0]] * (m.MAX_LAYERS + 1)},
    ]
    for over in hostile:
        with pytest.raises(m.MessageError):
            m.decode(msgspec.msgpack.encode(good | over))
    print(f"hostile WorkerMeta replies tried: {len(hostile)}, all refused")


def test_side_channel_addresses_bracket_ipv6():
    from connectors.mooncake.channel import endpoint
    from connectors.mooncake.messages import WorkerMeta, check_host

    assert endpoint("fd00::1", 37000) == "tcp://[fd00::1]:37000"
    meta = WorkerMeta(version=m.PROTOCOL_VERSION, engine_id="e", tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                      te_host="fd00::1", te_rpc_port=15000, model="m", dtype="bfloat16", block_size=16, kvpp=False,
                      kv_heads=None, layers=[])
    assert meta.te_session == "[fd00::1]:15000"
    check_host("fd00::1", "remote_host")
    with pytest.raises(ValueError, match="scoped IPv6 address"):
        check_host("fe80::1%eth0", "remote_host")
    with pytest.raises(ValueError, match="neither an IP address nor a DNS name"):
        check_host("[fd00::1]", "remote_host")
