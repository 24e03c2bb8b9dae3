"""The multi-host test bed (deploy/harness/testbed.py): real network namespaces on a bridge, as root.

Hosts reach each other only through their bridge addresses, a downed link cuts a host off and comes
back, a Mooncake transfer crosses hosts with its bytes intact, and nothing the test bed created
outlives it (on exit, on SIGTERM, or after a SIGKILLed run via the sweep).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deploy.harness.testbed import PREFIX, Testbed, sweep_stale, unavailable_reason
from tests.helpers.paths import REPO

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

TE_HOST = REPO / "tests" / "helpers" / "te_host.py"
ENV = {"PYTHONPATH": str(REPO), "MC_LOG_LEVEL": "ERROR"}


def leftovers(prefix: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = [line.split(":")[1].strip().split("@")[0]
             for line in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()]
    return [n for n in names + links if re.match(rf"{prefix}(?!\d)", n)]


def tcp_probe(bed: Testbed, host: str, address: str, port: int, timeout: float = 2.0) -> bool:
    code = f"import socket; socket.create_connection(({address!r}, {port}), timeout={timeout}).close()"
    return bed.run(host, [sys.executable, "-c", code], timeout=timeout + 10).returncode == 0


def listen(bed: Testbed, host: str, address: str, port: int, tmp_path: Path) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import socket, time
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(({address!r}, {port})); s.listen(16)
        print("ready", flush=True)
        while True:
            c, _ = s.accept(); c.close()
    """)
    log = tmp_path / f"{host}-{port}.log"
    proc = bed.spawn(host, [sys.executable, "-c", code], log)
    deadline = time.monotonic() + 15
    while "ready" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.05)
    return proc


def test_hosts_reach_each_other_only_through_their_addresses(tmp_path):
    with Testbed(["a", "b"]) as bed:
        a = bed.address("a")
        listen(bed, "a", a, 18080, tmp_path)
        listen(bed, "a", "127.0.0.1", 18081, tmp_path)
        assert tcp_probe(bed, "b", a, 18080), "b cannot reach a's bridge address"
        assert tcp_probe(bed, "a", "127.0.0.1", 18081)
        # Loopback is per host: what a binds to 127.0.0.1 is neither on b's loopback nor on a's address.
        assert not tcp_probe(bed, "b", "127.0.0.1", 18081)
        assert not tcp_probe(bed, "b", a, 18081)
        # The machine's own namespace (where tests and clients run) reaches every host via the bridge.
        import socket

        socket.create_connection((a, 18080), timeout=2).close()


def test_a_downed_link_cuts_the_host_off_until_it_comes_back(tmp_path):
    with Testbed(["a", "b"]) as bed:
        a = bed.address("a")
        listen(bed, "a", a, 18080, tmp_path)
        assert tcp_probe(bed, "b", a, 18080)
        bed.set_link("a", up=False)
        # Bounded by the probe's 1 s connect timeout; a hang would overrun bed.run's own 11 s and raise.
        assert not tcp_probe(bed, "b", a, 18080, timeout=1.0)
        bed.set_link("a", up=True)
        deadline = time.monotonic() + 10
        while not tcp_probe(bed, "b", a, 18080, timeout=1.0):
            assert time.monotonic() < deadline, "link did not come back"


def test_mooncake_transfer_across_hosts_is_intact_and_bounded_when_the_link_is_cut(tmp_path):
    mib, seed = 64, 7
    with Testbed(["prefill", "decode"]) as bed:
        server = subprocess.Popen(bed.command("prefill", [sys.executable, TE_HOST, "serve", bed.address("prefill"),
                                                          mib, seed]),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV})
        try:
            offer = json.loads(server.stdout.readline())
            read = [sys.executable, TE_HOST, "read", bed.address("decode"), offer["session"], offer["addr"],
                    offer["nbytes"], seed]
            first = json.loads(bed.run("decode", read, env={**os.environ, **ENV}).stdout)
            assert first["ok"] and first["intact"], first
            print(f"cross-host read: {first['bytes'] / first['seconds'] / 1e6:.0f} MB/s")
            bed.set_link("prefill", up=False)
            started = time.monotonic()
            cut = json.loads(bed.run("decode", read, timeout=120, env={**os.environ, **ENV}).stdout)
            elapsed = time.monotonic() - started
            assert not cut["ok"], cut
            # Liveness: 12x the 5 s transfer timeout, for a loaded host; an unbounded read would run into run's 120 s.
            assert elapsed < 60, f"a read from a cut-off host took {elapsed:.0f}s"
            print(f"read from a cut-off host failed after {elapsed:.1f}s")
            bed.set_link("prefill", up=True)
            again = json.loads(bed.run("decode", read, env={**os.environ, **ENV}).stdout)
            assert again["ok"] and again["intact"], again
        finally:
            server.stdin.close()
            server.wait(timeout=30)


def test_nothing_outlives_the_testbed_on_exit_on_error_and_on_sigterm(tmp_path):
    with Testbed(["a"]) as bed:
        prefix = bed.prefix
        proc = bed.spawn("a", ["sleep", "600"], tmp_path / "sleep.log")
        assert leftovers(prefix)
    assert proc.poll() is not None, "a process started in a host survived the test bed"
    assert leftovers(prefix) == []

    with pytest.raises(RuntimeError):
        with Testbed(["a"]) as bed:
            prefix = bed.prefix
            raise RuntimeError("boom")
    assert leftovers(prefix) == []

    script = "from deploy.harness.testbed import Testbed\nimport time\nwith Testbed(['a', 'b']) as bed:\n" \
             "    print(bed.prefix, flush=True)\n    time.sleep(600)\n"
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, **ENV})
    prefix = child.stdout.readline().strip()
    assert prefix.startswith(PREFIX) and leftovers(prefix)
    child.send_signal(signal.SIGTERM)
    child.wait(timeout=30)
    assert leftovers(prefix) == []


def test_the_sweep_removes_what_a_killed_run_left_and_nothing_else():
    script = "from deploy.harness.testbed import Testbed\nimport time\nbed = Testbed(['a']).__enter__()\n" \
             "print(bed.prefix, flush=True)\ntime.sleep(600)\n"
    with Testbed(["live"]) as mine:
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, **ENV})
        prefix = child.stdout.readline().strip()
        child.kill()
        child.wait(timeout=30)
        assert leftovers(prefix), "SIGKILL cannot clean up: there must be something to sweep"
        removed = sweep_stale()
        assert leftovers(prefix) == [] and removed
        assert leftovers(mine.prefix), "the sweep removed a live test bed's namespaces"
