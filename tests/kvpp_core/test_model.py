"""Model descriptions: presets, Hugging Face config.json reading, clear errors on bad files."""

import json

import pytest

from kvpp_core.model import PRESETS, ModelSpec, normalize_dtype, resolve_model

pytestmark = pytest.mark.unit

MLA_KEYS = dict(kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=128, torch_dtype="bfloat16")


def write_config(tmp_path, name="config.json", **cfg):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    "name, layers, mtp, indexer, attention, dtype, bundle",
    [
        ("glm-5.2", 78, 1, 128, "sfa", "bfloat16", (512 + 64 + 128) * 2),
        ("deepseek-v3", 61, 1, 0, "mla", "bfloat16", 576 * 2),
        ("deepseek-v3.2", 61, 1, 128, "sfa", "bfloat16", (576 + 128) * 2),
        ("deepseek-v2-lite", 27, 0, 0, "mla", "bfloat16", 576 * 2),
        ("kimi-k2", 61, 0, 0, "mla", "bfloat16", 576 * 2),
        ("kvpp-tiny", 16, 0, 0, "mla", "float32", 576 * 4),
    ],
)
def test_presets(name, layers, mtp, indexer, attention, dtype, bundle):
    spec = PRESETS[name]
    assert (spec.num_layers, spec.mtp_layers, spec.indexer_dim, spec.attention, spec.kv_dtype) == (
        layers, mtp, indexer, attention, dtype)
    assert spec.bundle_bytes_per_token == bundle
    assert spec.page_bytes(16) == 16 * bundle
    assert spec.supports_kvpp and not spec.hybrid


def test_overrides_and_dtypes():
    spec = PRESETS["glm-5.2"].with_overrides(mtp_layers=0, kv_dtype="int8")
    assert spec.mtp_layers == 0 and spec.dtype_bytes == 1 and spec.bundle_bytes_per_token == 704
    assert normalize_dtype("torch.bfloat16") == "bfloat16" and normalize_dtype("FP32") == "float32"
    with pytest.raises(ValueError, match="unknown KV dtype 'int4'; use one of float32, bfloat16"):
        normalize_dtype("int4")
    with pytest.raises(ValueError, match="block size must be >= 1"):
        spec.page_bytes(0)


def test_deepseek_v2_directory(tmp_path):
    write_config(tmp_path, model_type="deepseek_v2", num_hidden_layers=27, **MLA_KEYS)
    spec = ModelSpec.from_hf_config(tmp_path)
    assert (spec.num_layers, spec.mtp_layers, spec.attention, spec.indexer_dim) == (27, 0, "mla", 0)
    assert spec.kv_dtype == "bfloat16" and spec.num_heads == 128


def test_deepseek_v3_with_mtp_and_new_dtype_key(tmp_path):
    cfg = dict(MLA_KEYS, torch_dtype=None, dtype="float16")
    path = write_config(tmp_path, model_type="deepseek_v3", num_hidden_layers=61, num_nextn_predict_layers=1, **cfg)
    spec = ModelSpec.from_hf_config(path)
    assert (spec.num_layers, spec.mtp_layers, spec.kv_dtype) == (61, 1, "float16")


def test_kimi_k2(tmp_path):
    path = write_config(tmp_path, model_type="kimi_k2", num_hidden_layers=61, **MLA_KEYS)
    assert ModelSpec.from_hf_config(path).attention == "mla"


def test_kimi_multimodal_wrapper_reads_text_config(tmp_path):
    text = dict(model_type="kimi_k2", num_hidden_layers=61, **MLA_KEYS)
    path = write_config(tmp_path, model_type="kimi_k25", text_config=text)
    assert ModelSpec.from_hf_config(path).num_layers == 61


def test_deepseek_v32_indexer(tmp_path):
    path = write_config(tmp_path, model_type="deepseek_v32", num_hidden_layers=61, num_nextn_predict_layers=1,
                        index_head_dim=128, **MLA_KEYS)
    spec = ModelSpec.from_hf_config(path)
    assert spec.attention == "sfa" and spec.indexer_dim == 128 and spec.bundle_bytes_per_token == 704 * 2


def test_glm_moe_dsa(tmp_path):
    path = write_config(tmp_path, model_type="glm_moe_dsa", num_hidden_layers=78, num_nextn_predict_layers=1,
                        kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, num_attention_heads=64,
                        torch_dtype="bfloat16", layer_types=["indexed_attention"] * 78)
    spec = ModelSpec.from_hf_config(path)
    assert (spec.num_layers, spec.mtp_layers, spec.attention, spec.hybrid) == (78, 1, "sfa", False)
    assert spec.bundle_bytes_per_token == PRESETS["glm-5.2"].bundle_bytes_per_token


def test_non_mla_models_are_described_as_mha(tmp_path):
    path = write_config(tmp_path, model_type="llama", num_hidden_layers=32, num_attention_heads=32,
                        torch_dtype="bfloat16")
    spec = ModelSpec.from_hf_config(path)
    assert spec.attention == "mha" and not spec.supports_kvpp


def test_mla_type_without_latent_is_not_mla(tmp_path):
    path = write_config(tmp_path, model_type="deepseek_v2", num_hidden_layers=4, kv_lora_rank=None)
    assert ModelSpec.from_hf_config(path).attention == "mha"


@pytest.mark.parametrize(
    "extra",
    [dict(model_type="kimi_linear"), dict(model_type="deepseek_v3", layer_types=["linear_attention", "full_attention"])],
)
def test_hybrid_models_are_flagged(tmp_path, extra):
    path = write_config(tmp_path, num_hidden_layers=2, **MLA_KEYS, **extra)
    spec = ModelSpec.from_hf_config(path)
    assert spec.hybrid and not spec.supports_kvpp


def test_generated_tiny_model_matches_its_preset(tmp_path):
    tiny_model = pytest.importorskip("deploy.harness.tiny_model")
    path = tiny_model.build_tiny_model(tmp_path / "tiny", layers=16)
    spec = ModelSpec.from_hf_config(path)
    preset = PRESETS["kvpp-tiny"]
    assert (spec.num_layers, spec.mtp_layers, spec.kv_lora_rank, spec.rope_dim, spec.kv_dtype, spec.num_heads) == (
        preset.num_layers, preset.mtp_layers, preset.kv_lora_rank, preset.rope_dim, preset.kv_dtype, preset.num_heads)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not a readable JSON config"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"num_hidden_layers": 4}', "missing model_type"),
        ('{"model_type": "deepseek_v3", "kv_lora_rank": 512, "qk_rope_head_dim": 64}',
         "num_hidden_layers must be a non-negative integer, got None"),
        ('{"model_type": "deepseek_v3", "num_hidden_layers": "61", "kv_lora_rank": 512}',
         "num_hidden_layers must be a non-negative integer, got '61'"),
        ('{"model_type": "deepseek_v3", "num_hidden_layers": 61, "kv_lora_rank": 512}',
         "qk_rope_head_dim must be a non-negative integer"),
        ('{"model_type": "deepseek_v32", "num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}',
         "index_head_dim must be a non-negative integer"),
        ('{"model_type": "deepseek_v3", "num_hidden_layers": 61, "torch_dtype": "complex64"}',
         "unsupported torch_dtype 'complex64'"),
        ('{"model_type": "llama", "num_hidden_layers": 0}', "needs at least one decoder layer"),
    ],
)
def test_malformed_configs_raise_one_line(tmp_path, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        ModelSpec.from_hf_config(path)
    assert "\n" not in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="no such file; point at a model directory"):
        ModelSpec.from_hf_config(tmp_path)


def test_resolve_model(tmp_path):
    assert resolve_model("GLM-5.2") is PRESETS["glm-5.2"]
    write_config(tmp_path, model_type="deepseek_v2", num_hidden_layers=3, **MLA_KEYS)
    assert resolve_model(str(tmp_path)).num_layers == 3
    with pytest.raises(ValueError, match="unknown model 'gpt-9': use a preset \\(glm-5.2, "):
        resolve_model("gpt-9")


def test_from_hf_dict_for_loaded_configs():
    transformers = pytest.importorskip("transformers")
    spec = ModelSpec.from_hf_dict(transformers.GlmMoeDsaConfig().to_dict(), "zai-org/GLM-5")
    assert (spec.name, spec.attention, spec.indexer_dim, spec.num_layers) == ("zai-org/GLM-5", "sfa", 128, 78)
    hybrid = ModelSpec.from_hf_dict(transformers.KimiLinearConfig().to_dict(), "kimi-linear")
    assert hybrid.hybrid and not hybrid.supports_kvpp
    with pytest.raises(ValueError, match="^hub/model: missing model_type"):
        ModelSpec.from_hf_dict({}, "hub/model")
