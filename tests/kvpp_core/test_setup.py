"""A vLLM launch in the planner's terms, read from vLLM's own config: the model runner is the one vLLM
resolves (VLLM_USE_V2_MODEL_RUNNER when set, else V2 wherever Triton runs), not V1 whenever the
variable is unset."""

from __future__ import annotations

import pytest

from kvpp_core.config import parse_additional_config
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
