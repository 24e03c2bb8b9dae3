"""What every zero-copy engine run must show against its KVPP-off reference, shared by the eager
(test_zero_copy_engine.py) and the compiled (test_runtime_compiled_engine.py) engine tests."""

from __future__ import annotations

from collections.abc import Callable


def assert_blocks_are_the_plans(on: dict, plan) -> None:
    """Every worker holds the blocks `kvpp plan --staging 0` gives it, its owned layers and no staging slot."""
    assert {w["num_blocks"] for w in on["workers"]} == {plan.blocks_on}
    for worker in on["workers"]:
        rank = plan.stages[worker.get("pp_rank", 0)].ranks[worker["kvpp_rank"]]
        assert worker["owned_layers"] == list(rank.owned) and worker["staging_slots"] == 0
        assert worker["bytes_per_block"] == rank.bytes_per_block_on
        assert worker["allocated_kv_bytes"] == worker["kv_bytes"] == plan.blocks_on * rank.bytes_per_block_on


def assert_reads_every_foreign_layer_in_place(on: dict, layers_of: Callable[[dict], int]) -> None:
    """Nothing copied, and each worker read every foreign layer of its stage (`layers_of(worker)` layers) on
    every step its forward ran, leaving each such layer's write to the owner."""
    for worker in on["workers"]:
        stats = worker["broadcast"]
        foreign = layers_of(worker) - len(worker["owned_layers"])
        assert stats["transport"] == "zero-copy" and stats["bytes"] == 0
        assert stats["forward_steps"] > 0
        assert stats["reads"] == stats["writes_skipped"] == foreign * stats["forward_steps"]
