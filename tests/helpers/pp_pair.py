"""The TP2 x PP2 offline engine run (KVPP off, staging or zero-copy) and its `kvpp plan`, shared by the eager
and the compiled PP engine tests: the tiny model split unevenly (7 + 9 layers, VLLM_PP_LAYER_PARTITION), fp32."""

from __future__ import annotations

from testbed.engine import EngineSettings
from testbed.engine_run import Job, run_engine
from testbed.prompts import token_prompts
from testbed.staggered import Staggered

from kvpp_core.capacity import plan_capacity
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology

SPLIT = (7, 9)
KV_BYTES = 64 << 20
BLOCK = 16
MAX_TOKENS = 8
PROMPT_LENGTHS = (300, 45, 170, 90)
PAGE = BLOCK * 576 * 4  # one layer's block: 16 tokens x (512 + 64) fp32


def pp_run(model: str, **settings) -> dict:
    """One run of the workload, TP2 x PP2 split SPLIT; `settings` further EngineSettings (kvpp, staging,
    compiled, worker_extension)."""
    job = Job(EngineSettings(model=model, tp=2, pp=2, kv_bytes=KV_BYTES, **settings),
              Staggered(token_prompts(model, PROMPT_LENGTHS), max_tokens=MAX_TOKENS))
    return run_engine(job, env={"VLLM_PP_LAYER_PARTITION": ",".join(map(str, SPLIT))})


def pp_plan(model: str, staging: int = 2):
    """`kvpp plan` for the same model, split and memory as pp_run."""
    return plan_capacity(ModelSpec.from_hf_config(model), Topology(tp=2, pp=2, pp_layers=SPLIT), KV_BYTES,
                         block_size=BLOCK, staging=staging)
