"""`kvpp demo`, the integration test of the whole suite: its report is checked, not just its exit code."""

from __future__ import annotations

import json
import sys

import pytest

from deploy.services.processes import run_in_group

pytestmark = pytest.mark.engine

SHARED_PREFIX_TOKENS = 320  # the demo's repeated prefix: sample_prompt(320) is 320 tokens, 20 whole blocks
LAYERS, PAGE_BYTES = 16, 16 * 576 * 4


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
    xfer = report["transfer"]
    assert xfer["pulls"] == len(report["requests"]) and xfer["failures"] == 0
    assert xfer["bytes"] > 0 and xfer["bytes"] % (LAYERS * PAGE_BYTES) == 0
    assert xfer["seconds"] > 0


def test_repeated_prefix_came_from_the_pool(report):
    assert report["pool"]["hit_tokens"] >= SHARED_PREFIX_TOKENS
