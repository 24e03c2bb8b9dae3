"""`kvpp plan`: what KVPP buys on a model and topology, before touching a cluster."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from kvpp_core.capacity import DEFAULT_BLOCK_SIZE, CapacityPlan, plan_capacity
from kvpp_core.config import DEFAULT_STAGING, ENABLE_KEY, STAGING_KEY, ZERO_COPY, parse_additional_config
from kvpp_core.cpu_backends import BACKENDS as CPU_KERNELS
from kvpp_core.model import DTYPE_BYTES, PRESETS, ModelSpec, resolve_model
from kvpp_core.modes import NAMED, Mode, resolve as resolve_mode, shm_needed, shm_note, zero_copy_obstacles
from kvpp_core.platforms import PLATFORMS, VLLM_CPU, Platform
from kvpp_core.topology import RUNNERS, Topology
from kvpp_core.setup import KvppSetup
from kvpp_core.validation import raise_for_errors, validate
from connectors.launch import connector_rules

from deploy.bounds import MAX_LAYERS, MAX_PARALLEL
from deploy.cli import args as cli_args
from deploy.deployment.check import kernel_kind_problem
from deploy.deployment.resolved import cpu_kernel

GIB = 1 << 30
MAX_MEMORY_GIB = float(1 << 20)  # 1 PiB per rank
MAX_BLOCK_SIZE = 1 << 20
MAX_MTP = 64
# The table has one row per rank of the cache-replica groups of all stages; the per-rank layout is
# superlinear in the group size, so beyond this a plan takes minutes instead of seconds.
MAX_GROUP, MAX_RANKS = 1024, 16384
PLOT_TP_SIZES = (1, 2, 4, 8, 16, 32, 64)
COMPARED_STAGING = (DEFAULT_STAGING, 1, ZERO_COPY)
"""The KVPP modes every plan sets side by side with KVPP off: staging 2 and 1, zero-copy."""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="KV-cache capacity with and without KVPP for a model and topology",
        description="Per PP stage and kvpp rank: owned layers, bytes per block, blocks and tokens with "
        "KVPP off (every rank of a cache-replica group holds every layer) and on (one owner per layer plus staging "
        "buffers); then every mode side by side (off, staging 2 and 1, zero-copy). The group is the TP ranks of a "
        "stage for an MLA/SFA model, the TP ranks holding one KV head for a GQA model.",
    )
    add_model_args(p)
    p.add_argument("--memory-gib", type=cli_args.value_list(cli_args.bounded_float(0.0, MAX_MEMORY_GIB),
                                                            "a number or comma-separated numbers like 60,64",
                                                            MAX_PARALLEL),
                   default=(32.0,), metavar="GIB[,GIB...]",
                   help="free KV memory per rank in GiB: one value, or one per PP stage (default 32)")
    p.add_argument("--staging", type=cli_args.bounded_int(0, 1 << 10), default=None, metavar="N",
                   help=f"staging buffers per rank, as the launch names {STAGING_KEY} (2 overlaps the next broadcast "
                   "with compute; 0 = zero-copy, foreign layers read in place where a group's ranks share a CPU "
                   "host); default: not named, so the mode an engine then runs where it runs (zero-copy on "
                   "vllm-cpu where it can, else 2)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", type=cli_args.image_path, default=None, metavar="FILE.png",
                   help=f"also draw the capacity ratio against TP size ({', '.join(cli_args.IMAGE_FORMATS)})")
    p.set_defaults(func=run)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, its KV dtype, the topology and the kernel's block size: what a capacity plan is for (`kvpp plan`,
    `kvpp simulate`)."""
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(PRESETS)}) or a Hugging Face config.json / model directory")
    p.add_argument("--tp", type=cli_args.parallel_size, required=True, help="tensor-parallel size")
    p.add_argument("--pp", type=cli_args.parallel_size, default=None,
                   help="pipeline-parallel size (default: from --pp-layers, else 1)")
    p.add_argument("--pp-layers", type=cli_args.value_list(cli_args.bounded_int(1, MAX_LAYERS),
                                                           "comma-separated integers like 38,40",
                                                           MAX_PARALLEL),
                   default=None, metavar="N,N,...",
                   help="explicit target layers per PP stage, e.g. 38,40 (default: vLLM's even split)")
    p.add_argument("--pcp", type=cli_args.parallel_size, default=1,
                   help="prefill-context-parallel size (joins the group on runner v2)")
    p.add_argument("--runner", choices=RUNNERS, default="v1", help="vLLM model runner (v2 = VLLM_USE_V2_MODEL_RUNNER=1)")
    p.add_argument("--mtp", type=cli_args.bounded_int(0, MAX_MTP), default=0, metavar="N",
                   help="MTP layers served (their caches are replicated on the last stage); default 0, as in "
                   "the anchor measurements; MTP caches exist only when MTP decoding is enabled")
    p.add_argument("--kv-dtype", choices=list(DTYPE_BYTES), default=None, help="KV cache dtype (default: the model's)")
    p.add_argument("--block-size", type=cli_args.bounded_int(1, MAX_BLOCK_SIZE), default=None,
                   help=f"tokens per block (default: the kernel's with --attention-backend, else {DEFAULT_BLOCK_SIZE} as "
                   "on Ascend)")
    p.add_argument("--attention-backend", type=str.upper, choices=list(CPU_KERNELS), default=None,
                   help="the vllm-cpu kernel the engines will run: for MLA CPU_MLA (any dtype, block size 16) or "
                   "AMX_MLA (bf16, a block size that is a multiple of 32, default 128); for GQA CPU_ATTN (fp32/bf16/fp16, "
                   "a multiple of 32, default 128), which vllm-cpu runs GQA models on anyway; its rules apply to the plan")
    p.add_argument("--platform", choices=list(PLATFORMS), default=None,
                   help="where the engines run (as a deployment spec names it): vllm-cpu keeps the KV cache in host "
                   "memory, where a launch that names no mode runs zero-copy; implied by --attention-backend; "
                   "default: not known, so the plan is the staging mode's")


@dataclass(frozen=True)
class PlanInput:
    """The model, topology, block size and platform the arguments of `add_model_args` name."""

    model: ModelSpec
    shipped_mtp: int
    topology: Topology
    block_size: int
    kernel: str | None
    platform: Platform | None
    """Where the engines run, when the arguments say (--platform, or implied by --attention-backend)."""


def plan_input(args: argparse.Namespace) -> PlanInput:
    model = resolve_model(args.model)
    shipped_mtp = model.mtp_layers
    model = model.with_overrides(mtp_layers=args.mtp, kv_dtype=args.kv_dtype)
    split = args.pp_layers
    pp = args.pp if args.pp is not None else (len(split) if split else 1)
    topo = Topology(tp=args.tp, pp=pp, pp_layers=split, pcp=args.pcp, runner=args.runner,
                    kv_heads=model.replicated_kv_heads)
    if topo.group_size > MAX_GROUP or topo.group_size * topo.pp > MAX_RANKS:
        raise ValueError(f"{topo.describe()} gives {topo.group_size * topo.pp} ranks to tabulate; kvpp plan handles "
                         f"cache-replica groups of up to {MAX_GROUP} ranks and {MAX_RANKS} ranks in all")
    named = args.attention_backend
    if named and args.platform not in (None, VLLM_CPU.name):
        raise ValueError(f"--attention-backend {named} is a vllm-cpu kernel, but --platform is {args.platform}; "
                         f"drop one, or pass --platform {VLLM_CPU.name}")
    problem = kernel_kind_problem(named, model)
    if problem:
        raise ValueError(f"--attention-backend: {problem}")
    platform = PLATFORMS[VLLM_CPU.name if named else args.platform] if named or args.platform else None
    kernel = cpu_kernel(platform, named, model) if platform else None
    block_size = kernel.block_size(args.block_size) if kernel else args.block_size or DEFAULT_BLOCK_SIZE
    return PlanInput(model, shipped_mtp, topo, block_size, kernel and kernel.name, platform)


def _setup(given: PlanInput, staging: int | None) -> KvppSetup:
    """A launch naming `staging` (None: naming none) where `given` says, in the planner's terms."""
    kvpp = parse_additional_config({ENABLE_KEY: True, **({} if staging is None else {STAGING_KEY: staging})})
    platform = given.platform
    return KvppSetup(given.model, given.topology, enforce_eager=True, kvpp=kvpp,
                     device=platform.device if platform else None, attention_backend=given.kernel,
                     dtype=given.model.kv_dtype, block_size=given.block_size)


def checked(given: PlanInput, staging: int | None) -> tuple[Mode, list]:
    """The mode a launch naming `staging` (None: naming none) runs where `given` says, and the warnings of KVPP's
    launch rules for the setup (its errors raised)."""
    setup = _setup(given, staging)
    platform = given.platform
    warnings = raise_for_errors(validate(setup, connector_rules, platform.name if platform else None))
    return resolve_mode(setup), warnings


@dataclass(frozen=True)
class ModeCapacity:
    """One mode's capacity at the plan's memory: what every rank holds (the least over ranks and stages)."""

    name: str
    staging: int | None
    """kvpp_staging_buffers (None: KVPP off)."""
    blocks: int | None
    tokens: int | None
    ratio: float | None
    """Against KVPP off."""
    runs: bool | None
    """Whether the mode runs where the plan is made (None: the plan does not say where, so an engine finds out)."""
    note: str | None
    """Why it does not run, or might not (None where it runs)."""


def compare_modes(given: PlanInput, memory: list[int]) -> list[ModeCapacity]:
    """KVPP off and every mode of COMPARED_STAGING at `memory`, one plan each, whatever the model (MLA, SFA or GQA):
    what a mode holds, and for zero-copy where it cannot run (kvpp_core.modes)."""
    rows: list[ModeCapacity] = []
    for staging in COMPARED_STAGING:
        name = "zero-copy" if staging == ZERO_COPY else f"staging {staging}"
        obstacles = zero_copy_obstacles(_setup(given, staging)) if staging == ZERO_COPY else []
        known = [o.reason for o in obstacles if o.known]
        runs = False if known else (None if obstacles else True)
        note = (known or [o.reason for o in obstacles] or [None])[0]
        try:
            plan = plan_capacity(given.model, given.topology, memory, block_size=given.block_size, staging=staging)
        except ValueError as exc:
            rows.append(ModeCapacity(name, staging, None, None, None, False, note or str(exc)))
            continue
        if not rows:
            rows.append(ModeCapacity("KVPP off", None, plan.blocks_off, plan.tokens_off, 1.0, True, None))
        rows.append(ModeCapacity(name, staging, plan.blocks_on, plan.tokens_on, plan.ratio, runs, note))
    return rows


def replica_groups(topo: Topology) -> list[list[int]]:
    """The TP ranks of each of a stage's cache-replica groups (a GQA model: one group per KV head)."""
    groups: dict[int, list[int]] = {}
    for rank in range(topo.tp):
        groups.setdefault(topo.replica_group(rank), []).append(rank)
    return list(groups.values())


def run(args: argparse.Namespace) -> int:
    given = plan_input(args)
    model, topo, block_size, platform = given.model, given.topology, given.block_size, given.platform
    mode, warnings = checked(given, args.staging)
    memory = [int(gib * GIB) for gib in args.memory_gib]
    if len(memory) not in (1, topo.pp):
        raise ValueError(f"--memory-gib takes one value or one per PP stage ({topo.pp}), got {len(memory)}")
    plan = plan_capacity(model, topo, memory, block_size=block_size, staging=mode.staging)
    modes = compare_modes(given, memory)
    for problem in warnings:
        print(f"kvpp: warning: {problem}", file=sys.stderr)
    if args.json:
        print(json.dumps(dict(plan.to_json(), model_mtp_layers=given.shipped_mtp, platform=platform and platform.name,
                              kernel=given.kernel, mode_reason=mode.reason, replica_groups=replica_groups(topo),
                              shm_needed_bytes=shm_needed(plan) if plan.zero_copy else None,
                              modes=[asdict(m) for m in modes], warnings=[str(p) for p in warnings]), indent=2))
    else:
        print(format_plan(plan, given.shipped_mtp, mode, platform is None))
        print(format_modes(modes, plan))
    if args.plot:
        plot_ratio_vs_tp(args.plot, model, topo, memory, block_size, mode.staging)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _bundle_terms(m: ModelSpec, tp: int) -> str:
    """One layer's KV per token on one rank, and what makes it up."""
    if m.attention == "gqa":
        per_rank = m.kv_heads_per_rank(tp)
        return (f"{m.num_kv_heads} KV heads x {m.head_dim}, KV {m.kv_dtype}; per rank at TP {tp} {per_rank} head(s) x "
                f"(K + V) x {m.head_dim} x {m.dtype_bytes} B = {m.token_bytes(tp):,} B/token")
    indexer = f" + indexer {m.indexer_dim}" if m.indexer_dim else ""
    return (f"KV {m.kv_dtype}; bundle ({m.kv_lora_rank} + rope {m.rope_dim}{indexer}) x {m.dtype_bytes} B = "
            f"{m.token_bytes():,} B/token")


def format_plan(plan: CapacityPlan, shipped_mtp: int, mode: Mode, platform_unknown: bool = False) -> str:
    m, t = plan.model, plan.topology
    mtp_note = f"MTP layers served: {m.mtp_layers}"
    if shipped_mtp != m.mtp_layers:
        mtp_note += f" (the model ships {shipped_mtp}; pass --mtp {shipped_mtp} when serving with MTP)"
    memory = ", ".join(f"stage {s.stage}: {s.memory_bytes / GIB:.2f} GiB" for s in plan.stages)
    lines = [
        f"KVPP capacity plan for {m.name}",
        f"  model     {m.num_layers} target layers, {m.attention.upper()}, {_bundle_terms(m, t.tp)}; {mtp_note}",
        f"  topology  {t.describe()}",
        f"  group     cache-replica groups: {t.describe_group()}"
        + ("; each is laid out as the ranks below" if t.groups_per_stage > 1 else ""),
        f"  blocks    {plan.block_size} tokens = {m.page_bytes(plan.block_size, t.tp):,} B per layer; "
        f"{plan.staging} staging buffer(s) per rank",
        f"  memory    KV memory per rank: {memory}",
        f"  mode      {mode}",
        *([f"            (--platform {VLLM_CPU.name} plans what an engine there runs naming no mode)"]
          if platform_unknown and plan.staging and mode.reason != NAMED else []),
        f"            {plan.mode}",
        *([f"  /dev/shm  {shm_note(shm_needed(plan), mode.reason == NAMED)}"] if plan.zero_copy else []),
        "",
    ]
    header = ("stage", "rank", "owned layers", "mtp", "staging", "bytes/block off", "bytes/block on",
              "blocks off", "blocks on", "tokens off", "tokens on", "ratio")
    rows = [header]
    for s in plan.stages:
        for r in s.ranks:
            owned = f"{r.owned_range} ({len(r.owned)})" if r.owned else "- (0)"
            rows.append((str(s.stage), str(r.kvpp_rank), owned, str(len(s.mtp_layers)), str(r.staging_slots),
                         f"{r.bytes_per_block_off:,}", f"{r.bytes_per_block_on:,}", f"{r.blocks_off:,}",
                         f"{r.blocks_on:,}", f"{r.tokens_off:,}", f"{r.tokens_on:,}",
                         f"{r.tokens_on / r.tokens_off:.2f}x"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        cells = [c.ljust(w) if i == 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    lines += [
        "",
        f"without KVPP: {plan.blocks_off:,} blocks = {plan.tokens_off:,} tokens "
        f"(binding: {_stages(plan.binding_stages_off)})",
        f"with KVPP:    {plan.blocks_on:,} blocks = {plan.tokens_on:,} tokens "
        f"(binding: {_stages(plan.binding_stages_on)})",
        f"capacity ratio {plan.ratio:.2f}x; equivalent KV memory saving {plan.memory_saving:.1%}",
    ]
    return "\n".join(lines)


def format_modes(modes: list[ModeCapacity], plan: CapacityPlan) -> str:
    """Every mode side by side, the plan's own marked."""
    lines = ["", "modes at this memory (every rank holds this many blocks; * the mode above):"]
    rows = [("mode", "blocks", "tokens", "ratio", "")]
    for m in modes:
        mark = "* " if m.staging == plan.staging else ""
        says = "" if m.note is None else ("cannot run here: " if m.runs is False else "not known here: ") + m.note
        if m.blocks is None:
            rows.append((m.name, "-", "-", "-", f"{mark}{says}"))
            continue
        rows.append((m.name, f"{m.blocks:,}", f"{m.tokens:,}", f"{m.ratio:.2f}x", mark + says))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        cells = [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:4], widths[1:]))]
        lines.append(("  " + "  ".join(cells) + "  " + row[4]).rstrip())
    return "\n".join(lines)


def plot_ratio_vs_tp(path: str, model: ModelSpec, topo: Topology, memory: list[int], block_size: int,
                     staging: int) -> None:
    """Capacity ratio for each TP size the model's heads allow, to show where the gain saturates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [tp for tp in PLOT_TP_SIZES if not model.num_heads or model.num_heads % tp == 0]
    fig, ax = plt.subplots(figsize=(8, 5))
    for count in sorted({staging, 1}, reverse=True):
        points = []
        for tp in sizes:
            try:
                trial = Topology(tp=tp, pp=topo.pp, pp_layers=topo.pp_layers, pcp=topo.pcp, runner=topo.runner,
                                 kv_heads=topo.kv_heads)
                points.append((tp, plan_capacity(model, trial, memory, block_size, count).ratio))
            except ValueError:
                continue
        if not points:
            continue
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", label="zero-copy (0 staging buffers)" if count == 0 else f"{count} staging buffer(s)")
        above = count == min(staging, 1)  # fewer staging buffers give the upper curve: label it above, the other below
        for x, y in points:
            ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 7 if above else -13),
                        ha="center", fontsize=8)
    ax.axvline(topo.tp, color="grey", linestyle=":", label=f"chosen TP {topo.tp}")
    ax.set_ylim(bottom=0)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("TP size (cache-replica group: the TP ranks of one PP stage holding the same KV)")
    ax.set_ylabel("KV capacity ratio, KVPP on / off")
    split = f", PP split {'/'.join(map(str, topo.pp_layers))}" if topo.pp_layers else (f", PP{topo.pp}" if topo.pp > 1 else "")
    ax.set_title(f"{model.name}: {model.num_layers} layers, MTP {model.mtp_layers}{split}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    finally:
        plt.close(fig)


def _stages(stages: tuple[int, ...]) -> str:
    return ("stage " if len(stages) == 1 else "stages ") + ", ".join(map(str, stages))
