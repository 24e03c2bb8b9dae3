"""`kvpp simulate`: what KVPP buys on a trace: prefix hits, prefill computed, preemptions, TTFT and goodput per
KVPP mode and KV budget, from a block-level simulation of vLLM's prefix cache (deploy/simulation/)."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

from kvpp_core.capacity import plan_capacity
from kvpp_core.platforms import VLLM_CPU

from deploy.cli import args as cli_args
from deploy.cli import plan
from deploy.simulation import costs as cost_model
from deploy.simulation import report, synthetic
from deploy.simulation.cluster import Simulation
from deploy.simulation.formats import FORMATS, detect, read_trace, resolve_hash_block_size, write_public
from deploy.simulation.routes import POLICIES
from deploy.simulation.state import EngineConfig
from deploy.simulation.trace import TraceInfo, count_lines, to_request, write_lines

MODES = {"off": None, "staging": 2, "staging-1": 1, "zero-copy": 0}
"""A mode's kvpp_staging_buffers (None: KVPP off)."""
ROLES = ("prefill", "colocated")
SCHEDULINGS = ("async", "sync")
MAX_ENGINES = 1024
MAX_TOKENS = 1 << 24
MAX_REQUESTS = 1 << 32
TRACE_MAX_MODEL_LEN = 32768


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate", help="prefix hits, prefill saved, TTFT and goodput per KVPP mode and KV budget on a trace",
        description="Replay a trace (JSON lines, one request a line) or a synthetic multi-turn workload through a "
        "block-level simulation of vLLM's prefix cache and scheduler, on the KV capacity the planner gives each "
        "mode at each budget, behind kvpp proxy's own routing; report hit rates, prefill tokens computed, "
        "preemptions and the cost model's TTFT and goodput.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=cli_args.path, metavar="FILE",
                        help="requests, one a line: this project's JSON lines, a Mooncake or Qwen/Bailian trace, or a "
                        "CSV of token counts (Azure, BurstGPT); see the Simulation page for the formats")
    source.add_argument("--synthetic", action="store_true", help="a synthetic multi-turn agent workload (below)")
    p.add_argument("--trace-format", choices=FORMATS, default="auto",
                   help="the trace's format (default auto: told by its first line's keys or CSV header)")
    p.add_argument("--hash-block-size", type=cli_args.bounded_int(1, plan.MAX_BLOCK_SIZE), default=None, metavar="N",
                   help="tokens per block of a trace's block hashes (default: the simulated block size for this "
                   "project's format, 512 for Mooncake's, 16 for Bailian's); it and the block size divide one another")
    plan.add_model_args(p)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--kv-gib", type=cli_args.value_list(cli_args.bounded_float(0.0, plan.MAX_MEMORY_GIB),
                                                             "comma-separated numbers like 16,32,64", 64),
                        default=(32.0,), metavar="GIB[,GIB...]",
                        help="KV memory per rank, each value simulated (default 32)")
    budget.add_argument("--blocks", type=cli_args.value_list(cli_args.bounded_int(2, 1 << 26),
                                                             "comma-separated integers like 400,800", 64),
                        default=None, metavar="N[,N...]",
                        help="KV blocks per engine instead (vLLM's num_gpu_blocks, its null block included); "
                        "the modes then only pick the cost model's figures")
    p.add_argument("--modes", type=_modes, default=("off", "staging", "zero-copy"), metavar="MODE[,MODE...]",
                   help=f"KVPP modes to simulate: {', '.join(MODES)} (staging = 2 buffers; default off,staging,"
                   "zero-copy)")
    p.add_argument("--prefills", type=cli_args.bounded_int(1, MAX_ENGINES), default=1, metavar="N",
                   help="engines behind the router (default 1)")
    p.add_argument("--role", choices=ROLES, default=None,
                   help="prefill: P/D prefills (one token each, blocks held until the decode has read them, the "
                   "decode leg from the cost model); colocated: engines that decode too (default: prefill with "
                   "several engines, else colocated)")
    p.add_argument("--policy", type=_policies, default=None, metavar="POLICY[,POLICY...]",
                   help=f"routing: {', '.join(POLICIES)} (kvpp proxy's own; cache-aware needs --role prefill, as "
                   "the proxy does; default: both for P/D prefills, else round-robin)")
    p.add_argument("--scheduling", choices=SCHEDULINGS, default=None,
                   help="vLLM's scheduling: async (the engine core schedules a step before applying the previous "
                   "one's output) or sync (default: what vLLM 0.32 does by default where the engines run: sync on "
                   "vllm-cpu, else async)")
    p.add_argument("--max-num-batched-tokens", type=cli_args.bounded_int(1, MAX_TOKENS), default=8192, metavar="N",
                   help="vLLM's token budget per step (default 8192)")
    p.add_argument("--max-num-seqs", type=cli_args.bounded_int(1, 1 << 16), default=256, metavar="N",
                   help="vLLM's running requests at most (default 256)")
    p.add_argument("--max-model-len", type=cli_args.bounded_int(2, MAX_TOKENS), default=None, metavar="N",
                   help=f"vLLM's max model len (default: the synthetic workload's longest request, {TRACE_MAX_MODEL_LEN} "
                   "for a trace)")
    p.add_argument("--costs", type=cli_args.path, default=None, metavar="FILE.json",
                   help="the cost model's coefficients (default: fitted on this project's benches, a 2-core vllm-cpu "
                   "host: give your deployment's own for meaningful TTFT and goodput)")
    p.add_argument("--ttft-slo-s", type=cli_args.seconds, default=None, metavar="S",
                   help="goodput counts answers whose TTFT is within this (default: every answer)")
    p.add_argument("--seed", type=cli_args.bounded_int(0, 1 << 31), default=0,
                   help="the synthetic workload's and the KV reads' random draws")
    p.add_argument("--read-ahead", type=cli_args.bounded_int(1, 1 << 26), default=1 << 16, metavar="N",
                   help="trace requests held in memory at most (default 65536)")
    w = p.add_argument_group("synthetic workload (--synthetic)")
    default = synthetic.Workload()
    for name, kind, help_text in (
            ("conversations", cli_args.bounded_int(1, MAX_REQUESTS), "conversations"),
            ("turns", cli_args.bounded_int(1, 1 << 16), "turns per conversation"),
            ("rate", cli_args.bounded_float(0.0, 1e9, low_inclusive=True), "new conversations per second (0: all at once)"),
            ("system-prompts", cli_args.bounded_int(1, 1 << 20), "distinct shared system prompts"),
            ("system-tokens", cli_args.bounded_int(0, MAX_TOKENS), "tokens of a system prompt"),
            ("first-tokens", cli_args.bounded_int(1, MAX_TOKENS), "tokens of a conversation's first user message"),
            ("growth-tokens", cli_args.bounded_int(0, MAX_TOKENS), "new user tokens in each later turn"),
            ("output-tokens", cli_args.bounded_int(1, MAX_TOKENS), "tokens of an answer"),
            ("think-s", cli_args.bounded_float(0.0, 1e9, low_inclusive=True), "mean think time between an answer "
             "and the next turn (exponential)"),
            ("variation", cli_args.bounded_float(0.0, 0.99, low_inclusive=True), "spread of lengths: each drawn "
             "uniformly within (1 -+ this) x its mean")):
        field = name.replace("-", "_")
        w.add_argument(f"--{name}", type=kind, default=getattr(default, field), dest=f"w_{field}",
                       help=f"{help_text} (default {getattr(default, field)})")
    w.add_argument("--write-trace", type=cli_args.path, default=None, metavar="FILE",
                   help="write the synthetic workload as a trace and stop: this project's format (block hashes at "
                   "--hash-block-size, closed loop), or, with --trace-format, a Mooncake, Bailian or Azure-lengths "
                   "trace (open loop at each turn's nominal time)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--out", type=cli_args.path, default=None, metavar="FILE.json", help="also write the JSON here")
    p.add_argument("--plot", type=cli_args.image_path, default=None, metavar="FILE.png",
                   help="also draw hit rate and goodput against KV memory, a line per mode")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr (a bar on a terminal, else a line every 5 s)")
    p.set_defaults(func=run)


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(","))
    unknown = [m for m in modes if m not in MODES]
    if unknown or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"expected distinct modes among {', '.join(MODES)}, got {text!r}")
    return modes


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(m.strip() for m in text.split(","))
    if not set(names) <= set(POLICIES) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct policies among {', '.join(POLICIES)}, got {text!r}")
    return names


def _workload(args: argparse.Namespace) -> synthetic.Workload:
    return synthetic.Workload(seed=args.seed, **{k[2:]: v for k, v in vars(args).items() if k.startswith("w_")
                                                 and k != "w_write_trace"})


def default_scheduling(platform: str | None) -> str:
    """vLLM 0.32's scheduling where the engines run, as it picks it by default: vllm-cpu always schedules
    synchronously (vllm/platforms/cpu.py sets `async_scheduling` False); vLLM elsewhere asynchronously unless
    something rules it out (vllm/config/vllm.py: pooling models, some speculative decoding, PP on the V1 runner),
    none of which the simulator models."""
    return "sync" if platform == VLLM_CPU.name else "async"


def run(args: argparse.Namespace) -> int:
    """Python's cycle collector is off meanwhile: the simulation makes no cycles, and a pass over the router's
    millions of objects (one falls due after each run) costs seconds."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _run(args)
    finally:
        if collecting:
            gc.enable()


def _run(args: argparse.Namespace) -> int:
    given = plan.plan_input(args)
    bs = given.block_size
    scheduling = args.scheduling or default_scheduling(given.platform and given.platform.name)
    info = None
    if args.synthetic:
        fmt = "kvpp" if args.trace_format == "auto" or not args.write_trace else args.trace_format
    else:
        fmt = detect(args.trace) if args.trace_format == "auto" else args.trace_format
    hash_bs = resolve_hash_block_size(fmt, bs, args.hash_block_size)
    if args.synthetic:
        work = _workload(args)
        if args.write_trace:
            if fmt == "kvpp":
                write_lines(synthetic.lines(work, hash_bs), args.write_trace)
            else:
                write_public(synthetic.public_lines(work, fmt, hash_bs), args.write_trace, fmt)
            print(f"{work.requests:,} requests written to {args.write_trace} ({fmt})", file=sys.stderr)
            return 0
        max_len = args.max_model_len or work.max_tokens()
        total: int | None = work.requests

        def requests():
            return (to_request(line, i, bs, hash_bs) for i, line in enumerate(synthetic.lines(work, hash_bs)))
    else:
        if args.write_trace:
            raise ValueError("--write-trace writes the synthetic workload: give --synthetic, not --trace")
        max_len = args.max_model_len or TRACE_MAX_MODEL_LEN
        total = count_lines(args.trace)
        info = TraceInfo(fmt, hash_bs)

        def requests():
            return read_trace(args.trace, bs, hash_bs, fmt, info)
    role = args.role or ("prefill" if args.prefills > 1 else "colocated")
    policies = args.policy or (POLICIES if role == "prefill" and args.prefills > 1 else ("round-robin",))
    if "cache-aware" in policies and role != "prefill":
        raise ValueError("the cache-aware policy routes P/D prefill legs, as kvpp proxy does: add --role prefill")
    costs = cost_model.load(args.costs) if args.costs else cost_model.DEFAULT
    warnings, cells = [], []
    for mode in args.modes:
        staging = MODES[mode]
        if args.blocks is None and staging is not None:
            found_mode, found = plan.checked(given, staging)
            staging = found_mode.staging
            warnings += [f"{mode}: {w}" for w in found if f"{mode}: {w}" not in warnings]
        for i, value in enumerate(args.blocks or args.kv_gib):
            if args.blocks is not None:
                cells.append((mode, None, value))
                continue
            memory = int(value * plan.GIB)
            capacity = plan_capacity(given.model, given.topology, memory, block_size=bs,
                                     staging=2 if staging is None else staging)
            cells.append((mode, value, capacity.blocks_off if staging is None else capacity.blocks_on))
    for warning in warnings:
        print(f"kvpp: warning: {warning}", file=sys.stderr)
    runs = []
    for mode, gib, blocks in cells:
        engine = EngineConfig(blocks, bs, args.max_num_batched_tokens, args.max_num_seqs, max_len, role == "prefill",
                              async_scheduling=scheduling == "async")
        for policy in policies:
            label = f"{mode}, {gib:g} GiB" if gib is not None else f"{mode}, {blocks} blocks"
            sim = Simulation(engine, args.prefills, policy, costs, mode, args.read_ahead,
                             progress=None if args.quiet else f"{label}, {policy}", total=total, seed=args.seed)
            result = sim.run(requests())
            runs.append({"mode": mode, "policy": policy, "kv_gib": gib, "blocks": blocks,
                         "tokens": blocks * bs, **result.summary(args.ttft_slo_s)})
    out = {
        "model": given.model.name, "topology": given.topology.describe(), "block_size": bs,
        "engines": {"count": args.prefills, "role": role, "max_num_batched_tokens": args.max_num_batched_tokens,
                    "max_num_seqs": args.max_num_seqs, "max_model_len": max_len, "scheduling": scheduling},
        "workload": ({"synthetic": vars(_workload(args))} if args.synthetic
                     else {"trace": str(args.trace), **info.to_json()}),
        "ttft_slo_s": args.ttft_slo_s, "costs": costs.to_json(), "warnings": warnings, "runs": runs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{given.model.name} on {given.topology.describe()}, block {bs}; {args.prefills} {role} engine(s), "
              f"{scheduling} scheduling; costs: {costs.source or args.costs}")
        if info is not None:
            print(report.trace_summary(info.to_json()))
        print(report.table(runs))
        if any(run.get("by_type") or run.get("by_turn") for run in runs):
            print(report.groups(runs))
    if args.plot:
        report.plot(runs, args.plot, f"{given.model.name}, {given.topology.describe()}, {args.prefills} {role} "
                    f"engine(s)")
    return 0
