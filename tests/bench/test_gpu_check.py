"""The GPU check without a GPU: its scripts parse, and its dry run (CPU tensors, small sizes) drives every
part's code path, Mooncake transfers and pool against the CPU Mooncake build, bytes compared, into one
report. The figures of a dry run are no GPU figures; the test asserts the report's shape and checks."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

PARTS = ["environment", "mooncake_transfer", "mooncake_pool", "broadcast", "copy", "packing", "gqa_packing"]
CONFIGS = ["100%", "50% contiguous", "50% scattered", "50% runs", "10% contiguous", "10% scattered", "10% runs"]
MODES = ("whole", "ranges", "runs", "gather", "move", "place", "place_bytes", "packed")


@pytest.mark.unit
@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_check_prepare.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(REPO / "bench" / script)], check=True)


@pytest.mark.integration
def test_dry_run_drives_every_part_and_checks_the_bytes(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MC_LOG_LEVEL": "ERROR"}
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and list(report["parts"]) == PARTS
    parts = report["parts"]
    assert {name: p["status"] for name, p in parts.items()} == dict.fromkeys(PARTS, "ok"), parts
    assert parts["mooncake_transfer"]["bytes_checked"] and parts["mooncake_pool"]["bytes_checked"]
    broadcast = parts["broadcast"]
    assert broadcast["bytes_checked"] and broadcast["referenced_steps_exact"]
    # Per rank, 2 foreign layers of 64 blocks: twice every block, twice the 6 referenced (10%).
    assert broadcast["bytes_received"] == dict.fromkeys(("0", "1"), 2 * 2 * (64 + 6) * 16 * 576 * 2)
    for tokens in (256, 512, 1024):
        entry = parts["copy"][f"{tokens}_tokens"]
        assert entry["blocks"] == tokens // 16
        for mode in ("whole_layer", "coalesced_ranges", "per_block", "cuda_ipc"):
            assert entry[mode]["seconds"]["n"] == 5 and entry[mode]["seconds"]["min"] > 0
    gqa = parts["gqa_packing"]
    # Qwen3-235B-A22B at TP8: one KV head per rank, on a group of 2 ranks; CPU_ATTN's 128-token blocks of K and V.
    assert (gqa["model"], gqa["tp"], gqa["replica_group_ranks"], gqa["kv_heads_per_rank"], gqa["block_size"],
            gqa["page_bytes"]) == ("qwen3-235b-a22b", 8, 2, 1, 128, 128 * 2 * 128 * 2)
    for part, block in (("packing", 16), ("gqa_packing", 128)):
        for tokens in (2048, 4096):
            entry = parts[part][f"{tokens}_tokens"]
            assert entry["blocks"] == tokens // block
            assert set(entry["targets"]) >= {"never_above_whole", "half_at_10_percent"}
            assert list(entry["configs"]) == CONFIGS
            for config in entry["configs"].values():
                assert config["bytes_checked"] and config["choice"] in ("packed", "runs", "whole")
                for mode in MODES:
                    assert config[f"{mode}_s"]["n"] == 5 and config[f"{mode}_s"]["min"] > 0
            assert entry["configs"]["100%"]["choice"] == "whole"


@pytest.mark.unit
def test_an_unknown_part_is_refused_and_a_skipped_part_says_why(tmp_path):
    run = [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(tmp_path / "r.json")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    bad = subprocess.run([*run, "--skip", "nope"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "unknown part(s) nope" in bad.stderr
    ok = subprocess.run([*run, "--skip", ",".join(PARTS[1:])], capture_output=True, text=True, env=env, cwd=REPO,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    parts = json.loads((tmp_path / "r.json").read_text())["parts"]
    assert parts["environment"]["status"] == "ok" and parts["copy"] == {**parts["copy"], "status": "skipped",
                                                                          "reason": "--skip"}
