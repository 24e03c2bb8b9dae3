"""The connectors' launch rules (connectors.launch and each connector's rules module), applied through
kvpp_core's validation as the launch check applies them: roles, settings, store flags, MultiConnector."""

import pytest

from kvpp_core.config import KvppConfig
from kvpp_core.topology import Topology

from connectors.launch import check_launch

from deploy.services.processes import REFERENCE

from tests.helpers.setups import GOOD_STORE_EXTRA, POOL, only, setup, validate
from tests.helpers.store_config import pool_config

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
        "kv_connector_extra_config.connectors[0].kv_connector_extra_config.transfer_timeout",
        "kv_connector_extra_config.connectors[1].kv_connector_extra_config.backend",
        "kv_connector_extra_config.connectors[1].kv_connector_extra_config.lookup_rpc_port"]
    assert "did you mean transfer_timeout_s?" in problems[0].message
    assert "must be one of mooncake, memcache, got 'redis'" in problems[1].message

# ---- the launch check of a real vLLM config ----------------------------------------------------------
@pytest.mark.parametrize("extra, role, option", [
    ({"load_async": True, "use_layerwise": True}, "kv_both", "use_layerwise"),
    ({}, "kv_both", "load_async"),
    ({"load_async": True, "discard_partial_chunks": False}, "kv_both", "discard_partial_chunks"),
    ({"load_async": True, "consumer_is_to_put": True}, "kv_both", "consumer_is_to_put"),
    ({"load_async": True}, "kv_consumer", "kv_role"),
])
def test_kvpp_refuses_unsupported_pool_settings(store_engine_config, extra, role, option):
    from kvpp_core.config import KvppConfigError

    with pytest.raises(KvppConfigError, match=option):
        check_launch(pool_config(store_engine_config, extra, role))


def test_kvpp_accepts_the_supported_pool_settings_and_off_skips_the_kvpp_rules(store_engine_config, caplog):
    assert check_launch(pool_config(store_engine_config, {"load_async": True})).warnings == []
    # KV events too: the pool announces a block stored only once every owner shard landed (connectors.store.events)
    assert check_launch(pool_config(store_engine_config, {"load_async": True}, events=True)).warnings == []
    assert check_launch(pool_config(store_engine_config, {"consumer_is_to_put": True}, "kv_consumer",
                                    kvpp=False)).warnings == []


def test_warnings_are_logged_once_per_process(store_engine_config):
    import logging

    from kvpp_core import startup

    cfg = pool_config(store_engine_config, {"load_async": True})
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


# ---- parse once: a worker's start-up in one process -----------------------------------------------
def _count_calls(monkeypatch, fn) -> list:
    """Replace `fn` wherever the project's loaded modules hold it; returns the list its calls fill."""
    import sys

    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in ("kvpp_core", "connectors") and getattr(module, fn.__name__, None) is fn:
            monkeypatch.setattr(module, fn.__name__, counted)
    return calls


def test_a_worker_start_up_parses_each_config_once(tiny_model, monkeypatch):
    """Engine config check, scheduler connector, worker context and worker connector of one process, for
    a prefill node with P/D plus the pool (vLLM's MultiConnector builds each child from a copy of the
    config): enable_kvpp is parsed once, and each connector's extra config once."""
    from types import SimpleNamespace

    import vllm.distributed.parallel_state as parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.engine.arg_utils import EngineArgs

    import connectors.mooncake.worker
    import connectors.store.worker
    from connectors import plugin
    from kvpp_core import config, modes, vllm_adapter
    from connectors.mooncake import settings as mooncake_settings
    from connectors.store import settings as store_settings

    plugin.register()  # what vLLM's plugin loader does in every process (idempotent)
    kvpp_parses = _count_calls(monkeypatch, config.parse_additional_config)
    mooncake_parses = _count_calls(monkeypatch, mooncake_settings.read_mooncake_v2_settings)
    store_parses = _count_calls(monkeypatch, store_settings.read_store_settings)
    built = {}

    def worker_side(name):
        def build(vllm_config, *args):
            built[name] = args[-1]  # the settings the connector hands its worker side
        return build

    # The worker sides connect to a transfer engine and a pool; what they are handed is what counts here.
    monkeypatch.setattr(connectors.mooncake.worker, "MooncakeV2Worker", worker_side("mooncake"))
    monkeypatch.setattr(connectors.store.worker, "StoreWorker", worker_side("store"))
    pool = {**POOL, "load_async": True}
    vllm_config = EngineArgs(
        model=tiny_model, **REFERENCE.engine_args(), enforce_eager=True, tensor_parallel_size=2,
        additional_config={"enable_kvpp": True},
        kv_transfer_config={"kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "MooncakeConnectorV2", "kv_role": "kv_producer"},
                           {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer",
                            "kv_connector_extra_config": pool}]}},
    ).create_engine_config()
    assert (len(kvpp_parses), len(mooncake_parses), len(store_parses)) == (1, 1, 1)

    scheduler = MultiConnector(vllm_config, KVConnectorRole.SCHEDULER, None)
    group = SimpleNamespace(rank_in_group=0, cpu_group=None)
    for getter in ("get_pcp_group", "get_pp_group", "get_tp_group", "get_world_group"):
        monkeypatch.setattr(parallel_state, getter, lambda: group)
    monkeypatch.setattr(vllm_adapter, "_kvpp_group", lambda topology, timeout_s: (None, (0, 1)))
    monkeypatch.setattr(vllm_adapter.agreement, "agree", lambda setup, *ranks: modes.resolve(setup))  # no peers here
    caches = {f"model.layers.{i}.self_attn.attn": SimpleNamespace(page_size_bytes=1024) for i in range(16)}
    worker = SimpleNamespace(vllm_config=vllm_config,
                             model_runner=SimpleNamespace(get_kv_cache_spec=lambda: caches))
    try:
        context = vllm_adapter.worker_context(worker)
        MultiConnector(vllm_config, KVConnectorRole.WORKER, None)
    finally:
        scheduler.shutdown()
    assert (len(kvpp_parses), len(mooncake_parses), len(store_parses)) == (1, 1, 1)
    assert context.config.enabled and context.topology.tp == 2 and context.layout.group_size == 2
    assert built["mooncake"] == mooncake_settings.MooncakeV2Settings() and built["store"].load_async


@pytest.mark.parametrize("connector, extra", [("MooncakeConnectorV2", {}), ("AscendStoreConnector", GOOD_STORE_EXTRA)])
def test_sleep_mode_is_refused_by_vllm_naming_the_connector(tiny_model, connector, extra):
    """Both connectors register KV memory that sleep would remap: they answer vLLM's question no, and
    vLLM 0.33, which asks before a launch with sleep mode, refuses it (0.32 does not ask)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from tests.helpers.vllm_scheduler import engine_config

    config = engine_config(tiny_model, {"kv_connector": connector, "kv_role": "kv_producer",
                                        "kv_connector_extra_config": extra})
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config).supports_sleep_mode(
        config.kv_transfer_config) is False
    if "supports_sleep_mode" in vars(KVConnectorBase_V1):  # vLLM asks (0.33); CPU refuses sleep mode earlier
        config.model_config.enable_sleep_mode = True
        with pytest.raises(ValueError, match=f"{connector} does not support sleep mode"):
            config._verify_kv_transfer_compat()
