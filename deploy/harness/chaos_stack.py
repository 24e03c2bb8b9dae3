"""The processes `kvpp chaos` injects faults into, and the local stack it starts.

Each member can be killed and restarted exactly as it was started (same command line, ports and
environment, so clients and peers find it again), or stalled with SIGSTOP and resumed, always as a
whole process group (an engine's API server, engine core and TP workers stall or die together).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deploy.deployment.launch import kv_events_flags
from deploy.harness.engines import engine_server, pd_servers
from deploy.harness.routers import start_vllm_router
from deploy.services.pool import QUIET_ENV, start_mooncake
from deploy.services.processes import LOOPBACK, Engine, ManagedProcess, ProcessError, start_servers
from deploy.services.proxy import start_proxy

ENGINE_READY_S = 600.0
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class StackSettings:
    """Timers of the stack under test, short enough that a dead or stalled part costs seconds (the pool's calls
    keep the connector's own short bounds: the run checks what a user gets)."""
    hold_timeout_s: float = 20.0
    """Prefill: how long blocks wait for a decode that never pulls (it died, or the request moved on)."""
    stall_timeout_s: float = 2.0
    """Decode: a pull from a stalled prefill that lands nothing for this long is given up, and the prompt is
    recomputed (the connector's default)."""
    transfer_timeout_s: float = 5.0
    """Decode: Mooncake's bound on a failed pull's reads over a transport without a progress timeout (the stack runs
    tcp, whose progress timeout bounds them)."""
    prefill_timeout_s: float = 20.0
    """Proxy: a prefill silent this long is given up (the request goes to a decode alone)."""
    read_timeout_s: float = 20.0
    """Proxy: longest silence of an answer; longer than a stall, so stalled streams resume."""
    cache_aware: bool = False
    """The prefill publishes its KV cache events and `kvpp proxy` picks prefills by them (--kv-events): its event
    stream dies and comes back with every prefill kill, stall and restart."""

    def proxy_args(self, events: list[tuple[str, str]]) -> list[str]:
        """`kvpp proxy`'s timers, and the prefills' (live, replay) event endpoints if they publish any (cache_aware)."""
        return ["--prefill-timeout", str(self.prefill_timeout_s), "--decode-timeout", str(self.read_timeout_s),
                "--connect-timeout", "3", "--probe-interval", "1", *(kv_events_flags(events) if events else [])]

    def router_args(self) -> list[str]:
        """vllm-router probes its instances' /health as often as the proxy does; everything else is its
        own default (it has no per-leg timeouts, and in its P/D mode failed requests feed no circuit
        breaker: only failed probes take an instance out)."""
        return ["--health-check-interval-secs", "1"]


class Member:
    """One process of the stack, by process group."""

    def __init__(self, name: str, pid: int, argv: list[str], log_path: Path, env: dict | None, cwd: Path | None,
                 ready: Callable[[ManagedProcess], None], proc: ManagedProcess | None = None):
        self.name, self.pid, self.argv, self.log_path = name, pid, argv, log_path
        self.env, self.cwd, self.ready, self.proc = env, cwd, ready, proc
        self.restarts = 0
        self.pool_extra: dict = {}

    @classmethod
    def of(cls, proc: ManagedProcess, ready: Callable[[ManagedProcess], None]) -> Member:
        return cls(proc.name, proc.pid, proc.argv, proc.log_path, proc.env, proc.cwd, ready, proc)

    @classmethod
    def adopt(cls, name: str, pid: int, log_path: Path, env: dict | None, cwd: Path | None,
              ready: Callable[[ManagedProcess], None]) -> Member:
        """A process started elsewhere (the pool's), restartable from its own command line."""
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        return cls(name, pid, [a.decode() for a in argv], log_path, env, cwd, ready)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)  # every member leads its own session: group id == pid
        except ProcessLookupError:
            pass

    def kill(self, timeout: float = 30.0) -> None:
        self.signal(signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while self._alive() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _alive(self) -> bool:
        if self.proc is not None:
            return self.proc.alive()
        try:
            return os.waitpid(self.pid, os.WNOHANG)[0] == 0
        except ChildProcessError:  # already reaped
            return False

    def restart(self) -> None:
        """Start it again as it was, and wait until it serves."""
        self.proc = ManagedProcess(self.name, self.argv, self.log_path, env=self.env, cwd=self.cwd).start()
        self.pid = self.proc.pid
        self.restarts += 1
        self.ready(self.proc)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)  # a stalled process cannot act on SIGTERM
        if self.proc is not None:
            self.proc.stop()
        else:
            self.signal(signal.SIGTERM)
            self.kill(timeout=10)


@dataclass
class Stack:
    members: dict[str, Member] = field(default_factory=dict)
    engines: dict[str, str] = field(default_factory=dict)
    """Engine role -> base URL, whose /metrics the harness checks."""
    proxy_url: str = ""
    front: str = "kvpp-proxy"
    """Which P/D front serves proxy_url: kvpp-proxy or vllm-router."""
    front_metrics_url: str = ""
    """Where the front's Prometheus metrics are (proxy_url for kvpp proxy; vllm-router has a port of its own)."""
    events: list[tuple[str, str]] = field(default_factory=list)
    """The prefills' KV event endpoints (StackSettings.cache_aware)."""

    def stop(self) -> None:
        for member in reversed(list(self.members.values())):
            member.stop()


def _http_ready(url: str, timeout: float) -> Callable[[ManagedProcess], None]:
    return lambda proc: proc.wait_http(f"{url}/health", timeout)


def _arg(argv: list[str], flag: str) -> str:
    return next(a.split("=", 1)[1] for a in argv if a.startswith(f"{flag}="))


def _holder_ready(proc: ManagedProcess) -> None:
    ready = Path(proc.argv[proc.argv.index("--ready-file") + 1])
    ready.unlink(missing_ok=True)  # left by the previous incarnation
    proc._wait(ready.name, ready.exists, 60)


def reference_answers(model: str, workdir: Path, ask: Callable[[str], dict]) -> dict:
    """Answers of a colocated engine (TP=2, KVPP off, no connector), computed before the stack starts
    and then stopped, so at most two engines ever run at once."""
    reference = engine_server("reference", model, workdir, 2, [0, 1], [])
    try:
        start_servers((reference,), [], timeout=ENGINE_READY_S)
        return ask(reference.url)
    finally:
        reference.stop()


def adopt_pool(state_dir: Path) -> dict[str, Member]:
    """A `kvpp pool up`-style Mooncake pool whose master and segment holder can be killed and restarted;
    its connector settings are in the members' `pool_extra`."""
    pool = start_mooncake(state_dir, segment_bytes=256 << 20)
    members = {}
    for name, pid, log in zip(("pool_master", "pool_holder"), pool.pids, pool.logs):
        member = Member.adopt(name, pid, Path(log), QUIET_ENV, REPO_ROOT if name == "pool_holder" else None,
                              _holder_ready)
        if name == "pool_master":
            port = int(_arg(member.argv, "--rpc_port"))
            member.ready = lambda proc: proc.wait_port(LOOPBACK, port, timeout=30)  # noqa: B023
        member.pool_extra = pool.kv_connector_extra_config
        members[name] = member
    return members


def start_local_stack(model: str, workdir: Path, settings: StackSettings, front: str = "kvpp-proxy") -> Stack:
    """Mooncake pool (master + segment holder), prefill TP=2 with KVPP and a MultiConnector of
    MooncakeConnectorV2 and the pool, decode TP=1, and the P/D front (`kvpp proxy` or vllm-router), on
    loopback and free ports."""
    stack = Stack()
    try:
        stack.members.update(adopt_pool(workdir / "pool"))
        servers: tuple[Engine, Engine] = pd_servers(
            model, workdir, stack.members["pool_master"].pool_extra,
            producer_extra={"hold_timeout_s": settings.hold_timeout_s},
            consumer_extra={"stall_timeout_s": settings.stall_timeout_s,
                            "transfer_timeout_s": settings.transfer_timeout_s},
            kv_events=settings.cache_aware)
        stack.events = [servers[0].kv_events] if settings.cache_aware else []
        started: list[ManagedProcess] = []
        try:
            start_servers(servers, started, timeout=ENGINE_READY_S)
        finally:
            for server in started:
                stack.members[server.name] = Member.of(server, _http_ready(server.url, ENGINE_READY_S))
        for server in servers:
            stack.engines[server.name] = server.url
        start_front(stack, front, workdir, settings)
    except BaseException:
        stack.stop()
        raise
    return stack


def start_front(stack: Stack, front: str, workdir: Path, settings: StackSettings) -> None:
    """Put `front` (kvpp-proxy or vllm-router) in front of the stack's engines, replacing the one there."""
    if "proxy" in stack.members:
        stack.members.pop("proxy").stop()
    prefill, decode = [stack.engines["prefill"]], [stack.engines["decode"]]
    if front == "vllm-router":
        proc, stack.proxy_url, stack.front_metrics_url = start_vllm_router(
            prefill, decode, workdir / "vllm-router.log", extra_args=settings.router_args())
    else:
        proc, stack.proxy_url = start_proxy(prefill, decode, workdir / "proxy.log",
                                            extra_args=settings.proxy_args(stack.events))
        stack.front_metrics_url = stack.proxy_url
    stack.front = front
    stack.members["proxy"] = Member.of(proc, _http_ready(stack.proxy_url, 60))


def inject(member: Member, kind: str, down_s: float, stack: Stack) -> float:
    """One fault, blocking until it is over: `kill` (SIGKILL, `down_s` dead, restart, serving again)
    or `stop` (SIGSTOP for `down_s`, then SIGCONT). Returns when (time.monotonic) the member was down:
    dead, or stopped."""
    if kind == "stop":
        member.signal(signal.SIGSTOP)
        down = time.monotonic()
        time.sleep(down_s)
        member.signal(signal.SIGCONT)
        return down
    member.kill()
    down = time.monotonic()
    time.sleep(down_s)
    restart(member, stack)
    return down


def restart(member: Member, stack: Stack) -> None:
    """Bring a killed member back as it was; a new pool master needs its segment holder again."""
    try:
        member.restart()
    except ProcessError as exc:
        raise ProcessError(f"restarting {member.name} after SIGKILL failed: {exc}") from None
    if member.name == "pool_master":
        # A new master knows no segment: the holder must register its memory again.
        holder = stack.members["pool_holder"]
        holder.kill()
        holder.restart()


def progress(message: str) -> None:
    print(f"[kvpp chaos] {message}", file=sys.stderr, flush=True)
