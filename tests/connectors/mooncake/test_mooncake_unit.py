"""MooncakeConnectorV2 pure-Python parts: wire validation, coalescing, batching, read planning."""

from __future__ import annotations

import pickle
import time
from types import SimpleNamespace

import msgspec
import pytest

from connectors.mooncake import messages as m
from connectors.mooncake.plan import IncompatiblePeerError, build_descs, check_compatible, choose_sources
from connectors.mooncake.settings import parse_settings
from connectors.mooncake.plan import block_runs
from connectors.mooncake.transfer import Desc, coalesce, cut_entries, split_batches

# A scheduler step that computes tokens (the connector only reads its token count).
STEP = SimpleNamespace(total_num_scheduled_tokens=1, num_scheduled_tokens={})

pytestmark = pytest.mark.unit

V = m.PROTOCOL_VERSION
BLOCK = 16 * 576 * 4
TOKEN = "t" * 43
OTHER = "o" * 43


def layer(name, base, owner=None, num_blocks=64, block_len=BLOCK, stride=BLOCK):
    return m.LayerDesc(name=name, base_addr=base, num_blocks=num_blocks, block_len=block_len,
                       block_stride=stride, owner=owner)


def meta(tp_rank, layers, tp_size=2, kvpp=False, **kw):
    fields = dict(version=V, engine_id="pre", tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                  te_host="127.0.0.1", te_rpc_port=20000 + tp_rank, model="DeepseekV2ForCausalLM/layers=4",
                  dtype="float32", block_size=16, kvpp=kvpp, layers=layers)
    fields.update(kw)
    return m.WorkerMeta(**fields)


def names(n):
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


# ---- messages ----------------------------------------------------------------------------------

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
                 te_rpc_port=1, model="x", dtype="float32", block_size=16, kvpp=True,
                 layers=[dict(name="model.layers.0.a", base_addr=1, num_blocks=1, block_len=8,
                              block_stride=8, owner=1)])
    with pytest.raises(m.MessageError, match="owned by rank 1"):
        m.decode(frame)


def test_layer_desc_rejects_overlapping_blocks():
    frame = _raw(type="meta", version=V, engine_id="e", tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, te_host="h",
                 te_rpc_port=1, model="x", dtype="f", block_size=16, kvpp=False,
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


# ---- settings ----------------------------------------------------------------------------------

def test_settings_defaults_and_errors():
    s = parse_settings(None)
    assert (s.protocol, s.transfer_timeout_s, s.hold_timeout_s, s.lease_s, s.max_batch_entries) == ("tcp", 30, 30.0, 5.0, 1024)
    assert (s.max_parallel_pulls, s.max_pulls_per_prefill) == (4, 2)
    with pytest.raises(ValueError, match="lease_s 40.0 exceeds hold_timeout_s 30.0"):
        parse_settings({"lease_s": 40})
    with pytest.raises(ValueError, match="accepted keys: protocol"):
        parse_settings({"protocl": "tcp"})
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        parse_settings({"transfer_timeout_s": 2})


# ---- coalescing and batching -------------------------------------------------------------------

def test_coalesce_merges_runs_adjacent_on_both_sides_only():
    descs = [Desc(0, 1000, 10), Desc(10, 1010, 10), Desc(20, 1020, 10),  # one run
             Desc(30, 2000, 10),  # local adjacent, remote not
             Desc(50, 2010, 10),  # remote adjacent, local not
             Desc(60, 2020, 5)]
    assert coalesce(descs) == [Desc(0, 1000, 30), Desc(30, 2000, 10), Desc(50, 2010, 15)]


def test_coalesce_keeps_order_and_rejects_empty_copies():
    assert coalesce([Desc(10, 10, 5), Desc(0, 0, 5)]) == [Desc(10, 10, 5), Desc(0, 0, 5)]
    with pytest.raises(ValueError, match="positive"):
        coalesce([Desc(0, 0, 0)])


def test_split_batches_respects_limit():
    descs = [Desc(i * 20, i * 20, 10) for i in range(2500)]
    batches = split_batches(descs, 1024)
    assert [len(b) for b in batches] == [1024, 1024, 452]
    assert [d for b in batches for d in b] == descs
    with pytest.raises(ValueError):
        split_batches(descs, 0)


def test_cut_entries_bounds_each_copy():
    cut = cut_entries([Desc(0, 1000, 25), Desc(100, 2000, 10)], max_bytes=10)
    assert cut == [Desc(0, 1000, 10), Desc(10, 1010, 10), Desc(20, 1020, 5), Desc(100, 2000, 10)]
    with pytest.raises(ValueError):
        cut_entries([], 0)


def test_block_runs_follow_both_sides():
    assert block_runs([4, 5, 6, 9, 10, 11], [1, 2, 9, 10, 11, 3]) == [(4, 1, 2), (6, 9, 1), (9, 10, 2), (11, 3, 1)]
    assert block_runs([], []) == []
    # descending on both sides (blocks vLLM freed in reverse order) is one range each
    assert block_runs([9, 8, 7, 3, 4], [20, 19, 18, 5, 6]) == [(7, 18, 3), (3, 5, 2)]
    assert block_runs([9, 8, 7], [18, 19, 20]) == [(9, 18, 1), (8, 19, 1), (7, 20, 1)]  # opposite ways
    with pytest.raises(ValueError, match="2 local blocks for 1 remote"):
        block_runs([1, 2], [1])


# ---- read planning -----------------------------------------------------------------------------

def test_kvpp_layers_come_from_their_owner_and_mtp_is_spread():
    target = names(4)
    mtp = ["model.layers.4.mtp_block.attn", "model.layers.5.mtp_block.attn"]
    # KVPP on the prefill, TP=2: rank 0 owns layers 0-1, rank 1 layers 2-3, both hold the MTP caches.
    r0 = meta(0, [layer(target[0], 1 << 20, 0), layer(target[1], 2 << 20, 0),
                  layer(mtp[0], 3 << 20), layer(mtp[1], 4 << 20)], kvpp=True)
    r1 = meta(1, [layer(target[2], 5 << 20, 1), layer(target[3], 6 << 20, 1),
                  layer(mtp[0], 7 << 20), layer(mtp[1], 8 << 20)], kvpp=True)
    local = meta(0, [layer(n, (i + 10) << 20) for i, n in enumerate(target + mtp)], tp_size=1)
    src = choose_sources(local, [r1, r0], mla=True)
    assert {n: src[n][0].tp_rank for n in target} == {target[0]: 0, target[1]: 0, target[2]: 1, target[3]: 1}
    assert {src[n][0].tp_rank for n in mtp} == {0, 1}  # spread, not all from one rank
    assert src[target[2]][1].base_addr == 5 << 20


def test_kvpp_off_prefill_spreads_layers_over_ranks():
    target = names(4)
    r = [meta(t, [layer(n, (t * 8 + i + 1) << 20) for i, n in enumerate(target)]) for t in range(2)]
    local = meta(0, [layer(n, (i + 20) << 20) for i, n in enumerate(target)], tp_size=1)
    src = choose_sources(local, r, mla=True)
    assert [src[n][0].tp_rank for n in target] == [0, 1, 0, 1]


def test_missing_layer_is_refused_with_kvpp_hint():
    target = names(2)
    r0 = meta(0, [layer(target[0], 1 << 20, 0)], kvpp=True)
    local = meta(0, [layer(n, (i + 1) << 24) for i, n in enumerate(target)], tp_size=1)
    with pytest.raises(IncompatiblePeerError, match=r"layers\.1\..*KVPP on the prefill"):
        choose_sources(local, [r0], mla=True)


def test_non_mla_reads_same_tp_rank_only():
    target = names(2)
    r = [meta(t, [layer(n, (t * 8 + i + 1) << 20) for i, n in enumerate(target)]) for t in range(2)]
    local = meta(1, [layer(n, (i + 20) << 20) for i, n in enumerate(target)], tp_size=2)
    src = choose_sources(local, r, mla=False)
    assert {src[n][0].tp_rank for n in target} == {1}
    with pytest.raises(IncompatiblePeerError, match="only MLA"):
        check_compatible(meta(0, [], tp_size=1), r, mla=False)


@pytest.mark.parametrize("key, value", [("model", "LlamaForCausalLM/layers=4"), ("dtype", "bfloat16"),
                                        ("block_size", 32)])
def test_incompatible_prefill_is_refused(key, value):
    local = meta(0, [layer(names(1)[0], 1 << 20)], tp_size=1)
    with pytest.raises(IncompatiblePeerError, match=f"serves {key}="):
        check_compatible(local, [meta(0, [layer(names(1)[0], 1 << 20)], **{key: value})], mla=True)


def test_block_geometry_mismatch_is_refused():
    local = meta(0, [layer(names(1)[0], 1 << 20)], tp_size=1)
    peer = meta(0, [layer(names(1)[0], 1 << 20, block_len=BLOCK // 2, stride=BLOCK // 2)])
    with pytest.raises(IncompatiblePeerError, match="bytes per block"):
        check_compatible(local, [peer], mla=True)


def test_build_descs_addresses_and_coalescing():
    name = names(1)[0]
    peer = meta(0, [layer(name, 1 << 20, stride=2 * BLOCK)])  # interleaved remote pages
    local = {name: layer(name, 8 << 20)}
    per_peer = build_descs(local, {name: (peer, peer.layers[0])}, [4, 5, 6], [1, 2, 9])
    descs = per_peer["127.0.0.1:20000"]
    assert descs == [Desc((8 << 20) + b * BLOCK, (1 << 20) + r * 2 * BLOCK, BLOCK) for b, r in ((4, 1), (5, 2), (6, 9))]
    assert len(coalesce(descs)) == 3  # remote stride leaves gaps: nothing may merge
    dense = meta(0, [layer(name, 1 << 20)])
    merged = coalesce(build_descs(local, {name: (dense, dense.layers[0])}, [4, 5, 6], [1, 2, 3])["127.0.0.1:20000"])
    assert merged == [Desc((8 << 20) + 4 * BLOCK, (1 << 20) + BLOCK, 3 * BLOCK)]
    # dense pages: one copy per run before any coalescing
    assert build_descs(local, {name: (dense, dense.layers[0])}, [4, 5, 6], [1, 2, 3])["127.0.0.1:20000"] == merged


def test_build_descs_rejects_out_of_range_blocks():
    name = names(1)[0]
    peer = meta(0, [layer(name, 1 << 20, num_blocks=8)])
    with pytest.raises(IncompatiblePeerError, match="remote block 8"):
        build_descs({name: layer(name, 8 << 20)}, {name: (peer, peer.layers[0])}, [0], [8])


# ---- stats -------------------------------------------------------------------------------------

def test_stats_aggregate_reduce_and_pickle():
    from connectors.mooncake.stats import MooncakeV2Stats

    a = MooncakeV2Stats()
    assert a.is_empty()
    a.record_transfer(1_000_000, 0.5, 3)
    a.record_failure()
    snap = a.clone_and_reset()
    assert a.is_empty()
    b = pickle.loads(pickle.dumps(snap))
    b.aggregate(MooncakeV2Stats(data={"bytes": 1_000_000, "transfers": 1, "failures": 0, "seconds": 0.5, "entries": 1}))
    red = b.reduce()
    assert red["pulled_bytes"] == 2_000_000 and red["pulled_requests"] == 2 and red["failed_pulls"] == 1
    assert red["throughput_MBps"] == 2.0 and red["batch_entries"] == 4


# ---- scheduler side ----------------------------------------------------------------------------

def _scheduler(hold=7.0, **settings):
    from connectors.mooncake.scheduler import MooncakeV2Scheduler
    from connectors.mooncake.settings import Settings

    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1,
                                        prefill_context_parallel_size=1, data_parallel_size=1,
                                        data_parallel_rank=0),
        kv_transfer_config=SimpleNamespace(kv_port=37000),
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(max_model_len=4096),
    )
    return MooncakeV2Scheduler(cfg, "engine-p", Settings(hold_timeout_s=hold, **settings))


def _request(params, status=None, prompt=40, computed=40):
    return SimpleNamespace(request_id="req-1", kv_transfer_params=params, status=status,
                           num_prompt_tokens=prompt, num_computed_tokens=computed)


def test_prefill_holds_finished_request_and_returns_handle():
    from vllm.v1.request import RequestStatus

    sched = _scheduler()
    delay, params = sched.request_finished(_request({"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED), [5, 6, 7])
    assert delay is True and sched.has_pending_block_frees()
    h = m.parse_handle(params)
    assert (h.remote_block_ids, h.remote_num_tokens, h.remote_tp_size, h.remote_kv_port) == ([5, 6, 7], 40, 2, 37000)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert 6.0 < h.remote_hold_expires_at - time.time() <= 7.0
    meta_ = sched.build_connector_meta(STEP)
    assert meta_.holds == {"req-1": 7.0} and sched.build_connector_meta(STEP).holds == {}
    assert meta_.tokens == {"req-1": h.remote_token} and len(h.remote_token) >= 43
    sched.update_connector_output(SimpleNamespace(finished_sending={"req-1"}, finished_recving=None))
    assert not sched.has_pending_block_frees()


def test_prefill_frees_aborted_request_at_once():
    from vllm.v1.request import RequestStatus

    sched = _scheduler()
    assert sched.request_finished(_request({"do_remote_decode": True}, RequestStatus.FINISHED_ABORTED), [5]) == (False, None)
    assert sched.build_connector_meta(STEP).holds == {}


def test_decode_counts_remote_tokens_and_maps_blocks():
    sched = _scheduler()
    params = m.PrefillHandle(remote_engine_id="p", remote_request_id="pr", remote_token=TOKEN, remote_host="127.0.0.1",
                             remote_kv_port=37000, remote_tp_size=2, remote_block_ids=[10, 11, 12],
                             remote_num_tokens=40).to_params()
    req = _request(params, computed=0)
    assert sched.get_num_new_matched_tokens(req, 0) == (40, True)
    assert sched.get_num_new_matched_tokens(req, 40) == (0, False)
    blocks = SimpleNamespace(blocks=[[SimpleNamespace(block_id=b, block_hash=None) for b in (3, 4, 5)]])
    sched.update_state_after_alloc(req, blocks, 40)
    (load,) = sched.build_connector_meta(STEP).loads
    assert (load.local_block_ids, load.remote_block_ids) == ((3, 4, 5), (10, 11, 12))
    assert req.kv_transfer_params["do_remote_prefill"] is False
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # one pull per request


def test_decode_with_bad_params_computes_locally():
    sched = _scheduler()
    req = _request({"do_remote_prefill": True, "remote_engine_id": "p"}, computed=0)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_decode_abort_before_schedule_still_frees_prefill():
    sched = _scheduler()
    params = m.PrefillHandle(remote_engine_id="p", remote_request_id="pr", remote_token=TOKEN, remote_host="127.0.0.1",
                             remote_kv_port=37000, remote_tp_size=1, remote_block_ids=[1],
                             remote_num_tokens=10).to_params()
    assert sched.request_finished(_request(params), []) == (False, None)
    (load,) = sched.build_connector_meta(STEP).loads
    assert load.local_block_ids == () and load.handle.remote_request_id == "pr"


def test_decode_renews_the_lease_from_arrival_until_the_pull_is_reported():
    sched = _scheduler(handshake_timeout_s=0.2)  # nobody listens on the prefill's ports here
    try:
        params = m.PrefillHandle(remote_engine_id="p", remote_request_id="pr", remote_token=TOKEN, remote_host="127.0.0.1",
                                 remote_kv_port=37000, remote_tp_size=1, remote_block_ids=[10, 11, 12],
                                 remote_num_tokens=40, remote_lease_s=3).to_params()
        req = _request(params, computed=0)
        sched.on_new_request(req)
        assert "req-1" in sched.leases  # claimed on arrival, while it waits in the queue
        blocks = SimpleNamespace(blocks=[[SimpleNamespace(block_id=b, block_hash=None) for b in (3, 4, 5)]])
        sched.update_state_after_alloc(req, blocks, 40)
        assert "req-1" in sched.leases  # still renewed while the pull runs
        sched.update_connector_output(SimpleNamespace(finished_sending=None, finished_recving={"req-1"}))
        assert "req-1" not in sched.leases
        sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1, num_scheduled_tokens={"req-1": 1}))
        phases = sched.get_stats().reduce()
        assert "admit_ms" in phases and "resume_ms" in phases

        other = _request(dict(params, remote_request_id="pr2", do_remote_prefill=True), computed=0)
        sched.on_new_request(other)
        assert "req-1" in sched.leases
        sched.request_finished(other, [])  # aborted while queued: stop renewing, free on the prefill
        assert "req-1" not in sched.leases
    finally:
        sched.shutdown()


def test_decode_parses_a_handle_once_per_request_and_derives_its_ports_once(monkeypatch):
    """Every scheduler hook reads the handle parsed when the request was first seen (one of them runs on
    every scheduling attempt); it is dropped once the pull is scheduled or the request ends."""
    from connectors.mooncake import scheduler as scheduler_module
    from connectors.mooncake.puller import prefill_ports

    parses, layouts = [], []
    monkeypatch.setattr(scheduler_module, "parse_handle", lambda p: parses.append(p) or m.parse_handle(p))
    layout = m.PortLayout
    monkeypatch.setattr(m, "PortLayout", lambda *a, **kw: layouts.append(a) or layout(*a, **kw))
    sched = _scheduler()
    try:
        params = m.PrefillHandle(remote_engine_id="p", remote_request_id="pr", remote_token=TOKEN,
                                 remote_host="127.0.0.1", remote_kv_port=37000, remote_tp_size=2,
                                 remote_block_ids=[10, 11, 12], remote_num_tokens=40).to_params()
        layouts.clear()  # the prefill's own
        req = _request(params, computed=0)
        sched.on_new_request(req)
        for _ in range(3):  # waiting for blocks: asked again on every scheduling attempt
            assert sched.get_num_new_matched_tokens(req, 0) == (40, True)
        blocks = SimpleNamespace(blocks=[[SimpleNamespace(block_id=b, block_hash=None) for b in (3, 4, 5)]])
        sched.update_state_after_alloc(req, blocks, 40)
        assert len(parses) == 1 and sched._handles == {}
        (load,) = sched.build_connector_meta(STEP).loads
        assert len(layouts) == 1  # derived when the handle was parsed, not per pull
        assert [prefill_ports(load.handle) for _ in range(3)] == [[(0, 0, 37000), (0, 1, 37001)]] * 3
        assert len(layouts) == 1

        aborted = _request(dict(params, remote_request_id="pr2", do_remote_prefill=True), computed=0)
        sched.on_new_request(aborted)
        sched.request_finished(aborted, [])
        assert len(parses) == 2 and sched._handles == {}
    finally:
        sched.shutdown()


def test_prefill_advertises_its_lease():
    from vllm.v1.request import RequestStatus

    sched = _scheduler(hold=9.0, lease_s=2.5)
    _, params = sched.request_finished(_request({"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED), [1])
    assert m.parse_handle(params).remote_lease_s == 2.5


# ---- pull pool ---------------------------------------------------------------------------------

def test_pulls_from_different_prefills_run_in_parallel_bounded_per_prefill():
    import threading

    from connectors.mooncake.pulls import PullPool

    pool = PullPool(workers=3, per_prefill=2)
    gate, lock = threading.Event(), threading.Lock()
    running: dict[str, int] = {"dead": 0, "live": 0}
    peak = dict(running)

    def pull(prefill):
        with lock:
            running[prefill] += 1
            peak[prefill] = max(peak[prefill], running[prefill])
        if prefill == "dead":
            gate.wait(10)  # a hung prefill
        with lock:
            running[prefill] -= 1
        return prefill

    try:
        hung = [pool.submit("dead", pull, "dead") for _ in range(5)]
        live = [pool.submit("live", pull, "live") for _ in range(4)]
        assert [f.result(timeout=5) for f in live] == ["live"] * 4  # not stuck behind the dead prefill
        assert peak == {"dead": 2, "live": 1} and not any(f.done() for f in hung)
        gate.set()
        assert [f.result(timeout=5) for f in hung] == ["dead"] * 5
        assert peak["dead"] == 2
    finally:
        gate.set()
        pool.shutdown()


# ---- prefill hold table ------------------------------------------------------------------------

class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_hold_released_only_when_every_decode_worker_is_done():
    from connectors.mooncake.holds import HoldTable

    clock = _Clock()
    table = HoldTable(timeout_s=30, clock=clock)
    table.hold("r", 30, TOKEN)
    table.release("r", "decode/pp0/tp0", num_consumers=2, token=TOKEN)
    assert table.pop_finished() == (set(), set()) and len(table) == 1
    table.release("r", "decode/pp0/tp0", num_consumers=2, token=TOKEN)  # a repeated notice does not count twice
    assert table.pop_finished() == (set(), set())
    table.release("r", "decode/pp0/tp1", num_consumers=2, token=TOKEN)
    assert table.pop_finished() == ({"r"}, set()) and len(table) == 0


def test_initial_lease_lapses_and_early_notice_is_kept():
    from connectors.mooncake.holds import HoldTable

    clock = _Clock()
    table = HoldTable(timeout_s=5, clock=clock)
    table.hold("orphan", 5, TOKEN)
    table.release("fast", "d", 1, TOKEN)  # notice before the scheduler announced the hold
    clock.now += 1
    table.hold("fast", 5, TOKEN)
    assert table.pop_finished() == ({"fast"}, set())
    clock.now += 3.5
    assert table.pop_finished() == (set(), set())
    clock.now += 0.5
    assert table.pop_finished() == (set(), {"orphan"})
    assert table.release("orphan", "d", 1, TOKEN) == "expired"  # too late: the blocks may be reused
    assert table.renew([("orphan", TOKEN)]) == [(0.0, "expired")]
    assert table.release("fresh", "d", 1, TOKEN) == "unknown"  # kept until its hold arrives


def test_renewals_shorten_the_initial_lease_and_keep_a_slow_decode_s_blocks():
    from connectors.mooncake.holds import HoldTable

    clock = _Clock()
    table = HoldTable(timeout_s=30, lease_s=4, clock=clock)
    for rid in ("dead", "slow", "unclaimed"):
        table.hold(rid, 30, TOKEN)
    assert _renew(table, "dead", "slow") == [4, 4]
    for _ in range(30):  # the slow decode renews every 2 s for a minute, twice the initial lease
        clock.now += 2
        assert _renew(table, "slow") == [4]
        released, lapsed = table.pop_finished()
        assert "slow" not in lapsed
        if clock.now - 100 < 4:
            assert lapsed == set()
        elif clock.now - 100 < 6:
            assert lapsed == {"dead"}  # 4 s after its last renewal, not after the 30 s initial lease
        if 30 <= clock.now - 100 < 32:
            assert lapsed == {"unclaimed"}  # never claimed: the initial lease applies
    assert table.release("slow", "d", 1, TOKEN) == "ok"
    assert table.pop_finished() == ({"slow"}, set())
    assert _renew(table, "slow") == [0.0]  # released: nothing to keep any more


def _renew(table, *request_ids, token=TOKEN):
    return [seconds for seconds, _ in table.renew((rid, token) for rid in request_ids)]


def test_early_renewal_is_honoured_when_the_hold_is_announced():
    from connectors.mooncake.holds import HoldTable

    clock = _Clock()
    table = HoldTable(timeout_s=5, lease_s=5, clock=clock)
    assert _renew(table, "early") == [5]
    clock.now += 1
    assert table.hold("early", 2, TOKEN) == 0  # shorter than the lease already granted: the grant wins
    clock.now += 4.9
    assert table.pop_finished() == (set(), set())
    clock.now += 0.2
    assert table.pop_finished() == (set(), {"early"})


def test_early_renewal_with_a_wrong_token_is_dropped_when_the_hold_arrives():
    from connectors.mooncake.holds import HoldTable

    clock = _Clock()
    table = HoldTable(timeout_s=5, lease_s=5, clock=clock)
    assert _renew(table, "r", token=OTHER) == [5]  # unchecked until the hold (and its token) arrives
    clock.now += 1
    assert table.hold("r", 2, TOKEN) == 1  # counted as refused; the forged grant does not extend the hold
    clock.now += 2
    assert table.pop_finished() == (set(), {"r"})


def test_table_of_unknown_notices_is_bounded_and_forgotten():
    from connectors.mooncake.holds import HoldTable

    clock = _Clock()
    table = HoldTable(timeout_s=5, clock=clock, max_unknown=100)
    for i in range(10_000):
        table.release(f"stray-{i}", "d", 1, TOKEN)
        _renew(table, f"claim-{i}")
    assert len(table._unknown) == 100 and "claim-9999" in table._unknown  # newest kept
    clock.now += 6
    table.pop_finished()
    assert not table._unknown and len(table) == 0
    table.hold("stray-9999", 5, TOKEN)  # a late hold is not released by the forgotten notice
    assert table.pop_finished() == (set(), set()) and len(table) == 1


def test_hold_table_answers_notices_and_renewals():
    from connectors.mooncake.holds import HoldTable

    from connectors.mooncake.channel import Refused
    from connectors.mooncake.responder import PrefillResponder

    table = HoldTable(timeout_s=30, lease_s=3, clock=_Clock())
    table.hold("r", 30, TOKEN)
    responder = PrefillResponder(table)
    renewal = m.LeaseRenewal(version=V, claims=[m.LeaseClaim(request_id="r", token=TOKEN),
                                                m.LeaseClaim(request_id="x", token=TOKEN)])
    assert responder(m.decode(m.encode(renewal))) == m.LeaseGrant(version=V, seconds=[3, 3])
    notice = m.DoneNotice(version=V, request_id="r", token=TOKEN, consumer="d", num_consumers=1, success=True)
    assert responder(notice) == m.Released(version=V, request_id="r", held=True)
    with pytest.raises(Refused) as info:
        responder(m.MetaRequest(version=V, request_id="r", token=TOKEN))
    assert info.value.code == "not_ready"


def test_lease_renewal_size_is_bounded():
    frame = _raw(type="lease", version=V, claims=[{"request_id": str(i), "token": TOKEN} for i in range(m.MAX_CLAIMS + 1)])
    with pytest.raises(m.MessageError, match="length"):
        m.decode(frame)


def test_read_is_trusted_only_within_the_granted_lease():
    from connectors.mooncake.channel import ChannelError
    from connectors.mooncake.puller import Puller

    def claim(*grants):
        answers = [g if isinstance(g, ChannelError) else m.LeaseGrant(version=V, seconds=[g]) for g in grants]
        return SimpleNamespace(sent_at=50.0, results=lambda: answers)

    assert Puller.lease_end(claim(5.0, 3.0)) == 53.0  # the shortest grant of all prefill workers
    assert Puller.lease_end(claim(5.0, 0.0)) is None  # one worker had freed the blocks
    assert Puller.lease_end(claim(5.0, ChannelError("no answer"))) is None
