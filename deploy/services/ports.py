"""Listening ports for the processes this project starts on one host (tests, the demo, `kvpp pool up`).

A port that was free when it was picked must still be free when its server binds it, which for a vLLM
engine is half a minute later. Two things take ports in that window:
- outgoing connections of any process, which get ports from the kernel's ephemeral range
  (`net.ipv4.ip_local_port_range`); a port the OS hands out for `bind(0)` comes from that same range;
- another process picking ports at the same time (two test tiers run side by side).
So ports are picked from SERVICE_PORTS (below the ephemeral range, above the 12300-17000 band Mooncake's
transfer engine picks its own ports from) and leased: a lease is an flock on a file named after the port in
LEASE_DIR, held for LEASE_S, so no two processes of this host pick the same port meanwhile; the kernel
drops it when its holder exits, so a killed test leaves nothing to clean up.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
import threading
import time
from pathlib import Path

from connectors.common.hosts import is_ipv6

LOOPBACK = "127.0.0.1"
SERVICE_PORTS = (20000, 32767)
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LEASE_DIR = Path(tempfile.gettempdir()) / "kvpp-port-leases"
LEASE_S = 900.0
"""Longest pick-to-bind window a lease covers: an engine start on a starved host, with room to spare."""
MIN_SPAN = 1000
ATTEMPTS = 200
_lock = threading.Lock()
_held: dict[int, tuple[int, float]] = {}  # port -> (fd of its flocked lease file, when it was taken)


class NoFreePorts(RuntimeError):
    """No run of free, unleased ports was found; the message says where it looked."""


def free_port(host: str = LOOPBACK) -> int:
    """A port free on `host`, outside the ephemeral range, leased to this process for LEASE_S."""
    return free_port_range(1, host)


def free_port_range(n: int, host: str = LOOPBACK) -> int:
    """Base of `n` consecutive such ports (one instance's kv_port range)."""
    low, high = service_ports()
    for _ in range(ATTEMPTS):
        base = random.randint(low, high - n + 1)
        ports = range(base, base + n)
        leased = []
        for port in ports:
            if not _lease(port):
                break
            leased.append(port)
        else:
            if all(_bindable(host, port) for port in ports):
                return base
        for port in leased:
            _release(port)
    raise NoFreePorts(f"no {n} consecutive free ports on {host} in {low}-{high} after {ATTEMPTS} tries; "
                      f"other processes bind or lease them (leases: {LEASE_DIR})")


def service_ports() -> tuple[int, int]:
    """SERVICE_PORTS cut below the ephemeral range; above it instead where that leaves too few."""
    low, high = SERVICE_PORTS
    try:
        eph_low, eph_high = (int(v) for v in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return low, high
    if min(high, eph_low - 1) - low >= MIN_SPAN:
        return low, min(high, eph_low - 1)
    if 65535 - (eph_high + 1) >= MIN_SPAN:
        return eph_high + 1, 65535
    return low, high


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if is_ipv6(host) else socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _lease(port: int) -> bool:
    """Take `port`'s lease; False while another process (or this one) holds it."""
    with _lock:
        now = time.monotonic()
        for old in [p for p, (_, at) in _held.items() if now - at > LEASE_S]:
            os.close(_held.pop(old)[0])
        if port in _held:
            return False
        LEASE_DIR.mkdir(parents=True, exist_ok=True)
        fd = os.open(LEASE_DIR / str(port), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        _held[port] = (fd, now)
        return True


def _release(port: int) -> None:
    with _lock:
        if port in _held:
            os.close(_held.pop(port)[0])
