"""The tiny model generator: byte-identical output per seed, skip on rebuild, tokenizer round trip."""

import hashlib
import json

import pytest

from deploy.harness.tiny_model import STAMP, build_tiny_model, sample_prompt

pytestmark = pytest.mark.unit


def _digests(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_seed_gives_identical_files_and_other_seed_differs(tmp_path):
    a = build_tiny_model(tmp_path / "a", layers=2, seed=7)
    b = build_tiny_model(tmp_path / "b", layers=2, seed=7)
    c = build_tiny_model(tmp_path / "c", layers=2, seed=8)
    assert _digests(a) == _digests(b)
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]


def test_rebuild_with_same_parameters_is_skipped_and_changed_parameters_rebuild(tmp_path):
    path = build_tiny_model(tmp_path / "m", layers=2)
    weights = path / "model.safetensors"
    before = weights.stat().st_mtime_ns
    build_tiny_model(path, layers=2)
    assert weights.stat().st_mtime_ns == before
    build_tiny_model(path, layers=3)
    assert json.loads((path / STAMP).read_text())["layers"] == 3
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3


def test_moe_and_mtp_variants_have_expert_and_mtp_tensors(tmp_path):
    from safetensors import safe_open

    path = build_tiny_model(tmp_path / "moe", layers=2, moe=True, mtp=1)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["num_nextn_predict_layers"] == 1
    assert cfg["n_group"] == 1 and cfg["topk_group"] == 1
    assert "model.layers.0.mlp.gate_proj.weight" in names  # first layer dense
    assert {f"model.layers.1.mlp.experts.{e}.up_proj.weight" for e in range(4)} <= names
    assert "model.layers.2.eh_proj.weight" in names  # the MTP layer follows the target layers


def test_tokenizer_counts_words_and_round_trips(tmp_path):
    from transformers import AutoTokenizer

    path = build_tiny_model(tmp_path / "t", layers=1)
    tok = AutoTokenizer.from_pretrained(str(path))
    prompt = sample_prompt(40, seed=3)
    ids = tok(prompt)["input_ids"]
    assert len(ids) == 40 and tok.unk_token_id not in ids
    assert tok.decode(ids) == prompt
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["vocab_size"] == len(tok) and cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64


def test_cli_builds_and_prints_the_path(tmp_path, capsys):
    from deploy.cli.main import main

    assert main(["tiny-model", str(tmp_path / "cli"), "--layers", "2", "--moe", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    stamp = json.loads((tmp_path / "cli" / STAMP).read_text())
    assert stamp["layers"] == 2 and stamp["moe"] is True and stamp["seed"] == 3 and stamp["mtp"] == 0


def _one_error_line(capsys, argv):
    from deploy.cli.main import main

    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpp: error: ")
    return lines[0]


def test_a_directory_it_did_not_write_is_refused_and_kept(tmp_path, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    assert "was not written by kvpp tiny-model" in _one_error_line(capsys, ["tiny-model", str(user), "--layers", "1"])
    assert [p.name for p in user.iterdir()] == ["notes.txt"] and (user / "notes.txt").read_text() == "keep"
    (tmp_path / "file").write_text("keep")
    assert "not a directory" in _one_error_line(capsys, ["tiny-model", str(tmp_path / "file")])
    assert (tmp_path / "file").read_text() == "keep"


def test_a_rebuild_never_removes_files_it_did_not_write(tmp_path, capsys):
    path = build_tiny_model(tmp_path / "m", layers=1)
    (path / "notes.txt").write_text("keep")
    build_tiny_model(path, layers=1)  # same parameters: nothing to do, the extra file stays
    line = _one_error_line(capsys, ["tiny-model", str(path), "--layers", "2"])
    assert "holds files kvpp tiny-model did not write (notes.txt)" in line
    assert (path / "notes.txt").read_text() == "keep"
    assert json.loads((path / STAMP).read_text())["layers"] == 1  # the old build is untouched
    (path / "notes.txt").unlink()
    build_tiny_model(path, layers=2)
    assert json.loads((path / STAMP).read_text())["layers"] == 2


def test_an_empty_directory_is_used_and_a_symlink_is_not_replaced(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (build_tiny_model(empty, layers=1) / STAMP).is_file()
    link = tmp_path / "link"
    link.symlink_to(empty)
    assert build_tiny_model(link, layers=1) == link  # an up-to-date build behind a link is fine to read
    assert "symbolic link" in _one_error_line(capsys, ["tiny-model", str(link), "--layers", "2"])
    assert json.loads((empty / STAMP).read_text())["layers"] == 1
