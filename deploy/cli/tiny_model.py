"""`kvpp tiny-model PATH`: build a tiny deterministic MLA model (deploy.harness.tiny_model)."""

from __future__ import annotations

import argparse

from deploy.cli import args as cli_args
from deploy.harness.tiny_model import ARCHS, SHAPES, build_tiny_model

MAX_LAYERS = 256
MAX_MTP = 8


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "tiny-model", help="build a tiny deterministic DeepSeek-V2 (MLA) or Llama (GQA) model with a local tokenizer",
        description="Write an offline DeepseekV2ForCausalLM (kv_lora_rank 512, rope 64) or, with --arch gqa, a "
        "LlamaForCausalLM (4 query heads, one KV head of 32) with seeded random weights and a word-level tokenizer to "
        "PATH. Re-running with the same options is a no-op.",
    )
    p.add_argument("path", type=cli_args.path_text, help="output directory (new, empty, or an earlier build)")
    p.add_argument("--layers", type=cli_args.bounded_int(1, MAX_LAYERS), default=16,
                   help="target decoder layers (default 16)")
    p.add_argument("--seed", type=cli_args.bounded_int(0, (1 << 63) - 1), default=0, help="weight seed (default 0)")
    p.add_argument("--moe", action="store_true", help="MoE layers after the first (4 experts, top-2)")
    p.add_argument("--mtp", type=cli_args.bounded_int(0, MAX_MTP), default=0,
                   help="MTP layers (switches to the DeepSeek-V3 type, which vLLM's MTP drafter needs)")
    p.add_argument("--shape", choices=list(SHAPES), default="tiny",
                   help="layer dimensions: tiny (hidden 128, 4 heads; default) or deepseek-v2-lite (hidden "
                   "2048, 16 heads, nope/v 128: DeepSeek-V2-Lite's attention, MLP reduced to 1408)")
    p.add_argument("--arch", choices=list(ARCHS), default="mla",
                   help="mla (DeepSeek-V2/V3; default) or gqa (Llama, one KV head, which TP replicates on every rank; "
                   "tiny shape, no MoE or MTP)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = build_tiny_model(args.path, layers=args.layers, seed=args.seed, moe=args.moe, mtp=args.mtp,
                           shape=args.shape, arch=args.arch)
    print(out)
    return 0
