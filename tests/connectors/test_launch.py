"""The connectors' launch rules (connectors.launch and each connector's rules module), applied through
kvpp_core's validation as the launch check applies them: roles, settings, store flags, MultiConnector."""

import pytest

from kvpp_core.config import KvppConfig
from kvpp_core.topology import Topology

from tests.helpers.setups import GOOD_STORE_EXTRA, POOL, only, setup, validate

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("connector", ["MooncakeConnectorV2", "AscendStoreConnector"])
def test_consumer_node_refused(connector):
    extra = GOOD_STORE_EXTRA if connector == "AscendStoreConnector" else {}
    p = only(validate(setup(kv_connector=connector, kv_role="kv_consumer", kv_extra=extra)))
    assert p.option == "kv_role"
    assert "KVPP runs only on prefill nodes" in p.message and "on that node" in p.message


@pytest.mark.parametrize("role", ["kv_both", None])
def test_mooncake_needs_producer(role):
    p = only(validate(setup(kv_connector="MooncakeConnectorV2", kv_role=role)))
    assert p.option == "kv_role" and 'set "kv_role": "kv_producer"' in p.message and repr(role) in p.message


def test_mooncake_refuses_pcp():
    p = only(validate(setup(kv_connector="MooncakeConnectorV2", kv_role="kv_producer",
                            topology=Topology(tp=4, pcp=2, runner="v2"))))
    assert p.option == "prefill_context_parallel_size" and "MooncakeConnectorV2 with KVPP does not support PCP" in p.message


def test_store_unknown_role():
    p = only(validate(setup(kv_connector="AscendStoreConnector", kv_role=None, kv_extra=GOOD_STORE_EXTRA)))
    assert p.option == "kv_role" and '"kv_producer" or "kv_both"' in p.message


@pytest.mark.parametrize(
    "key, value, fix",
    [
        ("load_async", False, 'but KVPP needs true (KVPP restores its persistent buffers with asynchronous loads only); '
                              'set "load_async": true'),
        ("consumer_is_to_put", True, 'but KVPP needs false (consumer write-back is not supported with KVPP); '
                                     'set "consumer_is_to_put": false'),
        # Not implemented by the connector at all: its own refusal, once.
        ("use_layerwise", True, "not implemented by this connector; set it to false"),
        ("use_layerwise", "true", "not implemented by this connector; set it to false"),
        ("discard_partial_chunks", False, "not implemented: only whole blocks are pooled"),
    ],
)
def test_store_flags(key, value, fix):
    p = only(validate(setup(kv_connector="AscendStoreConnector", kv_role="kv_both",
                            kv_extra=dict(GOOD_STORE_EXTRA, **{key: value}))))
    assert p.option == f"kv_connector_extra_config.{key}"
    assert fix in p.message


def test_store_load_async_default_is_an_error():
    p = only(validate(setup(kv_connector="AscendStoreConnector", kv_role="kv_producer",
                            kv_extra={**POOL, "use_layerwise": False})))
    assert p.option == "kv_connector_extra_config.load_async"
    assert p.message.startswith("defaults to false but KVPP needs true") and 'set "load_async": true' in p.message


def test_store_flag_with_garbage_value():
    p = only(validate(setup(kv_connector="AscendStoreConnector", kv_role="kv_producer",
                            kv_extra=dict(GOOD_STORE_EXTRA, load_async="maybe"))))
    assert p.message == """must be true or false (a JSON bool, or the string "true"/"false"), got 'maybe'"""


def test_store_kv_events_refused():
    p = only(validate(setup(kv_connector="AscendStoreConnector", kv_role="kv_producer", kv_extra=GOOD_STORE_EXTRA,
                            kv_events=True)))
    assert p.option == "kv_events_config" and "KV cache events are not supported" in p.message


def test_unknown_connector():
    p = only(validate(setup(kv_connector="NixlConnector", kv_role="kv_both")))
    assert p.option == "kv_connector" and "'NixlConnector' is not validated with KVPP" in p.message
    assert "use MooncakeConnectorV2" in p.message and "AscendStoreConnector" in p.message


def test_multi_connector_children_each_follow_their_rules():
    pd_and_pool = {"connectors": [
        {"kv_connector": "MooncakeConnectorV2", "kv_role": "kv_producer"},
        {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {**POOL, "load_async": True}},
    ]}
    assert validate(setup(kv_connector="MultiConnector", kv_role="kv_both", kv_extra=pd_and_pool)) == []
    bad = {"connectors": [
        {"kv_connector": "MooncakeConnectorV2", "kv_role": "kv_both"},
        {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": POOL},
        "nonsense",
    ]}
    options = [p.option for p in validate(setup(kv_connector="MultiConnector", kv_role="kv_both", kv_extra=bad))]
    assert options == ["kv_connector_extra_config.connectors[0].kv_role",
                       "kv_connector_extra_config.connectors[1].kv_connector_extra_config.load_async",
                       "kv_connector_extra_config.connectors[2]"]
    empty = validate(setup(kv_connector="MultiConnector", kv_role="kv_both"))
    assert [p.option for p in empty] == ["kv_connector_extra_config.connectors"]


def test_pool_settings_are_checked_whether_or_not_kvpp_is_on():
    """The connector's own struct: unknown keys name themselves and the valid ones, all at once."""
    off = KvppConfig(enabled=False)
    assert validate(setup(kvpp=off, kv_connector="AscendStoreConnector", kv_role="kv_both", kv_extra=POOL)) == []
    problems = validate(setup(kvpp=off, kv_connector="AscendStoreConnector", kv_role="kv_both",
                              kv_extra={**POOL, "load_asnyc": True, "lookup_timeout_ms": -1}))
    assert [p.option for p in problems] == ["kv_connector_extra_config.load_asnyc",
                                            "kv_connector_extra_config.lookup_timeout_ms"]
    assert "did you mean load_async?" in problems[0].message and "valid options: backend, lookup_rpc_port" in problems[0].message
    multi = {"connectors": [{"kv_connector": "MooncakeConnectorV2", "kv_role": "kv_producer",
                             "kv_connector_extra_config": {"transfer_timeout": 9}},
                            {"kv_connector": "AscendStoreConnector", "kv_connector_extra_config": {"backend": "redis"}}]}
    problems = validate(setup(kvpp=off, kv_connector="MultiConnector", kv_role="kv_both", kv_extra=multi))
    assert [p.option for p in problems] == [
        "kv_connector_extra_config.connectors[0].kv_connector_extra_config",
        "kv_connector_extra_config.connectors[1].kv_connector_extra_config.backend",
        "kv_connector_extra_config.connectors[1].kv_connector_extra_config.lookup_rpc_port"]
    assert "transfer_timeout" in problems[0].message
    assert "must be one of mooncake, memcache, got 'redis'" in problems[1].message