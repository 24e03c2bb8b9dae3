"""The processes `kvpp pool` starts, as their own command lines: `python -m deploy.cli.pool_processes
hold ...` (a Mooncake segment holder) and `... meta-service ...` (the memcache MetaService)."""

from __future__ import annotations

import argparse
import sys

from deploy.services.pool import hold_segment, meta_service
from deploy.services.processes import LOOPBACK


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.cli.pool_processes")
    sub = parser.add_subparsers(dest="what", required=True)
    hold = sub.add_parser("hold")
    hold.add_argument("--master", required=True)
    hold.add_argument("--segment-bytes", type=int, required=True)
    hold.add_argument("--ready-file", required=True)
    hold.add_argument("--host", default=LOOPBACK)
    meta = sub.add_parser("meta-service")
    for name in ("--meta-port", "--config-store-port", "--metrics-port"):
        meta.add_argument(name, type=int, required=True)
    meta.add_argument("--log-dir", required=True)
    args = parser.parse_args(argv)
    if args.what == "hold":
        return hold_segment(args.master, args.segment_bytes, args.ready_file, args.host)
    return meta_service(args.meta_port, args.config_store_port, args.metrics_port, args.log_dir)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
