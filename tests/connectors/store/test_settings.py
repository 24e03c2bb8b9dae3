"""AscendStoreConnector's kv_connector_extra_config and typed backend settings: one reading, every
problem at once, named by its option."""

from __future__ import annotations

import msgspec
import pytest

from kvpp_core.config import KvppConfigError

from connectors.store.backends.settings import MooncakeSettings
from connectors.store.settings import parse_store_settings
from tests.helpers.store_config import BASE

pytestmark = pytest.mark.unit


def test_defaults_and_backend_settings():
    cfg = parse_store_settings(BASE)
    assert (cfg.load_async, cfg.use_layerwise, cfg.discard_partial_chunks, cfg.consumer_is_to_put) == (False, False, True, False)
    assert cfg.backend_settings == MooncakeSettings(master_server_address="127.0.0.1:1")
    assert parse_store_settings({**BASE, "mooncake": None}).backend_settings == MooncakeSettings()
    assert parse_store_settings({**BASE, "load_async": "True"}).load_async is True


@pytest.mark.parametrize("extra, option", [
    ({"backend": "redis"}, "backend"),
    ({"lookup_rpc_port": "6000"}, "lookup_rpc_port"),
    ({"lookup_rpc_port": 70000}, "lookup_rpc_port"),
    ({"load_async": "yes"}, "load_async"),
    ({"use_layerwise": True}, "use_layerwise"),
    ({"discard_partial_chunks": False}, "discard_partial_chunks"),
    ({"lookup_timeout_ms": 0}, "lookup_timeout_ms"),
    ({"backend_timeout_floor_ms": 0}, "backend_timeout_floor_ms"),
    ({"backend_timeout_slack": 0.5}, "backend_timeout_slack"),
    ({"pool_backoff_ms": -1}, "pool_backoff_ms"),
    ({"mooncake": "127.0.0.1:1"}, "mooncake"),
])
def test_bad_settings_name_the_option(extra, option):
    with pytest.raises(KvppConfigError, match=f"kv_connector_extra_config.{option}"):
        parse_store_settings({**BASE, **extra})


def test_a_consumer_saves_only_with_write_back():
    from connectors.store.settings import role_actions

    cfg = parse_store_settings(BASE)
    assert role_actions("kv_consumer", cfg) == (True, False)
    assert role_actions("kv_consumer", parse_store_settings({**BASE, "consumer_is_to_put": True})) == (True, True)
    assert role_actions("kv_producer", cfg) == (False, True)
    assert role_actions("kv_both", cfg) == (True, True)


def test_every_unknown_key_is_named_at_once():
    with pytest.raises(KvppConfigError) as err:
        parse_store_settings({**BASE, "load_asnyc": True, "lookup_timout_ms": 5, "load_async": "yes"})
    lines = str(err.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["kv_connector_extra_config.load_asnyc",
                                                      "kv_connector_extra_config.lookup_timout_ms",
                                                      "kv_connector_extra_config.load_async"]
    assert "did you mean lookup_timeout_ms?" in lines[1]


def _problems(extra):
    from connectors.store.settings import read_store_settings

    return read_store_settings(extra).problems


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
    assert parse_store_settings({**BASE, "mooncake": {"master_server_address": address}}).mooncake.master_server_address \
        == address


def test_memcache_settings_are_typed_and_a_stray_group_is_refused():
    from connectors.store.backends.settings import MemcacheSettings

    extra = {"backend": "memcache", "lookup_rpc_port": 1, "memcache": {
        "meta_service_url": "tcp://[fd00::9]:5000", "world_size": 4, "metadata_only": "true"}}
    cfg = parse_store_settings(extra)
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
    cfg = parse_store_settings(extra)
    assert cfg.mooncake.explicit() == extra["mooncake"]  # unset fields stay unset, set ones keep their values
    assert parse_store_settings(msgspec.to_builtins(cfg)) == cfg


def test_store_calls_are_bounded_short_by_default():
    from connectors.store.backends.bounds import CallPolicy

    cfg = parse_store_settings(BASE)
    assert cfg.call_policy == CallPolicy(floor_s=0.5, ceiling_s=3.0, slack=4.0, backoff_s=1.0, backoff_max_s=30.0)
    assert cfg.lookup_timeout_s == 1.0
    assert cfg.request_budget_s == 4.0, "a lookup and a load's first call"
    assert parse_store_settings({**BASE, "request_budget_ms": 6000}).request_budget_s == 6.0


@pytest.mark.parametrize("extra, option, says", [
    ({"backend_timeout_ms": 400}, "backend_timeout_ms", "backend_timeout_floor_ms 500 must be at most backend_timeout_ms 400"),
    ({"backend_timeout_floor_ms": 4000, "lookup_timeout_ms": 5000}, "backend_timeout_floor_ms",
     "must be at most backend_timeout_ms 3000"),
    ({"lookup_timeout_ms": 500}, "lookup_timeout_ms", "backend_timeout_floor_ms 500 must be below lookup_timeout_ms 500"),
    ({"backend_timeout_floor_ms": 2000}, "backend_timeout_floor_ms", "must be below lookup_timeout_ms 1000"),
    ({"pool_backoff_ms": 60000}, "pool_backoff_ms", "must be at most pool_backoff_max_ms 30000"),
    ({"request_budget_ms": 2000}, "request_budget_ms", "backend_timeout_ms 3000 must be at most request_budget_ms 2000"),
])
def test_bounds_out_of_order_are_refused_naming_the_key_that_was_set(extra, option, says):
    with pytest.raises(KvppConfigError) as err:
        parse_store_settings({**BASE, **extra})
    assert str(err.value).startswith(f"kv_connector_extra_config.{option}: ") and says in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_long_bounds_in_order_are_accepted():
    cfg = parse_store_settings({**BASE, "backend_timeout_floor_ms": 20000, "backend_timeout_ms": 20000,
                                "lookup_timeout_ms": 25000})
    assert (cfg.call_policy.floor_s, cfg.call_policy.ceiling_s) == (20.0, 20.0)
    assert cfg.request_budget_s == 45.0, "unset, the budget follows the bounds"
