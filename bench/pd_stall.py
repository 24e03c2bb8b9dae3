"""Mooncake TCP under faults, the transfer engine alone (no vLLM): what a stalled or cut-off prefill and
idle gaps cost a read, and whether bytes land after the read returned.

A stand-in prefill worker (testbed/mooncake_peer.py: seeded KV pages in a real transfer engine, the
connector's side channel) serves; a reader process pulls all its pages (1 MiB pieces) three ways, the
modes interleaved, each fault repeated:

  sync           one batch_transfer_sync_read of every piece with Mooncake's timeouts as the connector
                 had them (MC_TRANSFER_TIMEOUT=5, MC_TCP_PROGRESS_TIMEOUT_SEC unset: its 30 s)
  sync_progress  the same with MC_TCP_PROGRESS_TIMEOUT_SEC=2
  connector      MooncakeTransfer.read with a 2 s StallWatch: the connector's pull now

Faults: `stop` (SIGSTOP of the prefill just before the read; SIGCONT --resume-after seconds, default 1,
after the read returned; loopback), `link` (the prefill's host cut off, its veth set down, across two
network-namespace hosts; up again as long after the read returned), `first` (on request only: the
connector's first read ever from a prefill stopped just before, Mooncake's handshake with it included;
a fresh prefill and reader each round) and `idle` (reads after 6 s and 12 s without traffic, loopback and across hosts).
Per read: seconds until it returned, for the connector also until the reads it had in flight ended,
and the bytes of the destination that changed after that (checked 3 s after the fault was lifted): bytes
landing late; then whether the next read is whole, and after how many seconds (re-tried every 0.5 s).

    .venv/bin/python -m bench.pd_stall [--repeat 3] [--faults stop,link,idle] [--resume-after 1]
        [--out bench/results/pd_stall.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.summary import host, interleaved, spread
from connectors.common.hosts import join_host_port
from connectors.common.mooncake_env import PROGRESS_TIMEOUT_ENV, SETTER_ENV
from connectors.mooncake.channel import call
from connectors.mooncake.messages import PROTOCOL_VERSION, MetaRequest, WorkerMeta
from connectors.mooncake.stall import LinkRate, PrefillProgress, StallWatch
from connectors.mooncake.transfer import Desc, MooncakeTransfer, TransferError, cut_entries
from deploy.harness.testbed import Testbed, unavailable_reason
from deploy.services.ports import free_port
from testbed.mooncake_peer import TOKEN, PeerJob, pages, start as start_peer, stop as stop_peer

MODES = ("sync", "sync_progress", "connector")
ENV = {"sync": {"MC_TRANSFER_TIMEOUT": "5"},
       "sync_progress": {"MC_TRANSFER_TIMEOUT": "5", "MC_TCP_PROGRESS_TIMEOUT_SEC": "2"},
       "connector": {}}
STALL_S = 2.0
LAYERS, BLOCKS, SEED = 4, 512, 13  # 75 MB of pages: 72 reads of 1 MiB
SENTINEL = -7.0
IDLE_GAPS_S = (6.0, 12.0)
RECOVERY_S = 60.0


# ---- the reader: one process per mode, driven over stdin/stdout ------------------------------------
def reader(mode: str, host_address: str, peer_host: str, peer_port: int) -> int:
    meta = call(peer_host, peer_port, MetaRequest(version=PROTOCOL_VERSION, request_id="bench", token=TOKEN), 30.0,
                WorkerMeta)
    te = MooncakeTransfer(host_address, progress_timeout_s=STALL_S if mode == "connector" else None)
    kv = torch.zeros((LAYERS, BLOCKS, 16, 576))
    te.register([(kv.data_ptr(), kv.numel() * kv.element_size())])
    layer_bytes = kv[0].numel() * kv.element_size()
    pieces = cut_entries([Desc(kv[i].data_ptr(), layer.base_addr, layer_bytes) for i, layer in enumerate(meta.layers)],
                         te.max_entry_bytes)
    peer = join_host_port(meta.te_host, meta.te_rpc_port)
    expected, snapshot = pages(LAYERS, BLOCKS, SEED), kv.clone()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        op = json.loads(line)["op"]
        if op == "read":
            kv.fill_(SENTINEL)
            out, drain, start = {}, None, time.monotonic()
            try:
                if mode == "connector":
                    watch = StallWatch(STALL_S, LinkRate(), PrefillProgress(), since=start)
                    out["retried"] = te.read(peer, pieces, watch).retried
                else:
                    rc = te._engine.batch_transfer_sync_read(peer, [d.local for d in pieces], [d.remote for d in pieces],
                                                             [d.length for d in pieces])
                    if rc != 0:
                        raise TransferError(f"batch_transfer_sync_read returned {rc}")
                out["ok"] = True
            except TransferError as exc:
                out.update(ok=False, error=str(exc)[:160])
                drain = exc.drain
            out["seconds"] = round(time.monotonic() - start, 3)
            if drain is not None:  # the connector's reads still in flight: until the engine ended each
                out["in_flight"] = len(drain)
                while not drain.ended():
                    time.sleep(0.01)
            out["ended_s"] = round(time.monotonic() - start, 3)  # sync: nothing to wait for (nor to know)
            out["whole"] = bool(torch.equal(kv, expected))
            snapshot = kv.clone()
            print(json.dumps(out), flush=True)
        elif op == "late":
            print(json.dumps({"late_bytes": int((kv != snapshot).sum()) * kv.element_size()}), flush=True)
    te.close()
    return 0


# ---- the driver ----------------------------------------------------------------------------------
class Pair:
    """A stand-in prefill and one reader per mode, on loopback or across two test-bed hosts."""

    def __init__(self, bed: Testbed | None) -> None:
        self.bed = bed
        self.peer_host = bed.address("prefill") if bed else "127.0.0.1"
        port = free_port()
        prefix = bed.command("prefill", []) if bed else ()
        self.peer = start_peer(PeerJob(port=port, host=self.peer_host, layers=LAYERS, blocks=BLOCKS, seed=SEED,
                                       holds={"bench": TOKEN}, hold_timeout=3600), stderr=subprocess.DEVNULL,
                               prefix=prefix)
        assert json.loads(self.peer.stdout.readline()).get("ready")
        self.readers = {}
        for mode in MODES:
            env = {k: v for k, v in os.environ.items()
                   if k not in ("MC_TRANSFER_TIMEOUT", PROGRESS_TIMEOUT_ENV, SETTER_ENV)}
            env.update(ENV[mode], MC_LOG_LEVEL="ERROR",
                       PYTHONPATH=os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]),
                                                              env.get("PYTHONPATH")) if p))
            argv = [sys.executable, "-m", "bench.pd_stall", "--reader", mode,
                    bed.address("decode") if bed else "127.0.0.1", self.peer_host, str(port)]
            proc = subprocess.Popen(bed.command("decode", argv) if bed else argv, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            assert json.loads(proc.stdout.readline()).get("ready"), mode
            self.readers[mode] = proc

    def ask(self, mode: str, op: str) -> dict:
        proc = self.readers[mode]
        proc.stdin.write(json.dumps({"op": op}) + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    def fault(self, kind: str, on: bool) -> None:
        if kind in ("stop", "first"):
            os.kill(self.peer.pid, signal.SIGSTOP if on else signal.SIGCONT)
        else:
            self.bed.set_link("prefill", up=not on)

    def close(self) -> None:
        os.kill(self.peer.pid, signal.SIGCONT)
        for proc in [*self.readers.values(), self.peer]:
            stop_peer(proc, timeout=30)


def recovered(pair: Pair, mode: str) -> dict:
    """Reads every 0.5 s after the fault was lifted until one is whole: how long, and how many failed."""
    start, failed = time.monotonic(), 0
    while time.monotonic() - start < RECOVERY_S:
        out = pair.ask(mode, "read")
        if out["ok"] and out["whole"]:
            return {"whole_after_s": round(time.monotonic() - start, 2), "failed_before": failed,
                    "retried": out.get("retried", 0)}
        failed += 1
        time.sleep(0.5)
    return {"whole_after_s": None, "failed_before": failed}


def fault_round(pair: Pair, kind: str, mode: str, resume_after_s: float) -> dict:
    """`stop` and `link` after a whole read; `first`: the reader's first read ever from the prefill, which
    was stopped first (Mooncake's handshake with it is part of that read)."""
    if kind != "first":
        assert pair.ask(mode, "read")["whole"], "a read before the fault was not whole"
    pair.fault(kind, True)
    try:
        out = pair.ask(mode, "read")
        time.sleep(resume_after_s)
    finally:
        pair.fault(kind, False)
    time.sleep(3.0)
    out.update(pair.ask(mode, "late"))
    out.update(recovered(pair, mode))
    return out


def idle_round(pair: Pair, mode: str) -> dict:
    assert pair.ask(mode, "read")["whole"]
    out = {}
    for gap in IDLE_GAPS_S:
        time.sleep(gap)
        first = pair.ask(mode, "read")
        out[f"after_{gap:g}s"] = {k: first.get(k) for k in ("ok", "whole", "seconds", "retried", "error")}
    return out


def run(faults: list[str], repeat: int, resume_after_s: float) -> dict:
    results: dict = {}
    for kind in faults:
        where = ["hosts"] if kind == "link" else ["loopback", "hosts"] if kind == "idle" else ["loopback"]
        modes = ["connector"] if kind == "first" else list(MODES)  # one handshake, whichever read follows
        for place in where:
            if place == "hosts" and unavailable_reason():
                results[f"{kind}@{place}"] = {"skipped": unavailable_reason()}
                continue
            rows: dict[str, list] = {m: [] for m in modes}
            # A first contact happens once per reader: a fresh prefill and readers for each round.
            for pairing in ([[r] for r in range(repeat)] if kind == "first" else [list(range(repeat))]):
                with Testbed(["prefill", "decode"]) if place == "hosts" else contextlib.nullcontext() as bed:
                    pair = Pair(bed)
                    try:
                        for r, mode in interleaved(modes, len(pairing)):
                            row = idle_round(pair, mode) if kind == "idle" else fault_round(pair, kind, mode,
                                                                                             resume_after_s)
                            print(f"[pd_stall] {kind}@{place} {mode}: {row}", file=sys.stderr, flush=True)
                            rows[mode].append(row)
                    finally:
                        pair.close()
            results[f"{kind}@{place}"] = {mode: _summary(kind, rows[mode]) for mode in modes}
    return results


def _summary(kind: str, rows: list[dict]) -> dict:
    if kind == "idle":
        return {"rounds": rows, "first_reads_whole": sum(v["whole"] for r in rows for v in r.values()),
                "first_reads": sum(len(r) for r in rows)}
    return {"rounds": rows,
            "returned_s": spread(r["seconds"] for r in rows),
            "reads_ended_s": spread(r["ended_s"] for r in rows),
            "late_bytes": spread(r["late_bytes"] for r in rows),
            "rounds_with_late_bytes": sum(r["late_bytes"] > 0 for r in rows),
            "next_whole_after_s": spread(r["whole_after_s"] for r in rows if r["whole_after_s"] is not None)
            if any(r["whole_after_s"] is not None for r in rows) else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reader", nargs=4, metavar=("MODE", "HOST", "PEER_HOST", "PEER_PORT"), help=argparse.SUPPRESS)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--faults", default="stop,link,idle")
    p.add_argument("--resume-after", type=float, default=1.0, metavar="S",
                   help="seconds after the read returned before the stopped or cut-off prefill is back")
    p.add_argument("--out", type=Path, default=Path("bench/results/pd_stall.json"))
    args = p.parse_args(argv)
    if args.reader:
        mode, address, peer_host, peer_port = args.reader
        return reader(mode, address, peer_host, int(peer_port))
    faults = [f for f in args.faults.split(",") if f]
    bad = set(faults) - {"stop", "link", "idle", "first"}
    if bad or args.repeat < 1:
        p.error(f"--faults takes stop, link, idle, first (got {sorted(bad)}); --repeat >= 1")
    started = time.monotonic()
    results = run(faults, args.repeat, args.resume_after)
    report = {"bench": "pd_stall", "host": host("shared 2-core host; other sessions' tests ran beside it"),
              "mooncake": _mooncake_version(), "stall_s": STALL_S, "bytes": LAYERS * BLOCKS * 16 * 576 * 4,
              "repeat": args.repeat, "resume_after_s": args.resume_after, "seconds": round(time.monotonic() - started), "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=1))
    return 0


def _mooncake_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("mooncake-transfer-engine-non-cuda")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
