"""`kvpp chaos`: the fault harness (deploy.harness.chaos) against the local stack or running instances."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

from deploy.deployment.spec import ROUTERS
from deploy.harness import chaos as harness
from deploy.harness.chaos_stack import StackSettings
from deploy.services.processes import ProcessError


def register(subparsers) -> None:
    p = subparsers.add_parser("chaos", help="fault harness: P/D + pool stack under load, faults injected, answers "
                              "and leaks checked", description=harness.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", choices=("short", "soak"), default="short",
                   help="short: each fault once (~4 min here); soak: shuffled rounds for --soak-seconds")
    p.add_argument("--soak-seconds", type=float, default=1200, metavar="S")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--gap", type=float, default=4.0, metavar="S", help="fault-free load between faults (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart-under-load", action="store_true",
                   help="keep the clients going while a killed engine restarts (default: they pause, which "
                   "a 2-core host needs; the outage before the restart is always under load)")
    p.add_argument("--front", action="append", choices=ROUTERS, metavar="ROUTER",
                   help="the P/D front the clients talk to: kvpp-proxy (default) or vllm-router; give it twice "
                   "(--front kvpp-proxy --front vllm-router) to run the schedule through each in turn against the "
                   "same engines")
    p.add_argument("--cache-aware", action="store_true",
                   help="the prefill publishes its KV cache events and kvpp proxy picks prefills by them (--kv-events); "
                   "its event stream then dies and returns with every prefill fault (kvpp-proxy front only)")
    p.add_argument("--workdir", type=Path, help="model, logs and pool state (default: a temp dir)")
    p.add_argument("--report", type=Path, help="write the whole report (every request) as JSON here")
    p.add_argument("--json", action="store_true", help="print the report (without the request list) as JSON")
    attach = p.add_argument_group("running instances instead of the local stack (load, cancellations and checks; "
                                  "no process faults)")
    attach.add_argument("--proxy", metavar="URL", help="the P/D proxy clients talk to")
    attach.add_argument("--engines", metavar="NAME=URL[,...]", help="engines whose /metrics are checked; name the "
                        "decode `decode` for the pull-count check, e.g. prefill=http://P:8100,decode=http://D:8200")
    attach.add_argument("--reference", metavar="URL", help="a colocated engine giving the expected answers")
    attach.add_argument("--model", help="model name the instances serve")
    attach.add_argument("--seconds", type=float, default=120, metavar="S", help="load duration (default 120)")
    p.set_defaults(func=run)


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the stack's cleanup, unlike the default action


def run(args: argparse.Namespace) -> int:
    if args.clients < 1 or args.gap < 0 or args.soak_seconds <= 0:
        raise ValueError("--clients must be >= 1, --gap >= 0 and --soak-seconds > 0")
    signal.signal(signal.SIGTERM, _terminate)
    attach = (args.proxy, args.engines, args.reference, args.model)
    if any(attach):
        if not all(attach):
            raise ValueError("pointing at running instances needs --proxy, --engines, --reference and --model")
        if args.front and args.front != ["kvpp-proxy"]:
            raise ValueError("--front: running instances are checked against kvpp proxy's counters; --front "
                             "vllm-router applies to the local stack")
        if args.cache_aware:
            raise ValueError("--cache-aware applies to the local stack; a running proxy routes as it was started")
        report = harness.run_attached(args.proxy.rstrip("/"), _engine_urls(args.engines), args.reference.rstrip("/"),
                                      args.model, args.clients, args.seed, args.seconds, StackSettings())
        return _output(args, report)
    soak = args.schedule == "soak"
    schedule = (lambda: harness.soak_schedule(args.seed)) if soak else (lambda: harness.SHORT_SCHEDULE)
    seconds = args.soak_seconds if soak else None
    settings = StackSettings(cache_aware=args.cache_aware)
    fronts = tuple(dict.fromkeys(args.front or ["kvpp-proxy"]))
    if args.cache_aware and fronts != ("kvpp-proxy",):
        raise ValueError("--cache-aware is kvpp proxy's --kv-events; vllm-router's kv_aware reads P/D events as "
                         "16-token blocks only (see docs/routers.md): drop --front vllm-router")
    try:
        if args.workdir is None:
            with tempfile.TemporaryDirectory(prefix="kvpp-chaos-") as tmp:
                report = harness.run_chaos(Path(tmp), schedule, args.clients, args.seed, args.gap, settings,
                                           args.restart_under_load, seconds, fronts)
        else:
            args.workdir.mkdir(parents=True, exist_ok=True)
            report = harness.run_chaos(args.workdir, schedule, args.clients, args.seed, args.gap, settings,
                                       args.restart_under_load, seconds, fronts)
    except ProcessError as exc:
        print(f"kvpp chaos: failed: {exc}", file=sys.stderr)
        return 1
    return _output(args, report)


def _output(args: argparse.Namespace, report: dict) -> int:
    if args.report:
        args.report.write_text(json.dumps(report, indent=1))
    reports = report.get("fronts", [report])
    if args.json:
        short = [{k: v for k, v in r.items() if k != "requests"} for r in reports]
        print(json.dumps(short[0] if len(short) == 1 else {"fronts": short, "ok": report["ok"]}, indent=2))
    else:
        for r in reports:
            print_summary(r)
    return 0 if report["ok"] else 1


def _engine_urls(value: str) -> dict[str, str]:
    engines = {}
    for item in filter(None, (i.strip() for i in value.split(","))):
        name, eq, url = item.partition("=")
        if not (eq and name and url):
            raise ValueError(f"--engines: {item!r} is not NAME=URL; write e.g. prefill=http://P:8100,decode=http://D:8200")
        engines[name] = url.rstrip("/")
    return engines


def print_summary(report: dict) -> None:
    t = report["totals"]
    print(f"kvpp chaos ({report['front']}): {report['clients']} clients, {t['requests']} requests in "
          f"{report['duration_s']:.0f} s: "
          f"{t['answered']} answered (same tokens as a colocated engine), {t['wrong']} wrong, "
          f"{t['error']} errors, {t['cancelled']} cancelled by their client")
    print(f"  {'fault':<18}{'times':>6}{'affected':>9}{'answered':>9}{'errors':>7}{'allowed':>8}{'wrong':>6}"
          f"{'longest':>9}{'back in':>9}")
    quiet = {"fault": "(no fault)", "injected": 0, "recovered_s": 0, **report["without_fault"]}
    for row in report["fault_kinds"] + [quiet]:
        allowed = row["errors"] - row["errors_unexcused"]
        print(f"  {row['fault']:<18}{row['injected']:>6}{row['affected']:>9}{row['answered']:>9}{row['errors']:>7}"
              f"{allowed:>8}{row['wrong']:>6}{row['longest_s']:>8.1f}s{row['recovered_s']:>8.1f}s")
    for p in report["cancel_probes"]:
        print(f"  {p['label']:<18} every engine idle {p['idle_after_s']:.1f} s after the client left "
              f"({p['tokens_generated']} of 600 tokens generated)")
    for p in report.get("pull_probes", []):
        answered = sum(r["outcome"] == "answered" for r in p["requests"])
        c = p["counters"]
        print(f"  {p['label']:<18} {answered} of {len(p['requests'])} answered, slowest {p['slowest_s']:.1f} s "
              f"(limit {p['limit_s']:.1f} s, recompute {p['recompute_s']:.1f} s); pulls {c['pulls']}, failed "
              f"{c['failed_pulls']} ({c['stalled_pulls']} stalled), reads retried {c['retried_reads']}")
    for p in report.get("pool_probes", []):
        answered = sum(r["outcome"] == "answered" for r in p["requests"])
        c = p["counters"]
        print(f"  {p['label']:<18} {answered} of {len(p['requests'])} answered under {p['clients']} clients, "
              f"slowest {p['slowest_s']:.1f} s, {p['over_limit']} over the limit {p['limit_s']:.1f} s (recompute "
              f"{p['recompute_s']:.1f} s); "
              f"breaker opened {c['breaker_opens']}x, lookups refused {c['lookup_refusals']}, blocks past their "
              f"bound: loads {c['load_timeouts']}, saves {c['save_timeouts']}")
    d, c = report["drain"], report["counters"]
    pulls = c.get("skipped") or (f"{c['pulls']} pulls for {c['proxy_pd']} P/D requests, {c['failed_pulls']} failed, "
                                 f"{c['pulled_bytes']:,} of {c['expected_bytes']:,} bytes")
    print(f"  after the run      engines {'idle, KV usage 0' if d['idle'] else 'NOT idle'} after {d['seconds']:.1f} s; "
          f"{pulls}")
    print(f"  {report['front'] + ' counts':<19}{report['proxy_paths']}")
    print("  verdict            " + ("PASS" if report["ok"] else "FAIL: " + "; ".join(report["problems"])))
