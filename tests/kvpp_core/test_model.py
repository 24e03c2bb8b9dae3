"""Model descriptions: presets, Hugging Face config.json reading, clear errors on bad files."""

import json
from dataclasses import replace

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
    assert spec.token_bytes() == bundle
    assert spec.page_bytes(16) == 16 * bundle
    assert spec.supports_kvpp and not spec.hybrid


def test_overrides_and_dtypes():
    spec = PRESETS["glm-5.2"].with_overrides(mtp_layers=0, kv_dtype="int8")
    assert spec.mtp_layers == 0 and spec.dtype_bytes == 1 and spec.token_bytes() == 704
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
    assert spec.attention == "sfa" and spec.indexer_dim == 128 and spec.token_bytes() == 704 * 2


def test_glm_moe_dsa(tmp_path):
    path = write_config(tmp_path, model_type="glm_moe_dsa", num_hidden_layers=78, num_nextn_predict_layers=1,
                        kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, num_attention_heads=64,
                        torch_dtype="bfloat16", layer_types=["indexed_attention"] * 78)
    spec = ModelSpec.from_hf_config(path)
    assert (spec.num_layers, spec.mtp_layers, spec.attention, spec.hybrid) == (78, 1, "sfa", False)
    assert spec.token_bytes() == PRESETS["glm-5.2"].token_bytes()


def test_standard_attention_models_are_gqa_with_their_kv_heads(tmp_path):
    path = write_config(tmp_path, model_type="llama", num_hidden_layers=32, num_attention_heads=32, hidden_size=4096,
                        torch_dtype="bfloat16")
    spec = ModelSpec.from_hf_config(path)  # MHA: as many KV heads as query heads, head_dim from the hidden size
    assert (spec.attention, spec.num_kv_heads, spec.head_dim, spec.supports_kvpp) == ("gqa", 32, 128, True)
    assert spec.token_bytes(8) == 4 * 2 * 128 * 2 and spec.token_bytes(64) == 2 * 128 * 2


def test_mla_type_without_latent_is_standard_attention(tmp_path):
    path = write_config(tmp_path, model_type="deepseek_v2", num_hidden_layers=4, kv_lora_rank=None,
                        num_attention_heads=4, num_key_value_heads=4, head_dim=64)
    assert ModelSpec.from_hf_config(path).attention == "gqa"


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


@pytest.mark.parametrize("name, layers, heads, kv_heads, head_dim, mtp", [
    ("qwen3-235b-a22b", 94, 64, 4, 128, 0),
    ("llama-3.1-405b", 126, 128, 8, 128, 0),
    ("glm-4.5", 92, 96, 8, 128, 1),
    ("glm-4.6", 92, 96, 8, 128, 1),
    ("glm-4.7", 92, 96, 8, 128, 1),
    ("minimax-m2", 62, 48, 8, 128, 0),
    ("kvpp-tiny-gqa", 8, 4, 1, 32, 0),
])
def test_gqa_presets(name, layers, heads, kv_heads, head_dim, mtp):
    spec = PRESETS[name]
    assert (spec.attention, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.mtp_layers) == (
        "gqa", layers, heads, kv_heads, head_dim, mtp)
    assert spec.supports_kvpp and spec.replicated_kv_heads == kv_heads
    # Past TP = n_kv every rank holds one head (K and V); below it, n_kv / TP heads.
    assert spec.token_bytes(2 * kv_heads) == 2 * head_dim * spec.dtype_bytes
    assert spec.page_bytes(128, kv_heads // 2 or 1) == 128 * 2 * head_dim * spec.dtype_bytes * (2 if kv_heads > 1 else 1)


# The fields of each model's public Hugging Face config.json (repo, file) that the reader takes, as published.
_LAYERS_OF_4 = ["linear_attention"] * 3 + ["full_attention"]
PUBLIC_CONFIGS = {
    "qwen3-235b-a22b": ("Qwen/Qwen3-235B-A22B config.json", dict(
        model_type="qwen3_moe", num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        hidden_size=4096, sliding_window=None, use_sliding_window=False, max_window_layers=94, torch_dtype="bfloat16")),
    "llama-3.1-405b": ("meta-llama/Llama-3.1-405B config.json", dict(
        model_type="llama", num_hidden_layers=126, num_attention_heads=128, num_key_value_heads=8, head_dim=128,
        hidden_size=16384, torch_dtype="bfloat16")),
    **{f"glm-{v}": (f"zai-org/GLM-{v} config.json", dict(
        model_type="glm4_moe", num_hidden_layers=92, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
        hidden_size=5120, num_nextn_predict_layers=1, torch_dtype="bfloat16")) for v in ("4.5", "4.6", "4.7")},
    "minimax-m2": ("MiniMaxAI/MiniMax-M2 config.json", dict(
        model_type="minimax_m2", num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
        hidden_size=3072, attn_type_list=[1] * 62, sliding_window=None, num_mtp_modules=3)),
    "qwen3-next-80b-a3b": ("Qwen/Qwen3-Next-80B-A3B-Instruct config.json", dict(
        model_type="qwen3_next", num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        hidden_size=2048, full_attention_interval=4, torch_dtype="bfloat16")),
    "qwen3.5-397b-a17b": ("Qwen/Qwen3.5-397B-A17B config.json", dict(model_type="qwen3_5_moe", text_config=dict(
        model_type="qwen3_5_moe_text", num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
        hidden_size=4096, full_attention_interval=4, layer_types=_LAYERS_OF_4 * 15, mtp_num_hidden_layers=1,
        dtype="bfloat16"))),
}


@pytest.mark.parametrize("name", sorted(PUBLIC_CONFIGS))
def test_gqa_presets_are_what_the_reader_makes_of_the_public_configs(name):
    source, config = PUBLIC_CONFIGS[name]
    read, preset = ModelSpec.from_hf_dict(config, source), PRESETS[name]
    fields = ("attention", "num_layers", "num_heads", "num_kv_heads", "head_dim", "kv_dtype", "hybrid")
    assert [getattr(read, f) for f in fields] == [getattr(preset, f) for f in fields]
    # Qwen3-Next's config counts no MTP layer (its checkpoint ships one, which vLLM's drafter defaults to).
    assert read.mtp_layers == (0 if name == "qwen3-next-80b-a3b" else preset.mtp_layers)
    assert read.mixed.split(" (")[0] == preset.mixed.split(" (")[0]


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "qwen3.5-397b-a17b"])
def test_hybrid_gqa_presets_say_what_they_mix(name):
    spec = PRESETS[name]
    assert spec.hybrid and not spec.supports_kvpp and "linear_attention" in spec.mixed


@pytest.mark.parametrize("extra, mixed", [
    (dict(model_type="qwen3_next", full_attention_interval=4), "36 of its 48 layers are linear_attention"),
    (dict(model_type="gemma3_text", layer_types=["sliding_attention"] * 40 + ["full_attention"] * 8),
     "40 of its 48 layers are sliding_attention"),
    (dict(model_type="mistral", sliding_window=4096), "every layer attends over a sliding window of 4096 tokens"),
    (dict(model_type="nemotron_h", hybrid_override_pattern="M*M-" * 12), "24 of its 48 layers are mamba"),
])
def test_layers_kvpp_does_not_handle_are_named(tmp_path, extra, mixed):
    path = write_config(tmp_path, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                        **extra)
    spec = ModelSpec.from_hf_config(path)
    assert spec.hybrid and not spec.supports_kvpp and spec.mixed == mixed


def test_a_window_the_config_turns_off_is_no_window(tmp_path):
    path = write_config(tmp_path, model_type="qwen3", num_hidden_layers=36, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, sliding_window=32768, use_sliding_window=False)
    assert not ModelSpec.from_hf_config(path).hybrid


def test_tp_that_splits_kv_heads_unevenly_is_refused():
    with pytest.raises(ValueError, match="TP 3 and the 4 KV heads of qwen3-235b-a22b do not divide each other"):
        PRESETS["qwen3-235b-a22b"].token_bytes(3)


def test_generated_tiny_gqa_model_matches_its_preset(tmp_path):
    tiny_model = pytest.importorskip("deploy.harness.tiny_model")
    path = tiny_model.build_tiny_model(tmp_path / "tiny-gqa", layers=8, arch="gqa")
    assert ModelSpec.from_hf_config(path) == replace(PRESETS["kvpp-tiny-gqa"], name=str(path))
