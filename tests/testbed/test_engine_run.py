"""The engine driver's typed job, without an engine: what the tests and benchmarks send reaches the driver
intact, what does not fit its types is refused, and the driver starts from any folder."""

import re
import subprocess

import msgspec
import pytest

from testbed.engine import EngineSettings, build_llm
from testbed.engine_run import Job
from testbed.script import Batch, Gen, Script
from testbed.scripts import ROOT, script_argv, script_env
from testbed.staggered import Staggered

pytestmark = pytest.mark.unit


def test_a_job_survives_its_trip_through_json():
    actions = [["gen", "prefix", [5, 6, 7]], ["gen", "salted", [8], {"cache_salt": "tenant-a"}],
               ["batch", [["a", [9]], ["b", [10], {"kv_transfer_params": {"do_remote_decode": True}}]],
                {"zero_blocks_of": "b"}],
               ["kill", 4242], ["decode", "512/4/0", [[1, 2]], 12], ["waves", "multi_prefix", [[[3]]]],
               ["pause", "saves/0", 3.0]]
    script = msgspec.convert({"actions": actions, "max_tokens": 6}, Script)
    assert isinstance(script.actions[1], Gen) and script.actions[1].opts.cache_salt == "tenant-a"
    assert isinstance(script.actions[2], Batch) and script.block_zeroing
    for job in (Job(EngineSettings(model="/m", tp=2, kv_transfer_config={"kv_connector": "X"}), script),
                Job(EngineSettings(model="/m", kvpp=True, staging=0), Staggered([[1, 2], [3]], corrupt_above=26))):
        assert msgspec.json.decode(msgspec.json.encode(job), type=Job) == job
    assert not msgspec.convert({"actions": actions[:2]}, Script).block_zeroing


@pytest.mark.parametrize("job, where", [
    ({"engine": {"model": "/m", "tp": 0}, "workload": {"type": "staggered", "prompts": []}}, "$.engine.tp"),
    ({"engine": {"model": "/m", "kv_mib": 64}, "workload": {"type": "staggered", "prompts": []}}, "$.engine"),
    ({"engine": {"model": "/m"}, "workload": {"type": "script", "actions": [["gen", "a", [1], {"salt": "x"}]]}},
     "$.workload.actions[0][3]"),
    ({"engine": {"model": "/m"}, "workload": {"type": "script", "actions": [["generate", "a", [1]]]}},
     "$.workload.actions[0][0]"),
])
def test_a_job_that_does_not_fit_the_types_is_refused_naming_where(job, where):
    with pytest.raises(msgspec.ValidationError, match=re.escape(f"at `{where}`")):
        msgspec.json.decode(msgspec.json.encode(job), type=Job)


def test_block_zeroing_and_a_worker_extension_exclude_each_other():
    with pytest.raises(ValueError, match="use one of them"):
        build_llm(EngineSettings(model="/m", worker_extension="tests.helpers.early_reader.EarlyReader"), True)


def test_the_driver_starts_from_any_folder_with_the_checkout_on_its_path(tmp_path):
    """testbed/ is not installed: the driver's command line and environment find it from elsewhere."""
    job = tmp_path / "job.json"
    job.write_text('{"engine": {"model": "/m"}, "workload": {"type": "nothing"}}')
    assert script_argv("engine_run", str(job))[1:] == ["-m", "testbed.engine_run", str(job)]
    assert script_env({"PYTHONPATH": "/elsewhere"})["PYTHONPATH"].split(":")[:2] == [str(ROOT), "/elsewhere"]
    proc = subprocess.run(script_argv("engine_run", str(job)), env=script_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "msgspec.ValidationError: Invalid value 'nothing'" in proc.stderr, proc.stderr
