"""Tiny deterministic models (random weights) for tests and the demo: MLA (DeepSeek-V2 architecture) and GQA
(Llama architecture, one KV head).

Built fully offline: the config, the weights (drawn from a seeded generator, so the same parameters
always give byte-identical safetensors) and a word-level tokenizer, so that vLLM's OpenAI server
accepts text prompts and detokenizes. The MLA KV geometry matches the real models KVPP targets
(kv_lora_rank 512 + rope 64 = 576 per token, the only MLA head size vLLM's CPU backend accepts). The GQA model
has 4 query heads and one KV head of 32 channels, so every rank of a TP2 engine holds that head identically
(vLLM replicates KV heads when TP exceeds them), on vLLM's CPU attention kernel, which keeps the prefix cache
and chunked prefill on every x86 host.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpp_core.files import read_small_file

STAMP = "kvpp_tiny_model.json"
# Bump when the generated files change for the same parameters, so stale builds are redone.
GENERATOR_VERSION = 1

SPECIALS = ["<unk>", "<s>", "</s>"]
_PUNCT = list(".,;:!?'\"()-")
_WORDS = (
    "the of and to in is was for on that with as by at from it his an are were which be this has "
    "also or had its first one new after who their two they her she been other when time all during "
    "there into school more most years over only world city some would where later up such used many "
    "can state about national out known university united then made team may three well part under "
    "him while film people season between high both since no government not than against being series "
    "war he you we i me my your our us them what how why because if so but do does did go went come "
    "came see saw look find give take make know think say tell ask work call try need feel become "
    "leave put mean keep let begin seem help show hear play run move live believe bring happen write "
    "sit stand lose pay meet include continue set learn change lead understand watch follow stop "
    "create speak read spend grow open walk win teach offer remember consider appear buy serve die "
    "send build stay fall cut reach kill raise pass sell decide return explain hope develop carry "
    "break receive agree support hit produce eat cover catch draw choose cause point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind "
    "head house service friend father power hour game line end member law car name president night "
    "day week year way thing man woman child life hand place case group problem number country "
    "question company system program cache layer token block memory node rank model prefix pool "
    "prefill decode transfer engine request answer shard owner buffer stage group copy"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    """The parameters that determine a tiny model's files."""

    layers: int = 16
    seed: int = 0
    moe: bool = False
    mtp: int = 0
    generator_version: int = GENERATOR_VERSION
    shape: str = "tiny"
    arch: str = "mla"
    """"mla" (DeepSeek-V2/V3) or "gqa" (Llama, GQA_HEADS query heads sharing GQA_KV_HEADS KV head)."""


@dataclass(frozen=True)
class Shape:
    """Layer dimensions; the latent KV (kv_lora_rank 512 + rope 64) is the same in every shape."""

    hidden: int
    heads: int
    qk_nope: int
    v_head: int
    intermediate: int
    moe_intermediate: int


SHAPES = {
    # Small enough for 2 CPU cores, heads divisible by TP up to 4.
    "tiny": Shape(hidden=128, heads=4, qk_nope=32, v_head=32, intermediate=256, moe_intermediate=64),
    # DeepSeek-V2-Lite's attention as is (what a layer's compute and KV traffic look like in KVPP's
    # target models); its MLP reduced to one routed expert's width, which a CPU host can afford.
    "deepseek-v2-lite": Shape(hidden=2048, heads=16, qk_nope=128, v_head=128, intermediate=1408,
                              moe_intermediate=1408),
}
ARCHS = ("mla", "gqa")
KV_LORA = 512
ROPE = 64
GQA_HEADS = 4
GQA_KV_HEADS = 1
GQA_HEAD_DIM = 32
"""The GQA model's KV head: 32 channels, a head size vLLM's CPU attention kernel takes."""
MOE_EXPERTS = 4
MOE_TOPK = 2
MAX_POSITIONS = 8192


def vocabulary() -> list[str]:
    """Token strings in id order: specials, punctuation, digits, letters, words (unique, fixed order)."""
    seen: dict[str, None] = {}
    for tok in [*SPECIALS, *_PUNCT, *"0123456789", *"abcdefghijklmnopqrstuvwxyz", *_WORDS]:
        seen.setdefault(tok, None)
    return list(seen)


def sample_prompt(num_words: int, seed: int = 0) -> str:
    """A prompt of exactly `num_words` tokens under the tiny tokenizer (words drawn from its vocab)."""
    rng = random.Random(seed)
    words = [w for w in vocabulary() if w.isalpha() and len(w) > 1]
    return " ".join(rng.choice(words) for _ in range(num_words))


def _gqa_config(spec: TinyModelSpec):
    """A Llama config with the tiny shape's width and one KV head for its query heads."""
    from transformers import LlamaConfig

    shape = SHAPES[spec.shape]
    cfg = LlamaConfig(
        vocab_size=len(vocabulary()), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=GQA_HEADS, num_key_value_heads=GQA_KV_HEADS,
        head_dim=GQA_HEAD_DIM, max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=SPECIALS.index("<s>"), eos_token_id=SPECIALS.index("</s>"), tie_word_embeddings=False,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "float32"
    return cfg


def _hf_config(spec: TinyModelSpec):
    """The transformers config object; MTP needs the DeepSeek-V3 type (vLLM maps only V3 to its MTP)."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    if spec.arch == "gqa":
        return _gqa_config(spec)
    vocab = len(vocabulary())
    shape = SHAPES[spec.shape]
    common = dict(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        kv_lora_rank=KV_LORA,
        q_lora_rank=None,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=shape.qk_nope,
        v_head_dim=shape.v_head,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        n_routed_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOPK,
        moe_intermediate_size=shape.moe_intermediate,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        # Dense variant: every layer is dense (vLLM and HF both test layer_idx >= first_k_dense_replace).
        first_k_dense_replace=1 if spec.moe else spec.layers + spec.mtp,
        bos_token_id=SPECIALS.index("<s>"),
        eos_token_id=SPECIALS.index("</s>"),
        tie_word_embeddings=False,
    )
    if spec.mtp:
        cfg = DeepseekV3Config(**common, num_nextn_predict_layers=spec.mtp)
        cfg.architectures = ["DeepseekV3ForCausalLM"]
        cfg.topk_method = "noaux_tc"
        cfg.scoring_func = "sigmoid"
    else:
        cfg = DeepseekV2Config(**common, topk_method="greedy")
        cfg.architectures = ["DeepseekV2ForCausalLM"]
    cfg.dtype = "float32"
    return cfg


def _param_shapes(cfg, layers_total: int) -> dict[str, tuple[int, ...]]:
    """Parameter names/shapes of the HF model, built on the meta device (no memory, no RNG use)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = type(cfg).from_dict(cfg.to_dict())
    cfg.num_hidden_layers = layers_total
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return {name: tuple(p.shape) for name, p in model.state_dict().items()}


def _checkpoint_names(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], str, int]]:
    """Map one HF parameter to checkpoint tensors (name, shape, packed source, split index).

    transformers 5 packs experts into 3-D tensors; checkpoints (and vLLM's loader) use one tensor per
    expert and projection, so packed expert tensors are split here.
    """
    if name.endswith("mlp.experts.gate_up_proj"):
        base = name[: -len("gate_up_proj")]
        e, two_i, h = shape
        out = []
        for idx in range(e):
            out.append((f"{base}{idx}.gate_proj.weight", (two_i // 2, h), name, idx))
            out.append((f"{base}{idx}.up_proj.weight", (two_i // 2, h), name, idx))
        return out
    if name.endswith("mlp.experts.down_proj"):
        base = name[: -len("down_proj")]
        return [(f"{base}{idx}.down_proj.weight", shape[1:], name, idx) for idx in range(shape[0])]
    return [(name, shape, name, -1)]


def _init_tensor(name: str, shape: tuple[int, ...], gen):
    """Seeded values scaled so activations stay O(1) and greedy picks are not near-ties."""
    import torch

    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return torch.ones(shape, dtype=torch.float32)
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=torch.float32)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen, dtype=torch.float32)
    scale = (4.0 if "lm_head" in name or "shared_head.head" in name else 1.0) / shape[-1] ** 0.5
    return torch.randn(shape, generator=gen, dtype=torch.float32) * scale


def _mtp_tensors(spec: TinyModelSpec, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Extra per-MTP-layer tensors of DeepSeek-V3 checkpoints (decoder layer tensors come from shapes)."""
    vocab = len(vocabulary())
    hidden = SHAPES[spec.shape].hidden
    extra = {}
    for i in range(spec.mtp):
        p = f"model.layers.{spec.layers + i}."
        extra.update(
            {
                p + "enorm.weight": (hidden,),
                p + "hnorm.weight": (hidden,),
                p + "eh_proj.weight": (hidden, 2 * hidden),
                p + "shared_head.norm.weight": (hidden,),
                p + "shared_head.head.weight": (vocab, hidden),
                p + "embed_tokens.weight": (vocab, hidden),
            }
        )
    return extra


def _weights(spec: TinyModelSpec, cfg) -> dict:
    import torch

    shapes = _param_shapes(cfg, spec.layers + spec.mtp)
    shapes.update(_mtp_tensors(spec, shapes))
    gen = torch.Generator().manual_seed(spec.seed)
    tensors = {}
    for name in sorted(shapes):
        for ck_name, ck_shape, _src, _idx in _checkpoint_names(name, shapes[name]):
            tensors[ck_name] = _init_tensor(ck_name, ck_shape, gen).contiguous()
    return tensors


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # WordPiece's decoder joins tokens with spaces and glues punctuation; it also streams correctly.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        model_max_length=MAX_POSITIONS,
    )
    fast.save_pretrained(str(path))


def build_tiny_model(path: str | os.PathLike, layers: int = 16, seed: int = 0, moe: bool = False,
                     mtp: int = 0, shape: str = "tiny", arch: str = "mla") -> Path:
    """Write the model to `path`; skip when a build with the same parameters is there.

    `path` must be new, an empty directory, or an earlier build (its stamp lists the files it
    wrote). A rebuild removes exactly those files, so a directory holding anything else is refused
    before anything is deleted.
    """
    from safetensors.torch import save_file

    if layers < 1 or mtp < 0:
        raise ValueError(f"tiny model needs layers >= 1 and mtp >= 0, got layers={layers}, mtp={mtp}")
    if shape not in SHAPES:
        raise ValueError(f"unknown tiny model shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny model architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    if arch == "gqa" and (moe or mtp or shape != "tiny"):
        raise ValueError("the GQA tiny model comes in the tiny shape only, without MoE or MTP layers")
    path = Path(path)
    spec = TinyModelSpec(layers=layers, seed=seed, moe=moe, mtp=mtp, shape=shape, arch=arch)
    stamp = _earlier_build(path)
    if stamp is not None and {k: v for k, v in stamp.items() if k != "files"} == asdict(spec):
        return path
    if path.is_symlink():
        raise ValueError(f"{path} is a symbolic link; kvpp tiny-model does not replace it: give the target directory")
    removable = _removable_files(path, stamp)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and swap in, so a crash never leaves a half-written model behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        cfg = _hf_config(spec)
        cfg.save_pretrained(str(tmp))
        save_file(_weights(spec, cfg), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_tokenizer(tmp)
        files = sorted([*os.listdir(tmp), STAMP])
        (tmp / STAMP).write_text(json.dumps({**asdict(spec), "files": files}, indent=2, sort_keys=True) + "\n")
        if removable is not None:
            for name in removable:
                (path / name).unlink(missing_ok=True)
            path.rmdir()  # fails, deleting nothing more, if a file appeared since the check
        tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)  # the temporary build directory is ours alone
    return path


def write_tiny_config(path: str | os.PathLike, layers: int = 16, mtp: int = 0, shape: str = "tiny",
                      arch: str = "mla") -> Path:
    """The tiny model's config.json alone (no weights, no tokenizer): what the planner and seeded token draws read
    of it, e.g. to rebuild a bench's requests without building the model."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _hf_config(TinyModelSpec(layers=layers, mtp=mtp, shape=shape, arch=arch)).save_pretrained(str(path))
    return path


def _earlier_build(path: Path) -> dict | None:
    """The stamp of a build at `path`, or None when there is nothing there (no path, empty directory)."""
    if not path.exists() and not path.is_symlink():
        return None
    if not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory; give kvpp tiny-model a new or empty directory")
    if not any(path.iterdir()):
        return None
    try:
        stamp = json.loads(read_small_file(path / STAMP))
    except FileNotFoundError:
        raise ValueError(f"{path} is not empty and was not written by kvpp tiny-model (no {STAMP}); give it a "
                         "new or empty directory") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}/{STAMP} is unreadable ({exc}); give kvpp tiny-model a new or empty directory"
                         ) from None
    if not isinstance(stamp, dict):
        raise ValueError(f"{path}/{STAMP} is not a stamp kvpp tiny-model wrote; give it a new or empty directory")
    return stamp


def _removable_files(path: Path, stamp: dict | None) -> list[str] | None:
    """Files a rebuild removes from `path` (None: nothing there); refuses if anything else is there."""
    if not path.exists():
        return None
    if stamp is None:
        return []  # an empty directory
    files = stamp.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) and f and "/" not in f and f not in (".", "..")
                                              for f in files):
        raise ValueError(f"{path} was built by an older kvpp tiny-model that did not list its files; remove it "
                         "yourself or give another directory")
    foreign = sorted(set(os.listdir(path)) - set(files))
    foreign += sorted(f for f in files if (path / f).is_symlink() or (path / f).is_dir())
    if foreign:
        raise ValueError(f"{path} holds files kvpp tiny-model did not write ({', '.join(foreign[:5])}); move them "
                         "away or give another directory")
    return files
