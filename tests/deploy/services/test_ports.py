"""Service ports: outside the ephemeral range, bindable, and never handed to two processes at once."""

import random
import subprocess
import sys

import pytest

from deploy.services import ports
from tests.helpers.paths import REPO

pytestmark = pytest.mark.unit

# A child that leases `n` ports of a tiny range, prints them and holds them until its stdin closes.
HOLDER = """
import sys
from deploy.services import ports
ports.SERVICE_PORTS, ports.MIN_SPAN, ports.ATTEMPTS = (int(sys.argv[1]), int(sys.argv[2])), 0, 20000
print(" ".join(str(ports.free_port()) for _ in range(int(sys.argv[3]))), flush=True)
sys.stdin.read()
"""


def _unused(candidates: range) -> bool:
    """No one binds or leases these ports now (their leases are taken and given back at once)."""
    for port in candidates:
        if not ports._lease(port):
            return False
        ports._release(port)
    return all(ports._bindable(ports.LOOPBACK, port) for port in candidates)


def test_ports_come_from_outside_the_ephemeral_range_and_bind():
    low, high = (int(v) for v in ports.EPHEMERAL_RANGE.read_text().split())
    base = ports.free_port_range(3)
    assert not (low <= base + 2 and base <= high), f"{base}-{base + 2} is inside the ephemeral range {low}-{high}"
    assert all(ports._bindable(ports.LOOPBACK, port) for port in range(base, base + 3))
    assert ports._bindable("::1", ports.free_port("::1"))


def test_a_port_leased_by_one_process_goes_to_no_other_until_it_exits(monkeypatch):
    """Two pickers over the same 40 ports: the second gets exactly the 20 the first did not lease,
    finds none once all are leased, and gets them back when the first exits (the kernel drops its locks)."""
    low = next(b for b in random.sample(range(20000, 32000, 40), 300) if _unused(range(b, b + 40)))
    high = low + 39
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(low), str(high), "20"], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = set(map(int, holder.stdout.readline().split()))
        assert len(theirs) == 20
        monkeypatch.setattr(ports, "SERVICE_PORTS", (low, high))
        monkeypatch.setattr(ports, "MIN_SPAN", 0)
        monkeypatch.setattr(ports, "ATTEMPTS", 20000)
        mine = {ports.free_port() for _ in range(20)}
        assert mine == set(range(low, high + 1)) - theirs
        with pytest.raises(ports.NoFreePorts, match=f"in {low}-{high}"):
            ports.free_port()
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    assert ports.free_port() in theirs
