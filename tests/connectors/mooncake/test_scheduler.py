"""MooncakeConnectorV2's scheduler side: prefill holds and handles, decode loads and leases, and bad
handles computed locally."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from connectors.mooncake import messages as m
from tests.helpers.curve_keys import load
from tests.helpers.mooncake_wire import HOSTILE_HANDLES, TOKEN, handle_params

pytestmark = pytest.mark.unit


# A scheduler step that computes tokens (the connector only reads its token count).
STEP = SimpleNamespace(total_num_scheduled_tokens=1, num_scheduled_tokens={})


def _scheduler(hold=7.0, **settings):
    from connectors.mooncake.scheduler import MooncakeV2Scheduler
    from connectors.mooncake.settings import MooncakeV2Settings

    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1,
                                        prefill_context_parallel_size=1, data_parallel_size=1,
                                        data_parallel_rank=0),
        kv_transfer_config=SimpleNamespace(kv_port=37000),
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(max_model_len=4096),
    )
    return MooncakeV2Scheduler(cfg, "engine-p", MooncakeV2Settings(hold_timeout_s=hold, **settings))


def _request(params, status=None, prompt=40, computed=40):
    return SimpleNamespace(request_id="req-1", kv_transfer_params=params, status=status,
                           num_prompt_tokens=prompt, num_computed_tokens=computed)


def test_prefill_holds_finished_request_and_returns_handle():
    from vllm.v1.request import RequestStatus

    sched = _scheduler()
    before = time.time()
    delay, params = sched.request_finished(_request({"do_remote_decode": True}, RequestStatus.FINISHED_LENGTH_CAPPED), [5, 6, 7])
    after = time.time()
    assert delay is True and sched.has_pending_block_frees()
    h = m.parse_handle(params)
    assert (h.remote_block_ids, h.remote_num_tokens, h.remote_tp_size, h.remote_kv_port) == ([5, 6, 7], 40, 2, 37000)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert before + 7.0 <= h.remote_hold_expires_at <= after + 7.0  # the 7 s hold, from when it finished
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


def _decode_scheduler(curve_dir=None):
    keys = {} if curve_dir is None else dict(curve_secret_key_file=str(curve_dir / "d.key_secret"),
                                             curve_public_keys_dir=str(curve_dir / "trusted"))
    return _scheduler(**keys)


def _decode_request(p):
    return SimpleNamespace(request_id="d-1", kv_transfer_params=p, status=None, num_prompt_tokens=40,
                           num_computed_tokens=0)


def test_decode_scheduler_computes_bad_handles_locally(caplog):
    sched = _decode_scheduler()
    tried = 0
    for over, _ in HOSTILE_HANDLES + [({"remote_block_ids": [3]}, ""), ({"remote_curve_key": "k" * 40}, "")]:
        req = _decode_request(handle_params(**over))
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False), over
        assert req.kv_transfer_params["do_remote_prefill"] is False
        tried += 1
    assert "computing its prompt locally" in caplog.text
    assert sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=1)).loads == []
    print(f"hostile handles given to the decode scheduler: {tried}, all computed locally")
    assert sched.get_num_new_matched_tokens(_decode_request(handle_params()), 0) == (40, True)


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


def test_decode_scheduler_refuses_untrusted_or_missing_curve_key(keys, caplog):
    sched = _decode_scheduler(keys)
    x_key = load(keys, "x").public.decode()
    p_key = load(keys, "p").public.decode()
    assert sched.get_num_new_matched_tokens(_decode_request(handle_params(remote_curve_key=x_key)), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(_decode_request(handle_params()), 0) == (0, False)
    assert "not among the trusted keys" in caplog.text and "unencrypted" in caplog.text
    assert sched.get_num_new_matched_tokens(_decode_request(handle_params(remote_curve_key=p_key)), 0) == (40, True)
