"""The realistic-shape option of the tiny model: DeepSeek-V2-Lite's attention geometry, deterministic."""

import hashlib
import json

import pytest

from deploy.harness.tiny_model import STAMP, build_tiny_model

pytestmark = pytest.mark.unit


def _digests(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_deepseek_v2_lite_shape_has_the_real_attention_geometry_and_is_reproducible(tmp_path):
    from safetensors import safe_open

    a = build_tiny_model(tmp_path / "a", layers=1, shape="deepseek-v2-lite")
    b = build_tiny_model(tmp_path / "b", layers=1, shape="deepseek-v2-lite")
    assert _digests(a) == _digests(b)
    cfg = json.loads((a / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"],
            cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["q_lora_rank"]) == (2048, 16, 512, 64, 128, 128, None)
    assert cfg["intermediate_size"] == 1408
    with safe_open(str(a / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.kv_b_proj.weight").get_shape() == [16 * (128 + 128), 512]
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [16 * (128 + 64), 2048]
    assert json.loads((a / STAMP).read_text())["shape"] == "deepseek-v2-lite"


def test_the_shape_is_part_of_the_build_identity_and_the_cli(tmp_path, capsys):
    from deploy.cli.main import main

    tiny = build_tiny_model(tmp_path / "m", layers=1)
    assert json.loads((tiny / "config.json").read_text())["hidden_size"] == 128
    assert main(["tiny-model", str(tmp_path / "m"), "--layers", "1", "--shape", "deepseek-v2-lite"]) == 0
    assert json.loads((tiny / "config.json").read_text())["hidden_size"] == 2048, "a new shape rebuilds"
    with pytest.raises(ValueError, match="unknown tiny model shape 'v3'.*deepseek-v2-lite"):
        build_tiny_model(tmp_path / "x", shape="v3")
