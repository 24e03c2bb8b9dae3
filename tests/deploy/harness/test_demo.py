"""`kvpp demo`, the integration test of the whole suite: its report is checked, not just its exit code."""

from __future__ import annotations

import json
import sys

import pytest

from kvpp_core.cpu_backends import host_has_amx
from kvpp_core.model import DTYPE_BYTES

from deploy.services.processes import run_in_group

pytestmark = pytest.mark.engine

SHARED_PREFIX_TOKENS = 320  # the demo's repeated prefix: sample_prompt(320) is 320 tokens
LAYERS = 16


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("demo")
    proc = run_in_group([sys.executable, "-m", "deploy.cli.main", "demo", "--json", "--workdir", str(workdir)],
                        timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[kvpp demo] 5/5" in proc.stderr  # progress lines while it works
    return json.loads(proc.stdout)


def test_answers_through_pd_and_pool_equal_a_colocated_engine(report):
    assert report["answers_match"] is True
    assert all(r["matches_reference"] for r in report["requests"].values())


def test_capacity_matches_the_plan(report):
    cap = report["capacity"]
    assert cap["blocks_off"] == cap["plan_blocks_off"]
    assert cap["blocks_on"] >= 0.97 * cap["plan_blocks_on"]
    assert cap["plan_ratio"] > 1.55


def test_decode_pulled_every_prompt_page_from_the_prefill(report):
    xfer, engine = report["transfer"], report["engine"]
    page_bytes = engine["block_size"] * 576 * DTYPE_BYTES[engine["dtype"]]
    assert xfer["pulls"] == len(report["requests"]) and xfer["failures"] == 0
    assert xfer["bytes"] > 0 and xfer["bytes"] % (LAYERS * page_bytes) == 0
    assert xfer["seconds"] > 0


def test_the_demo_ran_the_kernel_a_user_of_this_host_runs(report):
    assert report["engine"] == ({"kernel": "AMX_MLA", "dtype": "bfloat16", "block_size": 128} if host_has_amx() else
                                {"kernel": "CPU_MLA", "dtype": "float32", "block_size": 16})


def test_repeated_prefix_was_not_computed_again(report):
    """The repeated prefix's whole blocks came from the pool, or (AMX_MLA) first from vLLM's own prefix cache."""
    pool, block = report["pool"], report["engine"]["block_size"]
    assert pool["hit_tokens"] + pool["local_hit_tokens"] >= SHARED_PREFIX_TOKENS // block * block
    assert pool["saved_bytes"] > 0  # the prefill is the pool's producer on this host's kernel too
