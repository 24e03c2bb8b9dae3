"""What KVPP needs to know about a model: layer counts and the per-token size of one layer's KV bundle.

KVPP removes the copies of a KV cache that several TP ranks hold identically. Two kinds of model have them:
- MLA/SFA models: the per-layer cache (compressed latent + RoPE key, plus the SFA/DSA indexer key) is the same
  on every TP rank;
- GQA (and MHA) models whose KV heads tensor parallelism replicates: with TP > n_kv, vLLM gives each KV head to
  TP / n_kv ranks (`QKVParallelLinear`: rank r holds head r // (TP / n_kv)), and those ranks hold it identically.
Models come from named presets or from a Hugging Face `config.json`; a model whose layers are not all of one
kind KVPP handles (sliding-window, linear-attention or Mamba layers beside full attention) is still described,
with what it mixes, so that validation can refuse it with the reason instead of the reader failing.
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

KVPP_ATTENTION = ("mla", "sfa", "gqa")
LATENT_ATTENTION = ("mla", "sfa")
"""Caches identical on every TP rank of a stage."""
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
    """"mla", "sfa" or "gqa" (standard attention with its KV heads, MHA included: vLLM's `Attention`)."""
    hybrid: bool = False
    """Its layers mix kinds KVPP handles with others (`mixed` says which), or slide a window."""
    num_heads: int = 0
    """Attention heads (TP must divide them); 0 when unknown."""
    num_kv_heads: int = 0
    """GQA: KV heads (each one cache per layer, replicated on TP / n_kv ranks when TP > n_kv); 0 for MLA/SFA."""
    head_dim: int = 0
    """GQA: the width of one K (and one V) head."""
    mixed: str = ""
    """What makes the model hybrid, in words (e.g. "36 of its 48 layers are linear_attention"); "" otherwise."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_dtype", normalize_dtype(self.kv_dtype))
        for field_name in ("num_layers", "mtp_layers", "kv_lora_rank", "rope_dim", "indexer_dim", "num_heads",
                           "num_kv_heads", "head_dim"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"model {self.name}: {field_name} must be an integer >= 0, got {value!r}")
        if self.num_layers < 1:
            raise ValueError(f"model {self.name}: needs at least one decoder layer, got {self.num_layers}")
        if self.attention == "gqa" and (self.num_kv_heads < 1 or self.head_dim < 1):
            raise ValueError(f"model {self.name}: a GQA model needs num_kv_heads and head_dim >= 1, got "
                             f"{self.num_kv_heads} and {self.head_dim}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype]

    @property
    def supports_kvpp(self) -> bool:
        return self.attention in KVPP_ATTENTION and not self.hybrid

    @property
    def replicated_kv_heads(self) -> int | None:
        """The KV heads a GQA model's TP ranks share out (`Topology.kv_heads`); None: one cache the same on every
        rank (MLA/SFA)."""
        return self.num_kv_heads if self.attention == "gqa" else None

    def kv_heads_per_rank(self, tp: int) -> int:
        """GQA: the KV heads one TP rank holds (1 when TP >= n_kv, each then replicated on TP / n_kv ranks)."""
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        heads = self.num_kv_heads
        if tp > heads and tp % heads or tp < heads and heads % tp:
            raise ValueError(f"TP {tp} and the {heads} KV heads of {self.name} do not divide each other; vLLM "
                             f"needs one to divide the other: choose TP {_divisor_choices(heads)}")
        return max(1, heads // tp)

    def token_bytes(self, tp: int = 1) -> int:
        """One layer's cache for one token on one rank of a TP `tp` engine: latent + RoPE key (plus the indexer key
        for SFA), the same at any TP; or a GQA rank's K and V heads."""
        if self.attention == "gqa":
            return 2 * self.head_dim * self.kv_heads_per_rank(tp) * self.dtype_bytes
        return (self.kv_lora_rank + self.rope_dim + self.indexer_dim) * self.dtype_bytes

    def page_bytes(self, block_size: int, tp: int = 1) -> int:
        """One layer's cache for one block of `block_size` tokens on one rank."""
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        return self.token_bytes(tp) * block_size

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


def _gqa(name: str, layers: int, *, heads: int, kv_heads: int, head_dim: int, mtp: int = 0,
         kv_dtype: str = "bfloat16", mixed: str = "") -> ModelSpec:
    return ModelSpec(name, layers, mtp, 0, 0, kv_dtype=kv_dtype, attention="gqa", hybrid=bool(mixed), num_heads=heads,
                     num_kv_heads=kv_heads, head_dim=head_dim, mixed=mixed)


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
        # GQA models whose KV heads TP replicates at their usual TP sizes. Values from each model's public Hugging Face
        # config.json (repo, file), as the reader below takes them (tests/kvpp_core/test_model.py reads the same fields):
        # Qwen/Qwen3-235B-A22B config.json: qwen3_moe, 94 layers, 64 heads, 4 KV heads, head_dim 128, bfloat16,
        # use_sliding_window false, no MTP layers.
        _gqa("qwen3-235b-a22b", 94, heads=64, kv_heads=4, head_dim=128),
        # meta-llama/Llama-3.1-405B config.json: llama, 126 layers, 128 heads, 8 KV heads, head_dim 128, bfloat16 (the
        # first upload of July 2024 said 16 KV heads, each stored twice; Meta's fix of August 2024 says 8).
        _gqa("llama-3.1-405b", 126, heads=128, kv_heads=8, head_dim=128),
        # zai-org/GLM-4.5, zai-org/GLM-4.6 and zai-org/GLM-4.7 config.json: glm4_moe, 92 layers, 96 heads, 8 KV heads,
        # head_dim 128, bfloat16, num_nextn_predict_layers 1 (the three share this attention; the context differs).
        _gqa("glm-4.5", 92, heads=96, kv_heads=8, head_dim=128, mtp=1),
        _gqa("glm-4.6", 92, heads=96, kv_heads=8, head_dim=128, mtp=1),
        _gqa("glm-4.7", 92, heads=96, kv_heads=8, head_dim=128, mtp=1),
        # MiniMaxAI/MiniMax-M2 config.json: minimax_m2, 62 layers (attn_type_list all 1: full attention), 48 heads,
        # 8 KV heads, head_dim 128, sliding_window null; its 3 MTP modules (num_mtp_modules) are no next-n layers
        # vLLM serves, so none is planned.
        _gqa("minimax-m2", 62, heads=48, kv_heads=8, head_dim=128),
        # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: qwen3_next, 48 layers, full_attention_interval 4 (12 full
        # attention, 36 Gated DeltaNet), 16 heads, 2 KV heads, head_dim 256, bfloat16; its checkpoint ships one MTP layer,
        # which the config does not count (vLLM's Qwen3NextMTP defaults to 1). KVPP refuses the hybrids; they are
        # described so that plan and check say why.
        _gqa("qwen3-next-80b-a3b", 48, heads=16, kv_heads=2, head_dim=256, mtp=1,
             mixed="36 of its 48 layers are linear_attention (Gated DeltaNet)"),
        # Qwen/Qwen3.5-397B-A17B config.json, text_config: qwen3_5_moe_text, 60 layers, full_attention_interval 4
        # (15 full attention, 45 Gated DeltaNet), 32 heads, 2 KV heads, head_dim 256, bfloat16, mtp_num_hidden_layers 1.
        _gqa("qwen3.5-397b-a17b", 60, heads=32, kv_heads=2, head_dim=256, mtp=1,
             mixed="45 of its 60 layers are linear_attention (Gated DeltaNet)"),
        # The project's offline GQA test model (deploy/harness/tiny_model.py, arch "gqa"): one KV head, fp32.
        _gqa("kvpp-tiny-gqa", 8, heads=4, kv_heads=1, head_dim=32, kv_dtype="float32"),
    )
}


def _divisor_choices(heads: int) -> str:
    small = [d for d in range(1, heads + 1) if heads % d == 0]
    return ", ".join(str(d) for d in small[:6]) + f" or a multiple of {heads}"


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
    # MTP layers: DeepSeek's, GLM's and Qwen3-Next's key, else Qwen3.5's.
    mtp = get_int("num_nextn_predict_layers", 0) or get_int("mtp_num_hidden_layers", 0)
    heads = get_int("num_attention_heads", 0)
    has_latent = cfg.get("kv_lora_rank") is not None
    mixed = _mixed_layers(cfg, model_type, num_layers)

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
            hybrid=bool(mixed),
            num_heads=heads,
            mixed=mixed,
        )
    # Standard attention (vLLM's `Attention`): its KV heads, each one cache per layer.
    if num_layers < 1:
        raise ValueError(f"model {name}: needs at least one decoder layer, got {num_layers}")
    if heads < 1:
        raise ValueError(f"{source}: num_attention_heads must be a positive integer for a standard-attention model, "
                         f"got {cfg.get('num_attention_heads')!r}")
    kv_heads = get_int("num_key_value_heads", heads) or heads
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        hidden = get_int("hidden_size")
        if hidden % heads:
            raise ValueError(f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}, and "
                             "head_dim is not given")
        head_dim = hidden // heads
    else:
        head_dim = get_int("head_dim")
    return ModelSpec(name=name, num_layers=num_layers, mtp_layers=mtp, kv_lora_rank=0, rope_dim=0, kv_dtype=kv_dtype,
                     attention="gqa", hybrid=bool(mixed), num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, mixed=mixed)


def _mixed_layers(cfg: dict[str, Any], model_type: str, num_layers: int) -> str:
    """What keeps some layers out of one full-attention KV cache group, in words ("" when nothing does): layers of
    another kind (linear attention, Mamba, sliding windows), by whichever key the config uses."""
    kinds: list[str] = []
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        kinds = [str(t) for t in layer_types[:num_layers]]
    elif isinstance(cfg.get("layers_block_type"), list):
        kinds = [str(t) for t in cfg["layers_block_type"][:num_layers]]
    elif isinstance(cfg.get("hybrid_override_pattern"), str):  # Nemotron-H: M (Mamba), * (attention), - (MLP)
        kinds = ["attention" if c == "*" else "mamba" if c == "M" else "mlp" for c in cfg["hybrid_override_pattern"]]
    elif isinstance(cfg.get("full_attention_interval"), int) and cfg["full_attention_interval"] > 1:  # Qwen3-Next
        every = cfg["full_attention_interval"]
        kinds = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(num_layers)]
    other = [k for k in kinds if k not in _PLAIN_LAYER_TYPES and k != "mlp"]
    if other:
        counts = {k: other.count(k) for k in dict.fromkeys(other)}
        return "; ".join(f"{n} of its {len(kinds)} layers are {kind}" for kind, n in counts.items())
    if model_type in _HYBRID_TYPES:
        return f"{model_type} mixes linear-attention layers into its stack"
    window = cfg.get("sliding_window")
    if isinstance(window, int) and window > 0 and cfg.get("use_sliding_window", True) is not False:
        return f"every layer attends over a sliding window of {window} tokens"
    return ""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
