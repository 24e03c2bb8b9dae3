"""Validation: every rule, its message (option + fix), and that all problems come back at once."""

import pytest

from kvpp_core.config import KvppConfig, KvppConfigError
from kvpp_core.model import PRESETS, ModelSpec
from kvpp_core.topology import Topology
from kvpp_core.validation import KV_UPDATE_OP, KvppSetup, Problem, raise_for_errors, validate
from tests.helpers.store_config import pool_config

pytestmark = pytest.mark.unit

ON = KvppConfig(enabled=True)
POOL = {"backend": "mooncake", "lookup_rpc_port": 6000}
GOOD_STORE_EXTRA = {**POOL, "use_layerwise": False, "load_async": True, "discard_partial_chunks": True}


def setup(**overrides):
    fields = dict(model=PRESETS["glm-5.2"], topology=Topology(tp=8), enforce_eager=True, kvpp=ON)
    fields.update(overrides)
    return KvppSetup(**fields)


def only(problems):
    assert len(problems) == 1, problems
    return problems[0]


def test_supported_setups_have_no_problems():
    assert validate(setup()) == []
    assert validate(setup(kv_connector="MooncakeConnectorV2", kv_role="kv_producer")) == []
    for role in ("kv_producer", "kv_both"):
        assert validate(setup(kv_connector="AscendStoreConnector", kv_role=role, kv_extra=GOOD_STORE_EXTRA)) == []
    assert validate(setup(topology=Topology(tp=4, pcp=2, runner="v2"))) == []


def test_nothing_is_checked_when_kvpp_is_off():
    bad = setup(kvpp=KvppConfig(enabled=False), enforce_eager=False, kv_connector="Foo", kv_role="kv_consumer",
                topology=Topology(tp=1, dcp=2))
    assert validate(bad) == []


def test_non_mla_model():
    p = only(validate(setup(model=ModelSpec("llama-3", 32, 0, 0, 0, attention="mha"))))
    assert (p.severity, p.option) == ("error", "model")
    assert "llama-3 uses mha attention; KVPP supports only MLA/SFA" in p.message
    assert "remove enable_kvpp from --additional-config" in p.message


def test_hybrid_model():
    p = only(validate(setup(model=ModelSpec("kimi-linear", 27, 0, 512, 64, hybrid=True))))
    assert p.option == "model" and "kimi-linear is a hybrid model" in p.message and "non-hybrid" in p.message


MLA = PRESETS["deepseek-v3"]


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE"])
def test_compiled_mla_runs_without_full_graphs(mode):
    """KVPP's hook runs in the KV-update op, which runs as Python on every step unless a full graph is replayed."""
    assert validate(setup(model=MLA, enforce_eager=False, cudagraph_mode=mode)) == []
    assert validate(setup(model=MLA, enforce_eager=False, cudagraph_mode=mode, splitting_ops=(KV_UPDATE_OP,))) == []


@pytest.mark.parametrize("mode", [None, "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_full_cuda_graphs_refused(mode):
    p = only(validate(setup(model=MLA, enforce_eager=False, cudagraph_mode=mode)))
    assert p.option == "compilation_config.cudagraph_mode"
    assert (mode or "vLLM's default FULL_AND_PIECEWISE") in p.message and "skips KVPP's per-layer broadcast" in p.message
    assert "\"cudagraph_mode\": \"PIECEWISE\"" in p.message and "--enforce-eager" in p.message


def test_piecewise_graphs_must_split_at_the_kv_update():
    p = only(validate(setup(model=MLA, enforce_eager=False, cudagraph_mode="PIECEWISE",
                            splitting_ops=("vllm::unified_mla_attention_with_output",))))
    assert p.option == "compilation_config.splitting_ops" and KV_UPDATE_OP in p.message


def test_eager_ignores_graph_settings():
    assert validate(setup(model=MLA, cudagraph_mode="FULL", splitting_ops=())) == []


def test_compiled_sfa_refused():
    p = only(validate(setup(enforce_eager=False, cudagraph_mode="NONE")))
    assert p.option == "enforce_eager" and "SFA" in p.message and "add --enforce-eager" in p.message


@pytest.mark.parametrize("method", [None, "mtp", "eagle", "ngram"])
def test_drafts_numbered_after_the_decoder_stack_are_accepted(method):
    assert validate(setup(speculative_method=method)) == []


def test_a_separate_draft_model_is_refused():
    p = only(validate(setup(speculative_method="draft_model")))
    assert p.option == "speculative_config.method" and "numbers its cache layers from 0" in p.message
    assert '"method": "mtp"' in p.message and "remove enable_kvpp" in p.message
    assert validate(setup(speculative_method="draft_model", kvpp=KvppConfig(enabled=False))) == []


def test_dcp_refused():
    p = only(validate(setup(topology=Topology(tp=8, dcp=2))))
    assert p.option == "decode_context_parallel_size"
    assert "DCP 2" in p.message and "--decode-context-parallel-size 1" in p.message


def test_pcp_on_runner_v1_refused():
    p = only(validate(setup(topology=Topology(tp=8, pcp=2, runner="v1"))))
    assert p.option == "prefill_context_parallel_size" and "set VLLM_USE_V2_MODEL_RUNNER=1" in p.message


def test_tp1_without_pcp_is_a_warning():
    p = only(validate(setup(topology=Topology(tp=1))))
    assert (p.severity, p.option) == ("warning", "tensor_parallel_size")
    assert "KVPP is inert (capacity ratio 1.0)" in p.message
    assert validate(setup(topology=Topology(tp=1, pcp=2, runner="v2"))) == []


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


def test_every_problem_is_reported_at_once():
    bad = setup(model=ModelSpec("llama-3", 32, 0, 0, 0, attention="mha"), enforce_eager=False,
                topology=Topology(tp=8, pcp=2, dcp=2, runner="v1"),
                kv_connector="AscendStoreConnector", kv_role="kv_consumer",
                kv_extra={"use_layerwise": True, "load_asnyc": True}, kv_events=True)
    options = [p.option for p in validate(bad)]
    assert options == ["model", "decode_context_parallel_size", "prefill_context_parallel_size",
                       "compilation_config.cudagraph_mode",
                       "kv_role", "kv_connector_extra_config.load_asnyc", "kv_connector_extra_config.backend",
                       "kv_connector_extra_config.lookup_rpc_port", "kv_connector_extra_config.use_layerwise",
                       "kv_connector_extra_config.load_async", "kv_events_config", "prefill_context_parallel_size"]


def test_raise_for_errors_lists_every_error_one_per_line():
    problems = validate(setup(enforce_eager=False, topology=Topology(tp=8, dcp=2)))
    with pytest.raises(KvppConfigError) as err:
        raise_for_errors(problems)
    lines = str(err.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("decode_context_parallel_size: ") and lines[1].startswith("enforce_eager: ")


def test_raise_for_errors_returns_warnings():
    warning = Problem("warning", "tensor_parallel_size", "inert")
    assert raise_for_errors([warning]) == [warning]
    assert raise_for_errors([]) == []


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


@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_speculative_decoding_with_pp_is_refused_naming_both_fixes(method):
    p = only(validate(setup(topology=Topology(tp=8, pp=2), speculative_method=method)))
    assert p.option == "speculative_config" and f"({method})" in p.message and "PP 2" in p.message
    assert "drop --speculative-config" in p.message and "--pipeline-parallel-size 1" in p.message
    assert validate(setup(topology=Topology(tp=8, pp=2))) == []


@pytest.mark.parametrize("extra, role, events, option", [
    ({"load_async": True, "use_layerwise": True}, "kv_both", False, "use_layerwise"),
    ({}, "kv_both", False, "load_async"),
    ({"load_async": True, "discard_partial_chunks": False}, "kv_both", False, "discard_partial_chunks"),
    ({"load_async": True, "consumer_is_to_put": True}, "kv_both", False, "consumer_is_to_put"),
    ({"load_async": True}, "kv_consumer", False, "kv_role"),
    ({"load_async": True}, "kv_both", True, "kv_events_config"),
])
def test_kvpp_refuses_unsupported_pool_settings(store_engine_config, extra, role, events, option):
    from kvpp_core.validation import validate_vllm_config

    with pytest.raises(KvppConfigError, match=option):
        validate_vllm_config(pool_config(store_engine_config, extra, role, events))


def test_kvpp_accepts_the_supported_pool_settings_and_off_skips_the_kvpp_rules(store_engine_config, caplog):
    from kvpp_core.validation import validate_vllm_config

    assert validate_vllm_config(pool_config(store_engine_config, {"load_async": True})) == []
    assert validate_vllm_config(pool_config(store_engine_config, {"consumer_is_to_put": True}, "kv_consumer", kvpp=False)) == []


def test_warnings_are_logged_once_per_process(store_engine_config):
    import logging

    from kvpp_core import validation

    cfg = pool_config(store_engine_config, {"load_async": True})
    cfg.parallel_config.tensor_parallel_size = 1  # KVPP inert: a warning, not an error
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("vllm.kvpp_core.validation").addHandler(handler)
    validation._logged.clear()
    try:
        for _ in range(3):  # engine, then each connector of the process
            assert [p.option for p in validation.validate_vllm_config(cfg)] == ["tensor_parallel_size"]
    finally:
        logging.getLogger("vllm.kvpp_core.validation").removeHandler(handler)
    assert len([r for r in records if "tensor_parallel_size" in r]) == 1
