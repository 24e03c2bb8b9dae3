"""One model's engines in every KVPP mode on a kernel that keeps vLLM's prefix cache and chunked prefill on (bf16 on
AMX_MLA for an MLA model, fp32 on CPU_ATTN for a GQA one), each sized by `kvpp plan`: the AMX and the GQA engine
tiers (tests/kvpp_core/test_runtime_amx_engine.py, test_runtime_gqa_engine.py) run and compare them alike.

Runs of equal blocks schedule alike (the same steps, prefix-cache hits and preemptions), so every pass of their
answers must be bit-identical; runs of equal memory hold the blocks their plan gives each mode.
"""

from __future__ import annotations

from testbed.engine import EngineSettings
from testbed.engine_run import Job, run_engine
from testbed.staggered import Staggered, logprob_agreement

from deploy.services.processes import CpuEngine
from kvpp_core.capacity import CapacityPlan, plan_capacity
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology

MODES = {"off": {}, "staging": {"kvpp": True, "staging": 2}, "zero-copy": {"kvpp": True, "staging": 0}}
"""EngineSettings of each mode, named: `enable_kvpp` alone runs the default where the engine runs (kvpp_core.modes:
zero-copy on a CPU host), which the plan of a mode must match."""


def mode_plan(model: str, topology: Topology, engine: CpuEngine, kv_bytes: int, mode: dict) -> CapacityPlan:
    """`kvpp plan` for `model` in `engine`'s KV dtype and block size, with `mode`'s staging buffers."""
    spec = ModelSpec.from_hf_config(model).with_overrides(kv_dtype=engine.dtype)
    return plan_capacity(spec, topology, kv_bytes, block_size=engine.block_size, staging=mode.get("staging", 2))


def planned_blocks(plan: CapacityPlan, mode: dict) -> int:
    return plan.blocks_on if mode.get("kvpp", False) else plan.blocks_off


def budget_for(model: str, topology: Topology, engine: CpuEngine, mode: dict, blocks: int) -> int:
    """The KV bytes per rank that hold exactly `blocks` blocks in `mode` (the largest rank's bytes per block binds)."""
    probe = mode_plan(model, topology, engine, 1 << 30, mode)
    kvpp = mode.get("kvpp", False)
    per_block = max(r.bytes_per_block_on if kvpp else r.bytes_per_block_off for s in probe.stages for r in s.ranks)
    return blocks * per_block + per_block // 2


def mode_run(model: str, topology: Topology, engine: CpuEngine, mode: dict, workload: Staggered, kv_bytes: int,
             mtp: int = 0, kv_events: str | None = None, **launch) -> dict:
    """One engine of `mode` on `engine`'s kernel with `kv_bytes` of KV per rank, serving `workload`; the plan's blocks
    and bytes per block added ("planned_blocks", "plan"). `launch`: further EngineSettings (max_num_batched_tokens,
    max_num_seqs, max_model_len)."""
    settings = EngineSettings(model=model, kernel=engine.kernel.name, tp=topology.tp, pp=topology.pp, mtp=mtp,
                              kv_bytes=kv_bytes, kv_events=kv_events, **launch, **mode)
    split = {"VLLM_PP_LAYER_PARTITION": ",".join(map(str, topology.pp_layers))} if topology.pp_layers else None
    result = run_engine(Job(settings, workload), env=split)
    plan = mode_plan(model, topology, engine, kv_bytes, mode)
    result["planned_blocks"] = planned_blocks(plan, mode)
    result["plan"] = plan
    return result


def every_pass(run: dict) -> list[dict]:
    """Every pass's answers: the probe's, the waves, the multi-turn conversations, the repeats, the load, each if
    there was one."""
    probe = [phase["outputs"] for phase in run["probe"].values()]
    multi_turn = [run["multi_turn"]["outputs"]] if run.get("multi_turn") else []
    load = [run["load"]["clean"]["outputs"]] if run["load"] else []
    return [*probe, run["outputs"], *multi_turn, *run["repeats"], *load]


def assert_every_pass_bit_identical(ref: dict, got: dict) -> None:
    """Every request of every pass: the same tokens, bit-identical logprobs, and the same prompt tokens found in
    vLLM's prefix cache."""
    for want, have in zip(every_pass(ref), every_pass(got), strict=True):
        assert want.keys() == have.keys()
        for req in want:
            assert have[req]["token_ids"] == want[req]["token_ids"], f"request {req}"
            gap = logprob_agreement({"outputs": {req: want[req]}}, {"outputs": {req: have[req]}})
            assert have[req]["logprobs"] == want[req]["logprobs"], f"request {req}: {gap}"
            assert have[req]["cached_tokens"] == want[req]["cached_tokens"], f"request {req}"
