"""A worker class the KVPP adapter does not patch, and a script that starts a KVPP engine with it.

`OwnAllocationWorker` allocates its KV cache itself, as out-of-tree workers do (vllm-ascend's
`NPUWorker` has its own `initialize_from_config`): KVPP's allocation never runs on it. Started with
`enable_kvpp`, the engine must refuse to start (kvpp_core.activation) instead of serving without KVPP.
Run as `python -m tests.helpers.unpatched_worker --model DIR [--worker-cls auto --tp 2]`; it exits 0
only if the engine started.
"""

from __future__ import annotations

import argparse

from vllm.v1.worker.cpu_worker import CPUWorker

from deploy.services.processes import reference_engine

WORKER_CLS = "tests.helpers.unpatched_worker.OwnAllocationWorker"  # not __name__: "__main__" when run


class OwnAllocationWorker(CPUWorker):
    def initialize_from_config(self, kv_cache_config) -> None:
        self.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        self.model_runner.initialize_kv_cache(kv_cache_config)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--worker-cls", default=WORKER_CLS, help="default: OwnAllocationWorker; auto: vLLM's own")
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    from vllm import LLM

    LLM(model=args.model, worker_cls=args.worker_cls, tensor_parallel_size=args.tp,
        distributed_executor_backend="mp", **reference_engine(),
        enforce_eager=True, kv_cache_memory_bytes=16 << 20, max_model_len=256, additional_config={"enable_kvpp": True})
    print("ENGINE STARTED", flush=True)


if __name__ == "__main__":
    main()
