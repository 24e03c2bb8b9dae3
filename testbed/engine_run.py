"""One engine run: a typed job (the engine's settings and its workload) in, one JSON result out.

Tests and benchmarks call `run_engine(job)`, which writes the job to a file and starts
`python -m testbed.engine_run JOB_FILE` in a process group of its own; one process hosts one engine
configuration, so every configuration a test compares is a run of its own. The driver reads the job (refusing
one that does not match its types), builds the engine (testbed.engine.build_llm), serves the workload
(testbed.staggered or testbed.script) and prints `RESULT {json}`, with the KV cache events a subscriber received
when the job asked for them (testbed.kv_events).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from deploy.services.processes import run_in_group
from testbed.engine import EngineSettings, build_llm
from testbed.kv_events import EventRecorder
from testbed.script import Script
from testbed.scripts import ROOT, script_argv, script_env
from testbed.staggered import Staggered

RESULT_PREFIX = "RESULT "


class Job(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    engine: EngineSettings
    workload: Staggered | Script


def run_engine(job: Job, env: Mapping[str, str] | None = None, timeout: float = 900,
               log: Path | None = None, roots: Sequence[Path] = (ROOT,), wrap: Sequence[str] = ()) -> dict:
    """The result of one run of `job` (its output also in `log`, if given), or RuntimeError with the end of
    its output. Each worker gets one OpenMP core, the TP ranks of a stage different ones (PP stages take
    turns); `env` adds to the environment; `roots`: where the driver imports from (testbed.scripts.script_env);
    `wrap`: a command the driver runs under (it ends by running its arguments: a mount namespace's, say)."""
    bind = "|".join(str(i % 2) for i in range(job.engine.workers))
    with tempfile.TemporaryDirectory(prefix="kvpp-engine-job-") as tmp:
        path = Path(tmp) / "job.json"
        path.write_bytes(msgspec.json.encode(job))
        proc = run_in_group([*wrap, *script_argv("engine_run", str(path))], timeout=timeout,
                            env=script_env({"VLLM_CPU_OMP_THREADS_BIND": bind, **(env or {})}, roots))
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line.removeprefix(RESULT_PREFIX))
    raise RuntimeError(f"engine run failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{proc.stdout[-4000:]}")


def main(job_file: str) -> None:
    job = msgspec.json.decode(Path(job_file).read_bytes(), type=Job)
    llm = build_llm(job.engine, job.workload.block_zeroing)
    recorder = None if job.engine.kv_events is None else EventRecorder(job.engine.kv_events)
    result = job.workload.serve(llm)
    if recorder is not None:
        result["kv_events"] = recorder.collect()
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
