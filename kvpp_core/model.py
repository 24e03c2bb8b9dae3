"""What KVPP needs to know about a model: layer counts and the per-token size of one layer's KV bundle.

KVPP applies to MLA/SFA models because their per-layer cache (compressed latent + RoPE key, plus the
SFA/DSA indexer key) is identical on every TP rank. Models come from named presets or from a Hugging
Face `config.json`; anything that is not MLA/SFA is still described (attention "mha") so that
validation can refuse it with a reason instead of the reader failing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpp_core.files import read_small_file

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
                  "float": "float32", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}

KVPP_ATTENTION = ("mla", "sfa")
# Ceiling for a config's counts and sizes: far above any real model, low enough that a corrupt
# config cannot make a plan build per-layer tables for 10**18 layers.
_MAX_CONFIG_INT = 1 << 20

# HF model types whose caches are MLA latents; the SFA/DSA ones add an indexer key cache.
_MLA_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
_SFA_TYPES = ("deepseek_v32", "glm_moe_dsa")
# MLA types that mix in non-MLA layers (linear attention): never a KVPP target.
_HYBRID_TYPES = ("kimi_linear", "bailing_hybrid")
_PLAIN_LAYER_TYPES = {"full_attention", "attention", "indexed_attention"}


def normalize_dtype(name: str) -> str:
    """Canonical KV dtype name (`bf16` -> `bfloat16`); ValueError names the accepted values."""
    key = str(name).strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {name!r}; use one of {', '.join(DTYPE_BYTES)}")
    return key


@dataclass(frozen=True)
class ModelSpec:
    """Per-layer KV shape of a model, in the units the capacity plan needs."""

    name: str
    num_layers: int
    """Target decoder layers (MTP/draft layers excluded)."""
    mtp_layers: int
    """MTP (next-n) layers the model ships; their caches exist only when MTP decoding is enabled."""
    kv_lora_rank: int
    rope_dim: int
    indexer_dim: int = 0
    """Indexer key width per token: 0 for MLA, >0 for SFA/DSA (stored in the KV dtype)."""
    kv_dtype: str = "bfloat16"
    attention: str = "mla"
    """"mla", "sfa", or what else the model uses ("mha"), which KVPP refuses."""
    hybrid: bool = False
    num_heads: int = 0
    """Attention heads (TP must divide them); 0 when unknown."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_dtype", normalize_dtype(self.kv_dtype))
        for field_name in ("num_layers", "mtp_layers", "kv_lora_rank", "rope_dim", "indexer_dim", "num_heads"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"model {self.name}: {field_name} must be an integer >= 0, got {value!r}")
        if self.num_layers < 1:
            raise ValueError(f"model {self.name}: needs at least one decoder layer, got {self.num_layers}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def supports_kvpp(self) -> bool:
        return self.attention in KVPP_ATTENTION and not self.hybrid

    @property
    def bundle_bytes_per_token(self) -> int:
        """One layer's cache for one token: latent + RoPE key, plus the indexer key for SFA."""
        return (self.kv_lora_rank + self.rope_dim + self.indexer_dim) * self.dtype_bytes

    def page_bytes(self, block_size: int) -> int:
        """One layer's cache for one block of `block_size` tokens."""
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        return self.bundle_bytes_per_token * block_size

    def with_overrides(self, *, mtp_layers: int | None = None, kv_dtype: str | None = None) -> ModelSpec:
        changes: dict[str, Any] = {}
        if mtp_layers is not None:
            changes["mtp_layers"] = mtp_layers
        if kv_dtype is not None:
            changes["kv_dtype"] = kv_dtype
        return replace(self, **changes)

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelSpec:
        """Read a Hugging Face `config.json` (or a model directory holding one)."""
        return _spec_from_hf(Path(path))

    @classmethod
    def from_hf_dict(cls, config: dict[str, Any], name: str) -> ModelSpec:
        """Same, from an already loaded config (e.g. vLLM's `hf_config.to_dict()` for a hub model)."""
        return _spec_from_dict(config, name, name=name)


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("glm-5.2", 78, 1, 512, 64, indexer_dim=128, attention="sfa", num_heads=64),
        ModelSpec("deepseek-v3", 61, 1, 512, 64, attention="mla", num_heads=128),
        ModelSpec("deepseek-v3.2", 61, 1, 512, 64, indexer_dim=128, attention="sfa", num_heads=128),
        ModelSpec("deepseek-v2-lite", 27, 0, 512, 64, attention="mla", num_heads=16),
        ModelSpec("kimi-k2", 61, 0, 512, 64, attention="mla", num_heads=64),
        # The project's offline test model (deploy/harness/tiny_model.py): fp32 so outputs compare exactly.
        ModelSpec("kvpp-tiny", 16, 0, 512, 64, kv_dtype="float32", attention="mla", num_heads=4),
    )
}


def resolve_model(name_or_path: str | Path) -> ModelSpec:
    """A preset by name, else a Hugging Face config path."""
    key = str(name_or_path).strip()
    if key.lower() in PRESETS:
        return PRESETS[key.lower()]
    if Path(key).exists():
        return ModelSpec.from_hf_config(key)
    raise ValueError(
        f"unknown model {key!r}: use a preset ({', '.join(PRESETS)}) or a path to a Hugging Face "
        "config.json or model directory"
    )


def _spec_from_hf(path: Path) -> ModelSpec:
    config_file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(read_small_file(config_file))
    except FileNotFoundError:
        raise ValueError(f"{config_file}: no such file; point at a model directory or its config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{config_file}: not a readable JSON config ({_one_line(exc)})") from None
    return _spec_from_dict(raw, str(config_file), name=str(path))


def _spec_from_dict(raw: Any, source: str, name: str) -> ModelSpec:
    """`source` prefixes error messages (the file, or the model name for an in-memory config)."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    # Multimodal wrappers (e.g. Kimi-K2.5) keep the language model under text_config.
    cfg = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    model_type = cfg.get("model_type") or raw.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f"{source}: missing model_type; is this a Hugging Face model config?")

    def get_int(key: str, default: int | None = None) -> int:
        value = cfg.get(key, default)
        if value is None and default is not None:
            value = default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{source}: {key} must be a non-negative integer, got {value!r}")
        if value > _MAX_CONFIG_INT:
            raise ValueError(f"{source}: {key} is {value}, more than any model has ({_MAX_CONFIG_INT}); is the "
                             "config corrupt?")
        return value

    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    try:
        kv_dtype = normalize_dtype(dtype)
    except ValueError:
        raise ValueError(f"{source}: unsupported torch_dtype {dtype!r}") from None
    num_layers = get_int("num_hidden_layers")
    mtp = get_int("num_nextn_predict_layers", 0)
    heads = get_int("num_attention_heads", 0)
    has_latent = cfg.get("kv_lora_rank") is not None
    layer_types = cfg.get("layer_types") or []
    hybrid = model_type in _HYBRID_TYPES or any(t not in _PLAIN_LAYER_TYPES for t in layer_types)

    if model_type in _MLA_TYPES + _SFA_TYPES + _HYBRID_TYPES and has_latent:
        sfa = model_type in _SFA_TYPES
        return ModelSpec(
            name=name,
            num_layers=num_layers,
            mtp_layers=mtp,
            kv_lora_rank=get_int("kv_lora_rank"),
            rope_dim=get_int("qk_rope_head_dim"),
            indexer_dim=get_int("index_head_dim") if sfa else 0,
            kv_dtype=kv_dtype,
            attention="sfa" if sfa else "mla",
            hybrid=hybrid,
            num_heads=heads,
        )
    # Not a latent-cache model: described only so that validation can say why KVPP does not apply.
    return ModelSpec(name=name, num_layers=num_layers, mtp_layers=mtp, kv_lora_rank=0, rope_dim=0,
                     kv_dtype=kv_dtype, attention="mha", hybrid=hybrid, num_heads=heads)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
