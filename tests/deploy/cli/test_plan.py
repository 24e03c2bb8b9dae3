"""`kvpp plan`: figures, JSON shape, one-line errors without tracebacks, and the plot."""

import json
import subprocess
import sys

import pytest

from deploy.cli.main import main
from kvpp_core.modes import mib

pytestmark = pytest.mark.unit


def run_json(capsys, *args):
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_glm_tp8_json(capsys):
    data = run_json(capsys, "--model", "glm-5.2", "--tp", "8")
    assert {"ratio", "tokens_off", "tokens_on", "stages"} <= data.keys()
    assert data["ratio"] == pytest.approx(6.50, abs=0.005)
    assert data["tokens_on"] > data["tokens_off"] > 0
    assert data["model_mtp_layers"] == 1 and data["model"]["mtp_layers"] == 0
    assert [len(r["owned"]) for r in data["stages"][0]["ranks"]] == [10] * 6 + [9] * 2


@pytest.mark.parametrize(
    "args, ratio, binding_off",
    [
        (["--staging", "1"], 78 / 11, [0]),
        (["--staging", "0"], 78 / 10, [0]),
        (["--pp-layers", "38,40"], 40 / 7, [1]),
        (["--pp", "2", "--pp-layers", "38,40", "--memory-gib", "55,60"], 38 / 7, [0]),
        (["--mtp", "1"], 79 / 13, [0]),
    ],
)
def test_anchor_figures(capsys, args, ratio, binding_off):
    data = run_json(capsys, "--model", "glm-5.2", "--tp", "8", *args)
    assert data["ratio"] == pytest.approx(ratio, rel=1e-3)
    assert data["binding_stages_off"] == binding_off


def test_table_names_binding_stages(capsys):
    assert main(["plan", "--model", "glm-5.2", "--tp", "8", "--pp-layers", "38,40", "--memory-gib", "55,60"]) == 0
    out = capsys.readouterr().out
    assert "without KVPP: " in out and "(binding: stage 0)" in out
    assert "capacity ratio 5.43x; equivalent KV memory saving 81.6%" in out
    assert "1     7  73-77 (5)" in out  # stage 1, rank 7 owns layers 73-77
    assert "pass --mtp 1 when serving with MTP" in out


def test_tiny_model_plan_and_hf_path(capsys, tmp_path):
    data = run_json(capsys, "--model", "kvpp-tiny", "--tp", "2", "--block-size", "16", "--memory-gib", "0.0625")
    assert data["ratio"] == pytest.approx(1.6, rel=1e-2) and data["block_size"] == 16
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="deepseek_v3", num_hidden_layers=61, num_nextn_predict_layers=1, kv_lora_rank=512,
        qk_rope_head_dim=64, torch_dtype="bfloat16")))
    data = run_json(capsys, "--model", str(tmp_path), "--tp", "8", "--kv-dtype", "fp8")
    assert data["model"]["kv_dtype"] == "fp8" and data["bundle_bytes_per_token"] == 576


def test_tp1_warns_and_reports_ratio_1(capsys):
    assert main(["plan", "--model", "deepseek-v2-lite", "--tp", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ratio"] == 1.0
    assert captured.err.startswith("kvpp: warning: tensor_parallel_size: TP=1 without PCP")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt-9", "--tp", "8"], "unknown model 'gpt-9'"),
        (["--model", "glm-5.2", "--tp", "3"], "TP 3 does not divide the 64 attention heads"),
        (["--model", "glm-5.2", "--tp", "8", "--pp-layers", "38,39"], "sums to 77 but the model has 78"),
        (["--model", "glm-5.2", "--tp", "8", "--pp-layers", "38,x"], "argument --pp-layers: takes comma-separated integers like 38,40"),
        (["--model", "glm-5.2", "--tp", "8", "--memory-gib", "-4"], "argument --memory-gib: takes a number or comma-separated numbers like 60,64: expected a number in (0, "),
        (["--model", "glm-5.2", "--tp", "8", "--memory-gib", "1,2,3"], "one value or one per PP stage (1)"),
        (["--model", "glm-5.2", "--tp", "8", "--staging", "5"], "kvpp_staging_buffers must be an integer from 0 to 3"),
        (["--model", "glm-5.2", "--tp", "8", "--pcp", "2"], "set VLLM_USE_V2_MODEL_RUNNER=1"),
        (["--model", "glm-5.2", "--tp", "8", "--mtp", "-1"], "argument --mtp: expected an integer from 0 to 64, got -1"),
        (["--model", "glm-5.2", "--tp", "0"], "argument --tp: expected an integer from 1 to 1024, got 0"),
    ],
)
def test_bad_input_is_one_line(capsys, args, message):
    assert main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpp: error: ") and message in lines[0]


def test_malformed_config_through_the_real_command(tmp_path):
    (tmp_path / "config.json").write_text("{broken")
    proc = subprocess.run([sys.executable, "-m", "deploy.cli.main", "plan", "--model", str(tmp_path), "--tp", "8"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().startswith("kvpp: error: ") and "not a readable JSON config" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_plot_writes_a_png(capsys, tmp_path):
    out = tmp_path / "ratio.png"
    assert main(["plan", "--model", "glm-5.2", "--tp", "8", "--plot", str(out)]) == 0
    assert f"plot written to {out}" in capsys.readouterr().out
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_to_unwritable_path_is_one_line(capsys, tmp_path):
    assert main(["plan", "--model", "glm-5.2", "--tp", "8", "--plot", str(tmp_path / "missing" / "x.png")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("kvpp: error: ")


def test_a_table_too_large_to_compute_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(dict(  # no head count: no divisibility check stops it
        model_type="deepseek_v3", num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64)))
    assert main(["plan", "--model", str(tmp_path), "--tp", "1024", "--pp", "61"]) == 2
    assert "62464 ranks to tabulate" in capsys.readouterr().err


def test_a_plan_that_names_no_mode_plans_the_mode_the_platform_runs(capsys):
    """vllm-cpu (named, or implied by a CPU kernel): zero-copy, as an engine there that names no mode; elsewhere, or
    where the platform is not known, staging; each says why, and a named mode is the mode."""
    tiny = ["--model", "kvpp-tiny", "--tp", "2", "--memory-gib", "0.0625"]
    for platform_args in (["--attention-backend", "CPU_MLA"], ["--platform", "vllm-cpu", "--block-size", "16"]):
        data = run_json(capsys, *tiny, *platform_args)
        assert (data["platform"], data["mode"], data["staging"]) == ("vllm-cpu", "zero-copy", 0)
        assert data["ratio"] == pytest.approx(2.0, rel=1e-2)
        assert data["mode_reason"].startswith("the default where a group's ranks share one x86-64 host's memory")
    for platform_args, platform in (([], None), (["--platform", "vllm"], "vllm")):
        data = run_json(capsys, *tiny, "--block-size", "16", *platform_args)
        assert (data["platform"], data["mode"], data["staging"]) == (platform, "staging", 2)
        assert data["mode_reason"].startswith("the default here, since zero-copy cannot run")
    named = run_json(capsys, *tiny, "--attention-backend", "CPU_MLA", "--staging", "2")
    assert (named["staging"], named["mode_reason"]) == (2, "named by the launch's kvpp_staging_buffers")
    assert main(["plan", *tiny, "--attention-backend", "CPU_MLA"]) == 0
    out = capsys.readouterr().out
    assert "  mode      zero-copy (kvpp_staging_buffers 0): the default where" in out
    hint = "(--platform vllm-cpu plans what an engine there runs naming no mode)"
    assert hint not in out
    for platform_args, shown in (([], True), (["--platform", "vllm"], False), (["--staging", "2"], False)):
        assert main(["plan", *tiny, "--block-size", "16", *platform_args]) == 0
        assert (hint in capsys.readouterr().out) is shown, platform_args


def test_a_cpu_kernel_on_another_platform_is_one_line(capsys):
    assert main(["plan", "--model", "kvpp-tiny", "--tp", "2", "--platform", "vllm", "--attention-backend", "CPU_MLA"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "CPU_MLA is a vllm-cpu kernel, but --platform is vllm" in err[0]


def test_a_zero_copy_plan_says_what_it_asks_of_dev_shm(capsys):
    """The KV backing of every rank at the plan's blocks, plus each rank's flag segment: the room an engine checks
    before sizing its KV cache (kvpp_core.modes.start_obstacles); what it does where /dev/shm is short depends on
    whether the launch named zero-copy."""
    tiny = ["--model", "kvpp-tiny", "--tp", "2", "--memory-gib", "0.0625", "--attention-backend", "CPU_MLA"]
    data = run_json(capsys, *tiny)
    needed = sum(data["blocks_on"] * r["bytes_per_block_on"] + (1 << 20) for r in data["stages"][0]["ranks"])
    assert data["shm_needed_bytes"] == needed
    assert main(["plan", *tiny]) == 0
    out = capsys.readouterr().out
    assert f"  /dev/shm  zero-copy keeps the KV backing there ({mib(needed)} on the busiest host" in out
    assert "where it is short starts in staging and says why (docker run --shm-size" in out
    assert main(["plan", *tiny, "--staging", "0"]) == 0
    assert "where it is short refuses to start, naming the size" in capsys.readouterr().out
    assert run_json(capsys, *tiny, "--staging", "2")["shm_needed_bytes"] is None
    assert main(["plan", *tiny, "--staging", "2"]) == 0
    assert "/dev/shm" not in capsys.readouterr().out


# ---- every mode side by side, and GQA models: the replica group of one KV head ------------------------------
def _modes(data):
    return {m["name"]: m for m in data["modes"]}


def test_every_mode_is_planned_side_by_side_for_mla_as_for_gqa(capsys):
    """One code path: off, staging 2 and 1, zero-copy; the ratios are the layer-granular ones (layers over owned
    layers plus staging buffers), zero-copy's marked where it cannot run."""
    modes = _modes(run_json(capsys, "--model", "glm-5.2", "--tp", "8", "--platform", "vllm-cpu"))
    assert list(modes) == ["KVPP off", "staging 2", "staging 1", "zero-copy"]
    assert [modes[m]["ratio"] for m in modes] == pytest.approx([1.0, 78 / 12, 78 / 11, 78 / 10], rel=1e-3)
    assert modes["zero-copy"]["runs"] is False and "glm-5.2 is SFA" in modes["zero-copy"]["note"]
    assert all(modes[m]["runs"] for m in ("KVPP off", "staging 2", "staging 1"))


@pytest.mark.parametrize("model, tp, layers, group, groups_shown, pairs", [
    ("qwen3-235b-a22b", 8, 94, 2, "4 per PP stage, one per KV head: its 2 TP ranks (ranks 0-1, 2-3, 4-5, 6-7)", 4),
    ("llama-3.1-405b", 16, 126, 2, "8 per PP stage, one per KV head: its 2 TP ranks (ranks 0-1, 2-3, 4-5, 6-7, ...)",
     8),
])
def test_gqa_plan_gives_each_modes_capacity_with_the_group_named(capsys, model, tp, layers, group, groups_shown,
                                                                 pairs):
    data = run_json(capsys, "--model", model, "--tp", str(tp), "--platform", "vllm-cpu")
    assert data["replica_group"].startswith(groups_shown)
    assert data["replica_groups"] == [[2 * g, 2 * g + 1] for g in range(pairs)]
    assert (data["topology"]["group_size"], data["topology"]["groups_per_stage"]) == (group, pairs)
    assert (data["kernel"], data["block_size"], data["mode"]) == ("CPU_ATTN", 128, "zero-copy")
    modes = _modes(data)
    owned = layers // group
    assert [modes[m]["ratio"] for m in modes] == pytest.approx(
        [1.0, layers / (owned + 2), layers / (owned + 1), layers / owned], rel=2e-3)
    assert all(modes[m]["runs"] for m in modes) and modes["KVPP off"]["tokens"] < modes["staging 2"]["tokens"] < \
        modes["staging 1"]["tokens"] < modes["zero-copy"]["tokens"]
    assert main(["plan", "--model", model, "--tp", str(tp), "--platform", "vllm-cpu"]) == 0
    out = capsys.readouterr().out
    assert f"  group     cache-replica groups: {groups_shown}" in out
    rows = out.split("modes at this memory")[1].splitlines()
    assert [r.split()[0] for r in rows[2:6]] == ["KVPP", "staging", "staging", "zero-copy"]
    assert rows[5].endswith("2.00x  *")  # zero-copy: the mode vllm-cpu runs naming none


def test_qwen3_235b_at_tp4_is_refused_with_the_tp_that_pays_off(capsys):
    assert main(["plan", "--model", "qwen3-235b-a22b", "--tp", "4"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(
        "kvpp: error: tensor_parallel_size: no KV head of qwen3-235b-a22b is replicated at TP 4: its 4 KV heads are "
        "split over the TP ranks, 1 per rank") and "KVPP pays off from TP 8" in err[0]


@pytest.mark.parametrize("args, message", [
    (["--model", "qwen3-235b-a22b", "--tp", "8", "--attention-backend", "CPU_MLA"],
     "--attention-backend: CPU_MLA is an MLA kernel, and qwen3-235b-a22b uses standard (GQA) attention"),
    (["--model", "kvpp-tiny", "--tp", "2", "--attention-backend", "CPU_ATTN"],
     "--attention-backend: CPU_ATTN is standard attention's kernel, and kvpp-tiny is an MLA model"),
    (["--model", "kvpp-tiny-gqa", "--tp", "2", "--platform", "vllm-cpu", "--block-size", "48"],
     "block_size: CPU_ATTN needs a block size that is a multiple of 32, not 48"),
    (["--model", "qwen3-next-80b-a3b", "--tp", "8"], "is a hybrid model: 36 of its 48 layers are linear_attention"),
])
def test_gqa_plans_refuse_what_the_engine_would_not_run(capsys, args, message):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and message in err[0], err
