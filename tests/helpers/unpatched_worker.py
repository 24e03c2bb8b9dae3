"""A worker class the KVPP adapter does not patch, and a script that starts a KVPP engine with it.

`OwnAllocationWorker` allocates its KV cache itself, as out-of-tree workers do (vllm-ascend's
`NPUWorker` has its own `initialize_from_config`): KVPP's allocation never runs on it. Started with
`enable_kvpp`, the engine must refuse to start (kvpp_core.activation) instead of serving without KVPP.
Run as `python -m tests.helpers.unpatched_worker JOB`, JOB an UnpatchedStart as JSON (e.g.
`{"model": DIR, "worker_cls": "auto", "tp": 2}`); it exits 0 only if the engine started.
"""

from __future__ import annotations

import sys
from typing import Annotated

import msgspec
from vllm.v1.worker.cpu_worker import CPUWorker

from deploy.services.processes import REFERENCE

WORKER_CLS = "tests.helpers.unpatched_worker.OwnAllocationWorker"  # not __name__: "__main__" when run


class OwnAllocationWorker(CPUWorker):
    def initialize_from_config(self, kv_cache_config) -> None:
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        self.model_runner.initialize_kv_cache(kv_cache_config)


class UnpatchedStart(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    model: str
    worker_cls: str = WORKER_CLS
    """Default: OwnAllocationWorker; "auto": vLLM's own."""
    tp: Annotated[int, msgspec.Meta(ge=1)] = 1


def main(job_json: str) -> None:
    job = msgspec.json.decode(job_json, type=UnpatchedStart)
    from vllm import LLM

    LLM(model=job.model, worker_cls=job.worker_cls, tensor_parallel_size=job.tp,
        distributed_executor_backend="mp", **REFERENCE.engine_args(),
        enforce_eager=True, kv_cache_memory_bytes=16 << 20, max_model_len=256, additional_config={"enable_kvpp": True, "kvpp_staging_buffers": 2})
    print("ENGINE STARTED", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
