"""Several "hosts" on one machine: network namespaces joined by a bridge.

Multi-host failures (bind addresses, VLLM_HOST_IP, per-host ports, a link going down) hide behind
loopback, so the multi-host tests and `kvpp demo --hosts` run each role in its own network stack.
Needs root (CAP_NET_ADMIN). Every namespace and interface carries this process's prefix, so removal
touches only what this test bed created, and a later run can sweep what a killed one left behind.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "kvpp"
DOC_NETS = ("198.51.100.0/24", "203.0.113.0/24")
"""TEST-NET-2 and -3 (RFC 5737): documentation addresses, never routed. TEST-NET-1 is left out: some
hosts (this project's sandboxes among them) number their own uplink from it."""
SUBNET_PREFIX = 27
LOCK_FILE = "/tmp/kvpp-testbed.lock"
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}$")


class TestbedError(RuntimeError):
    """The test bed could not be built or driven; the message says which command failed."""

    __test__ = False  # not a pytest test class


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None when they can (tests skip with this reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root to use the multi-host test bed"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing; apt-get install iproute2"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise TestbedError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove namespaces and interfaces left by test beds whose creating process is gone (a SIGKILLed
    run cannot clean up after itself). Returns the names removed."""
    removed = []
    pattern = re.compile(rf"^{PREFIX}(\d+)")
    for ns in _ip("netns", "list", check=False).stdout.split():
        m = pattern.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_namespace_processes(ns)
            _ip("netns", "delete", ns, check=False)
            removed.append(ns)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        m = pattern.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("link", "delete", name, check=False)
            removed.append(name)
    return removed


def _in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine already has an address or a route in."""
    nets = []
    for line in _ip("-o", "-4", "addr", "show", check=False).stdout.splitlines():
        for word in line.split():
            if "/" in word and word[0].isdigit():
                nets.append(ipaddress.ip_network(word, strict=False))
    for line in _ip("-4", "route", "show", check=False).stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first[:1].isdigit():
            nets.append(ipaddress.ip_network(first if "/" in first else f"{first}/32", strict=False))
    return nets


def free_subnet() -> str:
    """A documentation /27 that overlaps nothing this machine uses (other test beds included)."""
    used = _in_use()
    for doc in DOC_NETS:
        for net in ipaddress.ip_network(doc).subnets(new_prefix=SUBNET_PREFIX):
            if not any(net.overlaps(u) for u in used):
                return str(net)
    raise TestbedError(f"every /{SUBNET_PREFIX} of {', '.join(DOC_NETS)} is in use on this machine")


def _kill_namespace_processes(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@dataclass(frozen=True)
class Host:
    name: str
    """Logical name given by the caller (e.g. "prefill")."""
    netns: str
    address: str
    veth: str
    """The bridge-side end of this host's link; taking it down cuts the host off."""


class Testbed:
    """N hosts on one bridge; the bridge itself gets the subnet's first address, so the machine's own
    namespace (the test process) reaches every host. Use as a context manager: everything is removed on
    exit, on an exception, on Ctrl-C and on SIGTERM."""

    __test__ = False

    _active = False  # one per process: names carry the pid

    def __init__(self, names: Sequence[str], subnet: str | None = None) -> None:
        bad = [n for n in names if not _NAME.match(n)]
        if bad or len(set(names)) != len(names):
            raise TestbedError(f"host names must be unique lowercase DNS labels, got {list(names)}")
        self.names = list(names)
        self.subnet = subnet
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{self.prefix}br"
        self.hosts: dict[str, Host] = {}
        self._created: list[tuple[str, str]] = []  # ("netns"|"link", name), in creation order
        self._procs: list[subprocess.Popen] = []
        self._old_sigterm = None

    def _plan(self) -> None:
        """Pick the subnet and addresses (under the machine-wide lock, so two test beds never share one)."""
        net = ipaddress.ip_network(self.subnet or free_subnet())
        clash = [str(u) for u in _in_use() if net.overlaps(u)]
        if clash:
            raise TestbedError(f"subnet {net} overlaps networks this machine uses ({', '.join(clash)}); "
                               "leave the subnet out to get a free one")
        addresses = list(net.hosts())
        if len(addresses) < len(self.names) + 1:
            raise TestbedError(f"subnet {net} has room for {len(addresses) - 1} hosts, {len(self.names)} asked")
        self.subnet, self.netmask, self.gateway = str(net), net.prefixlen, str(addresses[0])
        self.hosts = {
            name: Host(name, f"{self.prefix}-{name}", str(addresses[i + 1]), f"{self.prefix}h{i}")
            for i, name in enumerate(self.names)
        }

    # ---- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        reason = unavailable_reason()
        if reason:
            raise TestbedError(reason)
        if Testbed._active:
            raise TestbedError("one test bed per process: close the other one first")
        Testbed._active = True
        self._install_sigterm()
        try:
            with open(LOCK_FILE, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                sweep_stale()
                self._plan()
                self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _install_sigterm(self) -> None:
        """SIGTERM (a CI timeout, `kill`) becomes SystemExit so `with` blocks unwind and clean up."""
        try:
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_exit)
        except ValueError:  # not the main thread: the caller handles signals
            self._old_sigterm = None

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append(("link", self.bridge))
        _ip("addr", "add", f"{self.gateway}/{self.netmask}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts.values():
            _ip("netns", "add", host.netns)
            self._created.append(("netns", host.netns))
            inner = f"{host.veth}n"
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", inner, "netns", host.netns)
            self._created.append(("link", host.veth))
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            _ip("-n", host.netns, "link", "set", inner, "name", "eth0")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{self.netmask}", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "route", "add", "default", "via", self.gateway)

    def close(self) -> None:
        """Stop every process started in a host, then remove what was created, newest first, by name."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        self._procs.clear()
        for kind, name in reversed(self._created):
            if kind == "netns":
                _kill_namespace_processes(name)
                _ip("netns", "delete", name, check=False)
            else:
                _ip("link", "delete", name, check=False)
        self._created.clear()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        Testbed._active = False

    # ---- driving hosts --------------------------------------------------------------------------
    def address(self, name: str) -> str:
        return self.hosts[name].address

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """argv run inside host `name`'s network namespace (same filesystem, same user)."""
        return ["ip", "netns", "exec", self.hosts[name].netns, *map(str, argv)]

    def run(self, name: str, argv: Sequence[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(name, argv), timeout=timeout, capture_output=True, text=True, **kwargs)

    def spawn(self, name: str, argv: Sequence[str], log_path: str | os.PathLike,
              env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None) -> subprocess.Popen:
        """Start a long-running process in host `name` (its own process group, output to `log_path`);
        close() kills it."""
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                self.command(name, argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=None if env is None else {**os.environ, **env}, cwd=cwd, start_new_session=True,
            )
        self._procs.append(proc)
        return proc

    def set_link(self, name: str, up: bool) -> None:
        """Cut (or restore) host `name`'s only link: its processes live on, unreachable, like a pulled cable."""
        _ip("link", "set", self.hosts[name].veth, "up" if up else "down")


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)
