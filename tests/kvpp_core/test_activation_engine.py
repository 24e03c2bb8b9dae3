"""Fail closed on a real engine: KVPP requested on a worker class the adapter does not patch, and the
engine refuses to start, early (before warm-up), with the worker class, the platform and the fix."""

from __future__ import annotations

import os
import sys
import time

import msgspec
import pytest

from deploy.services.processes import run_in_group
from tests.helpers.unpatched_worker import WORKER_CLS, UnpatchedStart

pytestmark = pytest.mark.engine


def test_kvpp_on_an_unpatched_worker_refuses_to_start(tiny_model):
    started = time.monotonic()
    job = msgspec.json.encode(UnpatchedStart(model=tiny_model)).decode()
    proc = run_in_group([sys.executable, "-m", "tests.helpers.unpatched_worker", job],
                        timeout=300, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"})
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ENGINE STARTED" not in out, out[-3000:]
    assert "KVPP was requested (enable_kvpp) but is not in place on every worker" in out, out[-3000:]
    assert f"worker rank 0 ({WORKER_CLS} on platform cpu) overrides initialize_from_config" in out, out[-3000:]
    assert "the KVPP adapter patches vllm.v1.worker.gpu_worker.Worker, vllm.v1.worker.cpu_worker.CPUWorker" in out
    # Liveness: a refusing engine exits after its ~30 s start, even on a loaded host; one that refused and then
    # hung would run into the 300 s group timeout.
    assert elapsed < 240, f"refusal took {elapsed:.0f} s"
