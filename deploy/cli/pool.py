"""`kvpp pool up|serve|down`: a KV pool on this machine (deploy.services.pool)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from connectors.store.backends.settings import BACKENDS

from deploy.cli import args as cli_args
from deploy.services.pool import DEFAULT_STATE_DIR, pool_down, pool_up, serve_mooncake
from deploy.services.ports import NoFreePorts
from deploy.services.processes import ProcessError

MIN_SEGMENT, MAX_SEGMENT = 1 << 20, 1 << 40


def parse_size(text: str) -> int:
    """`512MB`, `2GB`, ... as bytes, from 1 MB to 1 TB (an argparse type)."""
    units = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    t = text.strip().upper().replace(" ", "")
    num = t.rstrip("KMGB")
    unit = t[len(num):]
    if not (num.isascii() and num.isdigit()) or len(num) > 20 or unit not in units:
        raise argparse.ArgumentTypeError(f"must look like 512MB or 2GB, got {text!r}")
    size = int(num) * units[unit]
    if not MIN_SEGMENT <= size <= MAX_SEGMENT:
        raise argparse.ArgumentTypeError(f"must be from 1MB to 1024GB, got {text!r}")
    return size


def _cmd_up(args) -> int:
    try:
        info = pool_up(args.backend, Path(args.state_dir), args.segment_size)
    except (ProcessError, NoFreePorts) as exc:
        raise ValueError(str(exc)) from exc
    if args.json:
        out = {"kv_connector_extra_config": info.kv_connector_extra_config, "pids": info.pids}
        if info.mmc_local_config_path:
            out["mmc_local_config_path"] = info.mmc_local_config_path
        print(json.dumps(out))
    else:
        print(f"{info.backend} pool up (pids {', '.join(map(str, info.pids))}); merge into --kv-transfer-config:")
        print(json.dumps({"kv_connector_extra_config": info.kv_connector_extra_config}, indent=2))
    return 0


def _cmd_serve(args) -> int:
    return serve_mooncake(args.host, args.port, args.segment_size, args.metrics_port)


def _cmd_down(args) -> int:
    pids = pool_down(Path(args.state_dir))
    print(f"stopped pool pids {', '.join(map(str, pids))}" if pids else "the pool's processes had already exited")
    return 0


def register(subparsers) -> None:
    pool = subparsers.add_parser("pool", help="start/stop a local KV pool (Mooncake store or memcache)")
    sub = pool.add_subparsers(dest="pool_command", required=True)
    up = sub.add_parser("up", help="start the pool on loopback and print its connector config")
    up.add_argument("--backend", choices=BACKENDS, required=True)
    up.add_argument("--segment-size", type=parse_size, default=1 << 30,
                    help="memory the pool holds (mooncake), e.g. 512MB (default 1GB)")
    up.add_argument("--state-dir", type=cli_args.path_text, default=str(DEFAULT_STATE_DIR),
                    help="where pids and logs are kept")
    up.add_argument("--json", action="store_true", help="print one JSON object")
    up.set_defaults(func=_cmd_up)
    serve = sub.add_parser("serve", help="run a Mooncake pool (master + segment holder) in the foreground on a "
                                         "given address: what rendered deployments start")
    serve.add_argument("--host", type=cli_args.host, required=True, help="address to listen on and advertise to engines")
    serve.add_argument("--port", type=cli_args.port, required=True, help="mooncake_master RPC port")
    serve.add_argument("--metrics-port", type=cli_args.port, default=None)
    serve.add_argument("--segment-size", type=parse_size, default=1 << 30, help="memory the pool holds, e.g. 512MB")
    serve.set_defaults(func=_cmd_serve)
    down = sub.add_parser("down", help="stop the pool started by `kvpp pool up`")
    down.add_argument("--state-dir", type=cli_args.path_text, default=str(DEFAULT_STATE_DIR))
    down.set_defaults(func=_cmd_down)
