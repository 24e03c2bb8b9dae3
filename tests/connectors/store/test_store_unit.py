"""AscendStoreConnector pieces that need no services: settings, wire messages, the hit rule, save planning,
bounded backend calls and the KVPP startup refusals (which come from the launch check, connectors.launch)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import msgspec
import pytest

from connectors.store.backends.base import BoundedCalls, Status
from connectors.store.config import MooncakeSettings, StoreConfigError, parse_store_config
from connectors.store.keys import CacheLayout, block_hashes
from connectors.store.lookup import InvalidMessage, LookupReply, LookupRequest, validate_reply, validate_request
from connectors.store.shards import StageLayers, all_shards, count_pooled, hit_blocks, shard_keys, stage_shards

pytestmark = pytest.mark.unit

BASE = {"backend": "mooncake", "lookup_rpc_port": 6000, "mooncake": {"master_server_address": "127.0.0.1:1"}}


# ---- settings ----------------------------------------------------------------------------------
def test_defaults_and_backend_settings():
    cfg = parse_store_config(BASE)
    assert (cfg.load_async, cfg.use_layerwise, cfg.discard_partial_chunks, cfg.consumer_is_to_put) == (False, False, True, False)
    assert cfg.backend_settings == MooncakeSettings(master_server_address="127.0.0.1:1")
    assert parse_store_config({**BASE, "mooncake": None}).backend_settings == MooncakeSettings()
    assert parse_store_config({**BASE, "load_async": "True"}).load_async is True


@pytest.mark.parametrize("extra, option", [
    ({"backend": "redis"}, "backend"),
    ({"lookup_rpc_port": "6000"}, "lookup_rpc_port"),
    ({"lookup_rpc_port": 70000}, "lookup_rpc_port"),
    ({"load_async": "yes"}, "load_async"),
    ({"use_layerwise": True}, "use_layerwise"),
    ({"discard_partial_chunks": False}, "discard_partial_chunks"),
    ({"lookup_timeout_ms": 0}, "lookup_timeout_ms"),
    ({"mooncake": "127.0.0.1:1"}, "mooncake"),
])
def test_bad_settings_name_the_option(extra, option):
    with pytest.raises(StoreConfigError, match=f"kv_connector_extra_config.{option}"):
        parse_store_config({**BASE, **extra})


# ---- wire messages -------------------------------------------------------------------------------
def test_lookup_messages_round_trip_and_validate():
    hashes = block_hashes(list(range(64)), 16)
    raw = msgspec.msgpack.encode(LookupRequest(block_hashes=hashes, request_id="r1"))
    assert validate_request(msgspec.msgpack.decode(raw, type=LookupRequest)).block_hashes == hashes
    with pytest.raises(InvalidMessage, match="hex"):
        validate_request(LookupRequest(block_hashes=["../../etc/passwd"]))
    with pytest.raises(InvalidMessage, match="hex"):
        validate_request(LookupRequest(block_hashes=[hashes[0].upper()]))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"block_hashes": [1, 2]}), type=LookupRequest)
    with pytest.raises(msgspec.ValidationError):  # unknown fields are refused, not ignored
        msgspec.msgpack.decode(msgspec.msgpack.encode({"block_hashes": [], "x": 1}), type=LookupRequest)
    with pytest.raises(InvalidMessage, match="claims 5"):
        validate_reply(LookupReply(hit_blocks=5), asked=4)
    with pytest.raises(InvalidMessage):
        validate_reply(LookupReply(hit_blocks=-1), asked=4)


# ---- shards and the hit rule -----------------------------------------------------------------------
def test_without_kvpp_an_mla_block_is_one_object_per_stage():
    stages = [StageLayers(0, tuple(range(8))), StageLayers(1, tuple(range(8, 16)), mtp_caches=1)]
    shards = all_shards(stages, 4, kvpp=False, replicated=True)
    assert [(s.pp_rank, s.owner) for s in shards] == [(0, 0), (1, 0)]
    assert shards[1].layers == tuple(range(8, 16)) + ("mtp0",)


def test_with_kvpp_each_owner_stores_its_layers_plus_mtp():
    shards = stage_shards(StageLayers(0, tuple(range(5)), mtp_caches=1), 2, kvpp=True, replicated=True)
    assert [(s.owner, s.layers) for s in shards] == [(0, (0, 1, 2, "mtp0")), (1, (3, 4, "mtp0"))]


def test_owners_without_layers_store_nothing():
    shards = stage_shards(StageLayers(0, (0, 1)), 4, kvpp=True, replicated=True)
    assert [(s.owner, s.layers) for s in shards] == [(0, (0,)), (1, (1,))]


def test_hit_needs_every_shard_of_every_stage():
    assert hit_blocks({"a": [True, True, True], "b": [True, True, True]}) == 3
    assert hit_blocks({"a": [True, True, True], "b": [True, False, True]}) == 1, "a missing shard ends the prefix"
    assert hit_blocks({"a": [False, True], "b": [True, True]}) == 0
    assert hit_blocks({}) == 0


class _DictBackend:
    """Narrow in-memory stand-in for exists(); the real backends are covered by integration tests."""

    def __init__(self, keys, fail=False):
        self.keys, self.fail = set(keys), fail

    def exists(self, keys):
        if self.fail:
            return [Status.FAILED] * len(keys)
        return [Status.OK if k in self.keys else Status.MISSING for k in keys]


def test_count_pooled_with_a_missing_owner_shard():
    layout = CacheLayout("m", "float32", 16, 36864)
    stages = [StageLayers(0, tuple(range(4))), StageLayers(1, tuple(range(4, 8)))]
    keys = shard_keys(layout, all_shards(stages, 2, kvpp=True, replicated=True))
    assert len(keys) == 4
    hashes = block_hashes(list(range(80)), 16)
    stored = {k.key(h) for k in keys for h in hashes}
    assert count_pooled(_DictBackend(stored), keys, hashes) == 5
    stored.discard(keys[3].key(hashes[2]))  # stage 1, owner 1, block 2 evicted
    assert count_pooled(_DictBackend(stored), keys, hashes) == 2
    assert count_pooled(_DictBackend(stored, fail=True), keys, hashes) is None


# ---- bounded calls ---------------------------------------------------------------------------------
def test_a_stalled_call_returns_within_its_bound_and_fails_fast_after():
    calls = BoundedCalls(timeout_s=0.2, max_stuck=1)
    release = threading.Event()
    start = time.monotonic()
    assert calls.run(lambda: release.wait(5) and "late", lambda: "timeout", lambda e: "error") == "timeout"
    assert time.monotonic() - start < 1.0
    (late,) = calls.late()
    assert not late.done(), "the timed-out call is still running and is listed until it returns"
    start = time.monotonic()
    assert calls.run(lambda: "ok", lambda: "timeout", lambda e: "error") == "timeout", "stalled backend: fail fast"
    assert time.monotonic() - start < 0.1
    release.set()
    assert late.result(timeout=1) == "late"
    time.sleep(0.05)
    assert calls.late() == []
    assert calls.run(lambda: "ok", lambda: "timeout", lambda e: "error") == "ok", "recovers once the call returns"
    assert calls.run(lambda: 1 / 0, lambda: "timeout", lambda e: type(e).__name__) == "ZeroDivisionError"
    calls.close()


# ---- save planning (scheduler side) -------------------------------------------------------------------
def _scheduler(role="kv_producer"):
    from connectors.store.scheduler import StoreScheduler

    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16),
        kv_transfer_config=SimpleNamespace(kv_role=role),
        parallel_config=SimpleNamespace(data_parallel_rank=0),
    )
    return StoreScheduler(vllm_config, parse_store_config(BASE))


def _output(new=(), cached=None, scheduled=None, preempted=None):
    from vllm.v1.core.sched.output import CachedRequestData

    scheduled = scheduled or {}
    return SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
                           num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                           preempted_req_ids=preempted)


def _admit(sched, req_id, tokens, block_ids, **extras):
    """What vLLM does with a waiting request before it first schedules it: ask the connector."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request(req_id, tokens, SamplingParams(max_tokens=1), None, **extras)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    return SimpleNamespace(req_id=req_id, prompt_token_ids=tokens, block_ids=(block_ids,), num_computed_tokens=0)


def test_whole_prompt_blocks_are_saved_once_as_they_complete():
    from vllm.v1.core.sched.output import CachedRequestData

    sched = _scheduler()
    prompt = list(range(50))  # 3 whole blocks + 2 tokens
    new = _admit(sched, "r", prompt, [7, 8])
    meta = sched.build_connector_meta(_output([new], scheduled={"r": 20}))  # chunk 1: 20 tokens
    assert [(j.block_ids, j.block_hashes) for j in meta.saves] == [((7,), tuple(block_hashes(prompt, 16)[:1]))]
    cached = CachedRequestData(req_ids=["r"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
                               new_block_ids=[([9, 10],)], num_computed_tokens=[20], num_output_tokens=[0])
    meta = sched.build_connector_meta(_output(cached=cached, scheduled={"r": 30}))
    assert [j.block_ids for j in meta.saves] == [(8, 9)], "the partial 4th block is never saved"
    assert sched.request_finished(SimpleNamespace(request_id="r"), [7, 8, 9, 10]) == (True, None)
    assert sched.request_finished(SimpleNamespace(request_id="other"), []) == (False, None)


def test_preempting_a_request_with_saves_in_flight_drains_them():
    sched = _scheduler()
    new = _admit(sched, "r", list(range(32)), [1, 2])
    assert sched.build_connector_meta(_output([new], scheduled={"r": 32})).drain_saves is False
    assert sched.build_connector_meta(_output(preempted={"r"})).drain_saves is True


def test_saves_are_keyed_by_the_tenant():
    sched = _scheduler()
    new = [_admit(sched, "a", list(range(32)), [1, 2], cache_salt="tenant-a"), _admit(sched, "p", list(range(32)), [3, 4])]
    saves = {j.req_id: j.block_hashes for j in sched.build_connector_meta(_output(new, scheduled={"a": 32, "p": 32})).saves}
    assert saves["p"] == tuple(block_hashes(list(range(32)), 16))
    assert not set(saves["a"]) & set(saves["p"]), "a salted prompt never writes the unsalted keys"


def test_saves_are_keyed_when_a_multiconnector_skips_the_lookup():
    """A MultiConnector stops asking children after one says "still looking up", but every child hears
    about the allocation: the salted keys are made there."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sched = _scheduler("kv_both")
    request = Request("a", list(range(32)), SamplingParams(max_tokens=1), None, cache_salt="tenant-a")
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    new = SimpleNamespace(req_id="a", prompt_token_ids=list(range(32)), block_ids=([1, 2],), num_computed_tokens=0)
    (job,) = sched.build_connector_meta(_output([new], scheduled={"a": 32})).saves
    assert job.block_ids == (1, 2) and not set(job.block_hashes) & set(block_hashes(list(range(32)), 16))
    sched.close()


def test_a_consumer_saves_only_with_write_back():
    from connectors.store.config import role_actions

    cfg = parse_store_config(BASE)
    assert role_actions("kv_consumer", cfg) == (True, False)
    assert role_actions("kv_consumer", parse_store_config({**BASE, "consumer_is_to_put": True})) == (True, True)
    assert role_actions("kv_producer", cfg) == (False, True)
    assert role_actions("kv_both", cfg) == (True, True)


# ---- KVPP refusals come from the launch check -----------------------------------------------------
@pytest.fixture(scope="module")
def engine_config(tiny_model):
    """A real VllmConfig (no engine) for the tiny MLA model, TP=2, pool kv_both, KVPP off."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=tiny_model, dtype="float32", enforce_eager=True, block_size=16, tensor_parallel_size=2,
        kv_transfer_config={"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {**BASE, "load_async": True}},
    ).create_engine_config()


def _with(cfg, extra=None, role="kv_both", events=False, kvpp=True):
    import copy

    from vllm.config import KVEventsConfig

    cfg = copy.deepcopy(cfg)
    cfg.additional_config = {"enable_kvpp": kvpp}
    cfg.kv_transfer_config.kv_role = role
    cfg.kv_transfer_config.kv_connector_extra_config = {**BASE, **(extra or {})}
    cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=events) if events else None
    return cfg


@pytest.mark.parametrize("extra, role, events, option", [
    ({"load_async": True, "use_layerwise": True}, "kv_both", False, "use_layerwise"),
    ({}, "kv_both", False, "load_async"),
    ({"load_async": True, "discard_partial_chunks": False}, "kv_both", False, "discard_partial_chunks"),
    ({"load_async": True, "consumer_is_to_put": True}, "kv_both", False, "consumer_is_to_put"),
    ({"load_async": True}, "kv_consumer", False, "kv_role"),
    ({"load_async": True}, "kv_both", True, "kv_events_config"),
])
def test_kvpp_refuses_unsupported_pool_settings(engine_config, extra, role, events, option):
    from kvpp_core.config import KvppConfigError
    from connectors.launch import check_launch

    with pytest.raises(KvppConfigError, match=option):
        check_launch(_with(engine_config, extra, role, events))


def test_the_connector_refuses_a_mistyped_key_through_the_one_entry_point(engine_config):
    """`"load_asnyc": true` used to leave load_async false in silence; KVPP on or off it now stops the start."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpp_core.config import KvppConfigError

    from connectors.store.connector import AscendStoreConnector

    for kvpp in (False, True):
        with pytest.raises(KvppConfigError) as err:
            AscendStoreConnector(_with(engine_config, {"load_asnyc": True}, kvpp=kvpp), KVConnectorRole.SCHEDULER)
        assert "kv_connector_extra_config.load_asnyc: unknown option; did you mean load_async?" in str(err.value)
        assert "valid options: backend, lookup_rpc_port, mooncake, memcache, use_layerwise, load_async" in str(err.value)


def test_kvpp_accepts_the_supported_pool_settings_and_off_skips_the_kvpp_rules(engine_config, caplog):
    from connectors.launch import check_launch

    assert check_launch(_with(engine_config, {"load_async": True})).warnings == []
    assert check_launch(_with(engine_config, {"consumer_is_to_put": True}, "kv_consumer", kvpp=False)).warnings == []


def test_warnings_are_logged_once_per_process(engine_config):
    import logging

    from kvpp_core import startup

    from connectors.launch import check_launch

    cfg = _with(engine_config, {"load_async": True})
    cfg.parallel_config.tensor_parallel_size = 1  # KVPP inert: a warning, not an error
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("vllm.kvpp_core.startup").addHandler(handler)
    startup._logged.clear()
    try:
        for _ in range(3):  # engine, then each connector of the process
            assert [p.option for p in check_launch(cfg).warnings] == ["tensor_parallel_size"]
    finally:
        logging.getLogger("vllm.kvpp_core.startup").removeHandler(handler)
    assert len([r for r in records if "tensor_parallel_size" in r]) == 1


def test_a_request_whose_load_failed_is_not_looked_up_again():
    from vllm.v1.outputs import KVConnectorOutput

    from connectors.store.scheduler import StoreScheduler

    class _Client:
        calls = 0

        def hit_blocks(self, hashes, request_id=""):
            self.calls += 1
            return 2, ""

    vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=16),
                                  kv_transfer_config=SimpleNamespace(kv_role="kv_both"),
                                  parallel_config=SimpleNamespace(data_parallel_rank=0))
    sched = StoreScheduler(vllm_config, parse_store_config({**BASE, "load_async": True}))
    sched._client.close()
    sched._client = client = _Client()
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request("r", list(range(40)), SamplingParams(max_tokens=1), None)
    assert sched.get_num_new_matched_tokens(request, 0) == (32, True)
    sched.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7],)), 32)
    assert [j.block_ids for j in sched.build_connector_meta(_output()).loads] == [(5, 6)]
    sched.update_connector_output(KVConnectorOutput(finished_recving={"r"}, invalid_block_ids={6}))
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False), "vLLM retries it: recompute, no new lookup"
    assert client.calls == 1
    sched.request_finished(request, [])
    assert sched.get_num_new_matched_tokens(request, 0) == (32, True), "the failure is forgotten with the request"


def test_every_unknown_key_is_named_at_once():
    with pytest.raises(StoreConfigError) as err:
        parse_store_config({**BASE, "load_asnyc": True, "lookup_timout_ms": 5, "load_async": "yes"})
    lines = str(err.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["kv_connector_extra_config.load_asnyc",
                                                      "kv_connector_extra_config.lookup_timout_ms",
                                                      "kv_connector_extra_config.load_async"]
    assert "did you mean lookup_timeout_ms?" in lines[1]


@pytest.mark.parametrize("kvpp", [True, False])
def test_kvpp_check_refuses_unknown_pool_keys_through_the_same_struct(tmp_path, kvpp):
    import yaml

    from deploy.deployment.check import run_check

    spec = {"model": {"path": "/models/x", "preset": "glm-5.2"},
            "prefill": [{"name": "p", "hosts": ["h1"], "tp": 8, "enable_kvpp": kvpp, "enforce_eager": True}],
            "pool": {"backend": "mooncake", "address": "h9:50051", "lookup_rpc_port": 5600,
                     "extra_config": {"load_async": True, "load_asnyc": True}}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    findings, code = run_check(str(path))
    assert code == 1
    assert [str(f) for f in findings if f.severity == "error"] == [
        "error: prefill[0] (p): kv_connector_extra_config.load_asnyc: unknown option; did you mean load_async? "
        "valid options: backend, lookup_rpc_port, mooncake, memcache, use_layerwise, load_async, "
        "discard_partial_chunks, consumer_is_to_put, lookup_timeout_ms, backend_timeout_ms, stats_file"]


# ---- typed backend settings: one reading, every problem at once ---------------------------------------
def _problems(extra):
    from connectors.store.config import read_store_config

    return read_store_config(extra).problems


def test_backend_settings_refusals_name_the_nested_option_and_come_all_at_once():
    problems = dict(_problems({**BASE, "load_async": "yes", "mooncake": {
        "master_server_adress": "127.0.0.1:1", "global_segment_size": "1GB", "protocol": 5}}))
    assert set(problems) == {"kv_connector_extra_config.load_async",
                             "kv_connector_extra_config.mooncake.master_server_adress",
                             "kv_connector_extra_config.mooncake.global_segment_size",
                             "kv_connector_extra_config.mooncake.protocol"}
    assert problems["kv_connector_extra_config.mooncake.master_server_adress"].startswith(
        "unknown option; did you mean master_server_address? valid options: master_server_address, config_path")
    assert "Expected `int | null`, got `str` ('1GB')" in problems["kv_connector_extra_config.mooncake.global_segment_size"]
    assert "bytes this client contributes" in problems["kv_connector_extra_config.mooncake.global_segment_size"]
    assert "Expected `str | null`, got `int`" in problems["kv_connector_extra_config.mooncake.protocol"]


@pytest.mark.parametrize("address", ["::1:50051", "fd00::9", "10.0.0.9", "h 1:5", "[::1]"])
def test_master_address_must_be_host_port_with_ipv6_in_brackets(address):
    problems = dict(_problems({**BASE, "mooncake": {"master_server_address": address}}))
    message = problems["kv_connector_extra_config.mooncake.master_server_address"]
    assert repr(address) in message and '"[fd00::9]:50051"' in message


@pytest.mark.parametrize("address", ["10.0.0.9:50051", "[fd00::9]:50051", "[::1]:1", "pool-0.kvpp.svc:50051"])
def test_master_address_accepts_names_ipv4_and_bracketed_ipv6(address):
    assert parse_store_config({**BASE, "mooncake": {"master_server_address": address}}).mooncake.master_server_address \
        == address


def test_memcache_settings_are_typed_and_a_stray_group_is_refused():
    from connectors.store.config import MemcacheSettings

    extra = {"backend": "memcache", "lookup_rpc_port": 1, "memcache": {
        "meta_service_url": "tcp://[fd00::9]:5000", "world_size": 4, "metadata_only": "true"}}
    cfg = parse_store_config(extra)
    assert cfg.backend_settings == MemcacheSettings(meta_service_url="tcp://[fd00::9]:5000", world_size=4,
                                                    metadata_only=True)
    assert cfg.memcache.local_config() == {"meta_service_url": "tcp://[fd00::9]:5000", "world_size": 4}
    problems = dict(_problems({**extra, "memcache": {"world_size": 0, "meta_service": "x"}, "mooncake": {}}))
    assert problems["kv_connector_extra_config.memcache.meta_service"].startswith(
        "unknown option; did you mean meta_service_url?")
    assert "Expected `int` >= 1" in problems["kv_connector_extra_config.memcache.world_size"]
    assert problems["kv_connector_extra_config.mooncake"].startswith("is set but backend is memcache")


def test_backend_settings_round_trip():
    extra = {**BASE, "load_async": True, "mooncake": {
        "master_server_address": "[fd00::9]:50051", "protocol": "rdma", "rdma_devices": "mlx5_0",
        "global_segment_size": 0, "local_buffer_size": 1 << 24}}
    cfg = parse_store_config(extra)
    assert cfg.mooncake.explicit() == extra["mooncake"]  # unset fields stay unset, set ones keep their values
    assert parse_store_config(msgspec.to_builtins(cfg)) == cfg


def test_the_mooncake_config_file_is_read_as_the_same_struct(tmp_path, monkeypatch):
    import json

    from connectors.store.backends import BackendError
    from connectors.store.backends.mooncake import resolve_settings
    from connectors.store.config import MooncakeSettings

    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    good = tmp_path / "mooncake.json"
    good.write_text(json.dumps({"master_server_address": "10.0.0.9:50051", "protocol": "rdma"}))
    resolved = resolve_settings(MooncakeSettings(config_path=str(good), protocol="tcp"))
    # explicit settings win over the file, which wins over the defaults
    assert (resolved.master_server_address, resolved.protocol, resolved.local_buffer_size) == \
        ("10.0.0.9:50051", "tcp", 16 << 20)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"master_server_address": "10.0.0.9:50051", "protcol": "tcp", "local_buffer_size": -1}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(bad))
    with pytest.raises(BackendError) as err:
        resolve_settings(MooncakeSettings())
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{bad} (MOONCAKE_CONFIG_PATH") for line in lines)
    assert "kv_connector_extra_config.mooncake.protcol: unknown option; did you mean protocol?" in lines[0]
    assert "kv_connector_extra_config.mooncake.local_buffer_size: Expected `int` >= 0" in lines[1]


def test_kvpp_check_reads_the_spec_pool_settings_as_the_same_struct():
    from deploy.deployment.spec import SpecError, parse_spec

    spec = {"model": {"path": "/m"}, "prefill": [{"name": "p", "hosts": ["h1"], "tp": 1}],
            "pool": {"backend": "mooncake", "address": "h9:50051", "lookup_rpc_port": 5600,
                     "settings": {"protocol": "rdma", "rdma_device": "mlx5_0"}}}
    with pytest.raises(SpecError, match="pool.settings.rdma_device: unknown option; did you mean rdma_devices?"):
        parse_spec(spec)
    spec["pool"]["settings"] = {"protocol": "rdma", "rdma_devices": "mlx5_0"}
    from deploy.deployment.launch import mooncake_store_config

    assert mooncake_store_config(parse_spec(spec)) == {"master_server_address": "h9:50051", "metadata_server":
                                                       "P2PHANDSHAKE", "protocol": "rdma", "rdma_devices": "mlx5_0"}
