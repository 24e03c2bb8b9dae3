"""`kvpp proxy`: the OpenAI-compatible P/D proxy (deploy.services.proxy) in the foreground."""

from __future__ import annotations

import argparse
import logging

from deploy.cli import args as cli_args
from deploy.services.proxy import Limits, Timeouts, serve
from deploy.services.routing import PrefixRouting


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "proxy", help="OpenAI-compatible P/D proxy: prefill with KV export, then decode with the KV",
        description="Serves /v1/completions and /v1/chat/completions (streaming too), /v1/models, /health "
        "(?backends=1 also probes the backends) and /metrics. Instances are used round-robin; when one role "
        "has no instance answering, the other role's instances serve whole requests. With --kv-events, a "
        "request's prefill goes to the instance where its cached prefix (vLLM's KV cache events tell which), net "
        "of the prompt tokens queued there, leaves the least to compute.",
    )
    p.add_argument("--prefill", type=cli_args.url_list, required=True, metavar="URL[,URL]",
                   help="prefill instance base URL(s)")
    p.add_argument("--decode", type=cli_args.url_list, required=True, metavar="URL[,URL]",
                   help="decode instance base URL(s)")
    p.add_argument("--host", type=cli_args.host, default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=cli_args.port, required=True)
    p.add_argument("--connect-timeout", type=cli_args.seconds, default=Timeouts.connect, metavar="S")
    p.add_argument("--prefill-timeout", type=cli_args.seconds, default=Timeouts.prefill, metavar="S",
                   help=f"whole prefill request; then the request goes to a decode alone (default {Timeouts.prefill:.0f})")
    p.add_argument("--decode-timeout", type=cli_args.seconds, default=Timeouts.decode_read, metavar="S",
                   help="longest silence while reading an answer; before the first byte the request then moves to "
                   f"another instance (default {Timeouts.decode_read:.0f})")
    p.add_argument("--probe-interval", type=cli_args.seconds, default=Timeouts.probe, metavar="S",
                   help=f"seconds between /health probes of failed instances (default {Timeouts.probe:g})")
    p.add_argument("--body-timeout", type=cli_args.seconds, default=Timeouts.body_read, metavar="S",
                   help=f"longest a client may take to send its request body; then HTTP 408 (default {Timeouts.body_read:g})")
    p.add_argument("--max-body-bytes", type=cli_args.bounded_int(1024, 1 << 30), default=Limits.max_body_bytes,
                   metavar="N", help=f"larger request bodies get HTTP 413 (default {Limits.max_body_bytes})")
    p.add_argument("--max-in-flight", type=cli_args.in_flight, default=Limits.max_in_flight,
                   metavar="N", help="completions served at once; beyond it clients get HTTP 429 with Retry-After "
                   f"(default {Limits.max_in_flight})")
    p.add_argument("--max-upstream-bytes", type=cli_args.bounded_int(1024, 1 << 34),
                   default=Limits.max_upstream_bytes, metavar="N",
                   help=f"largest non-streamed answer read from an instance (default {Limits.max_upstream_bytes})")
    routing = p.add_argument_group("cache-aware prefill choice (vLLM's KV cache events)")
    routing.add_argument("--kv-events", type=cli_args.value_list(cli_args.zmq_endpoint, "ZMQ endpoints", 256),
                         metavar="ENDPOINT[,ENDPOINT]", help="each prefill's KV event publisher (its "
                         "--kv-events-config endpoint, e.g. tcp://10.0.0.5:5557), in the order of --prefill; "
                         "turns on the cache-aware choice of prefill")
    routing.add_argument("--kv-events-replay", type=cli_args.value_list(cli_args.zmq_endpoint, "ZMQ endpoints", 256),
                         metavar="ENDPOINT[,ENDPOINT]", help="each prefill's KV event replay endpoint (its "
                         "--kv-events-config replay_endpoint, e.g. tcp://10.0.0.5:5558), in the order of --prefill: "
                         "what the prefills hold is learned from there at start and after every break in a stream "
                         "(without it, a break empties that prefill's index)")
    routing.add_argument("--kv-index-blocks", type=cli_args.bounded_int(1, 1 << 26),
                         default=PrefixRouting.max_index_blocks, metavar="N",
                         help="blocks indexed per prefill, the least recently announced leaves forgotten first "
                         f"(default {PrefixRouting.max_index_blocks})")
    routing.add_argument("--kv-events-block-size", type=cli_args.bounded_int(1, 1 << 16), metavar="N",
                         help="the prefills' block size (their --block-size): a stored event of another size is "
                         "refused and counted (kvpp_proxy_kv_event_refused, kind block_size); without it each index "
                         "learns the size from the first event it applies after it was emptied")
    routing.add_argument("--kv-events-timeout", type=cli_args.bounded_float(0.1, 3600.0),
                         default=PrefixRouting.event_timeout, metavar="S",
                         help="a publisher not answering heartbeats this long counts as gone (its index is synced "
                         "again from its replay endpoint, or emptied without one), as does a replay silent this "
                         f"long (default {PrefixRouting.event_timeout:g})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    prefill, decode = _urls(args.prefill, "--prefill"), _urls(args.decode, "--decode")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kvpp-proxy %(levelname)s %(message)s")
    timeouts = Timeouts(args.connect_timeout, args.prefill_timeout, args.decode_timeout, args.probe_interval,
                        args.body_timeout)
    limits = Limits(max_body_bytes=args.max_body_bytes, max_in_flight=args.max_in_flight,
                    max_upstream_bytes=args.max_upstream_bytes)
    if args.kv_events_replay and not args.kv_events:
        raise ValueError("--kv-events-replay needs --kv-events (the publishers whose batches it replays)")
    if args.kv_events_block_size and not args.kv_events:
        raise ValueError("--kv-events-block-size needs --kv-events (the publishers whose blocks it sizes)")
    routing = PrefixRouting(tuple(args.kv_events), tuple(args.kv_events_replay) if args.kv_events_replay else None,
                            args.kv_index_blocks, args.kv_events_timeout,
                            block_size=args.kv_events_block_size) if args.kv_events else None
    serve(prefill, decode, args.host, args.port, timeouts, limits, routing)
    return 0


def _urls(value: str, flag: str) -> list[str]:
    urls = [u.strip() for u in value.split(",") if u.strip()]
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"{flag}: {u!r} is not an http(s) URL; write e.g. http://127.0.0.1:8100")
    if not urls:
        raise ValueError(f"{flag} needs at least one URL")
    return urls
