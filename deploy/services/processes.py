"""Managed child processes (servers, vLLM engines of a spec instance) for tests, the demo and `kvpp pool up`.

Each process runs in its own process group with its output in a log file, so that stopping it also
stops whatever it spawned (vLLM engine cores, TP workers) and a failure can be explained from the log
tail instead of a bare timeout.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from kvpp_core.cpu_backends import AMX_MLA, CPU_ATTN, CPU_MLA, CpuKernel, host_has_amx
from kvpp_core.platforms import VLLM_CPU

from connectors.common.hosts import host_url

from deploy.deployment.launch import ConfigFile
from deploy.deployment.resolved import ResolvedInstance, resolve
from deploy.deployment.spec import InstanceSettings, Memory, Model, Spec, placed
from deploy.services.ports import LOOPBACK

# A wait longer than this prints progress lines, so a slow engine start does not look like a hang.
PROGRESS_AFTER_S = 5.0
PROGRESS_EVERY_S = 10.0


class ProcessError(RuntimeError):
    """A managed process died or did not become ready; the message carries its log tail."""


PID = Annotated[int, msgspec.Meta(gt=1, le=1 << 22)]  # never 0, 1 or negative: kill(2) reads those as groups


class ProcessIdentity(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Who a pid is: its start time (clock ticks after boot, /proc/PID/stat field 22) and command
    line. A pid recorded in a file is signalled only while both still match, because pids are
    reused: a stale file must not make `kvpp pool down` kill whatever process got the number."""

    pid: PID
    start_ticks: Annotated[int, msgspec.Meta(ge=0)]
    cmdline: Annotated[list[str], msgspec.Meta(min_length=1)]

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """The identity of process `pid`; None when there is none, or it has no command line (a
        zombie, or a process in the middle of exec)."""
        stat = _proc_stat(pid)
        if stat is None:
            return None
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            return None
        argv = [os.fsdecode(a) for a in raw.split(b"\0")[:-1]]
        return cls(pid, stat.start_ticks, argv) if argv else None


class _Stat(msgspec.Struct, frozen=True):
    state: str
    pgrp: int
    start_ticks: int


def _proc_stat(pid: int) -> _Stat | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name in parentheses may hold anything
    return _Stat(state=fields[0], pgrp=int(fields[2]), start_ticks=int(fields[19]))


def running(pid: int) -> bool:
    """True while `pid` exists and has not exited (a zombie waiting to be reaped has exited)."""
    stat = _proc_stat(pid)
    return stat is not None and stat.state not in ("Z", "X")


def boot_id() -> str:
    """This boot's id: start times count from boot, so they compare only within one boot."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def stop_recorded(recorded: ProcessIdentity, timeout: float = 10.0) -> str:
    """Stop a process recorded earlier, with its process group, if it is still that process.

    Returns "stopped", "gone" (it had exited) or "foreign" (the pid now belongs to another process,
    which is left alone). A pidfd pins the process while its identity is compared and signalled.
    """
    try:
        pidfd = os.pidfd_open(recorded.pid)
    except ProcessLookupError:
        return "gone"
    try:
        stat = _proc_stat(recorded.pid)
        if stat is None:
            return "gone"
        if stat.state in ("Z", "X"):
            if stat.start_ticks == recorded.start_ticks:
                _reap(recorded.pid)
            return "gone"
        if ProcessIdentity.of(recorded.pid) != recorded:
            return "foreign"
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                if stat.pgrp == recorded.pid:  # a group leader (start_new_session): the group goes too
                    os.killpg(recorded.pid, sig)
                else:
                    signal.pidfd_send_signal(pidfd, sig)
            except ProcessLookupError:  # exited (and its group emptied) just now
                break
            if select.select([pidfd], [], [], timeout)[0]:  # readable once the process has exited
                break
        _reap(recorded.pid)
        kill_strays(recorded.pid)
        return "stopped"
    finally:
        os.close(pidfd)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child: its parent (or init) reaps it
        pass


def kill_strays(pgid: int, timeout: float = 5.0) -> None:
    """SIGKILL what is left of process group `pgid` after its leader was reaped, and wait (bounded)
    until it has exited.

    Only members other than the leader count: while one exists the kernel cannot hand the number
    `pgid` to a new process, so a member found here belongs to the original group (unless all had
    exited and the pid space wrapped around within this instant)."""
    deadline = time.monotonic() + timeout
    while (strays := _group_members(pgid)) and time.monotonic() < deadline:
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _group_members(pgid: int) -> list[int]:
    """Running members of group `pgid` other than its leader."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != pgid:
            stat = _proc_stat(int(entry))
            if stat is not None and stat.pgrp == pgid and stat.state not in ("Z", "X"):
                members.append(int(entry))
    return members


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def run_in_group(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run(capture_output=True, text=True)` in a process group of its own.

    On a timeout or an interrupt the whole group is stopped (SIGTERM, then SIGKILL), so a vLLM engine
    core or TP worker the child spawned cannot outlive it as an orphan eating the machine's cores.
    """
    proc = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=None if env is None else dict(env),
                            cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(20)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        raise
    finally:
        kill_strays(proc.pid)  # leftovers that outlived the (reaped) leader
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class ManagedProcess:
    """One child process in its own group, logging to `log_path`; stop() ends the whole group."""

    def __init__(self, name: str, argv: Sequence[str], log_path: str | os.PathLike,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None):
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> ManagedProcess:
        if self.proc is not None:
            raise ProcessError(f"{self.name} already started (pid {self.proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env} if self.env is not None else None
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd=self.cwd, start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise ProcessError(f"{self.name} was not started")
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the group, then SIGKILL after `timeout`; returns the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            # Until we reap it the leader holds its pid, so the group id names our group.
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(timeout)
        # Children that outlived the leader (e.g. engine cores) still share the group id.
        kill_strays(self.proc.pid)
        return self.proc.returncode

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # group id == leader pid (start_new_session)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ManagedProcess:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- readiness -------------------------------------------------------------------------------
    def log_tail(self, lines: int = 30) -> str:
        """The log's last lines, preceded by its distinct error lines (the root cause is often earlier)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        tail = text[-lines:]
        errors = list(dict.fromkeys(ln for ln in text[:-lines] if "Error:" in ln or "ERROR" in ln))[-5:]
        return "\n".join([*errors, "...", *tail] if errors else tail)

    def _check_alive(self, waiting_for: str) -> None:
        if self.proc is None:
            raise ProcessError(f"{self.name} was not started")
        code = self.proc.poll()
        if code is not None:
            raise ProcessError(
                f"{self.name} (pid {self.proc.pid}) exited with code {code} while waiting for "
                f"{waiting_for}; last lines of {self.log_path}:\n{self.log_tail()}"
            )

    def _wait(self, what: str, ready, timeout: float, interval: float = 0.25) -> None:
        start = time.monotonic()
        next_progress = start + PROGRESS_AFTER_S
        while True:
            self._check_alive(what)
            if ready():
                return
            now = time.monotonic()
            if now - start > timeout:
                raise ProcessError(
                    f"{self.name} (pid {self.proc.pid}) not ready after {timeout:.0f} s waiting for "
                    f"{what}; last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if now >= next_progress:
                print(f"[kvpp] waiting for {self.name} ({what}): {now - start:.0f} s", file=sys.stderr,
                      flush=True)
                next_progress = now + PROGRESS_EVERY_S
            time.sleep(interval)

    def wait_port(self, host: str, port: int, timeout: float = 60.0) -> None:
        self._wait(f"{host}:{port} to accept connections", lambda: port_open(host, port), timeout)

    def wait_http(self, url: str, timeout: float = 60.0) -> None:
        """Wait until GET `url` answers 200."""
        self._wait(f"{url} to answer 200", lambda: http_ok(url), timeout)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def cpu_bind(tp: int, cores: Sequence[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` ranks: one core per rank ("0|1"), all cores for TP=1."""
    cores = list(cores) if cores is not None else sorted(os.sched_getaffinity(0))
    if tp == 1:
        return ",".join(map(str, cores)) if len(cores) > 1 else str(cores[0])
    if tp > len(cores):
        raise ValueError(f"tp={tp} needs {tp} CPU cores for VLLM_CPU_OMP_THREADS_BIND, have {len(cores)}")
    return "|".join(str(cores[r]) for r in range(tp))


REFERENCE_ROPE = {"custom_ops": ["-rotary_embedding"]}
"""The pure-PyTorch RoPE: vllm-cpu 0.32.0's CPU custom op is wrong on DeepSeek's strided views."""


@dataclass(frozen=True)
class CpuEngine:
    """The kernel, dtype and block size of the project's CPU engines, named on every engine it starts: vllm-cpu
    otherwise picks its kernel by the host (AMX_MLA wherever AMX tiles exist), and AMX_MLA refuses fp32."""

    kernel: CpuKernel
    dtype: str
    block: int | None = None
    """The block size named on every engine; None: the kernel's default."""

    @property
    def block_size(self) -> int:
        return self.block or self.kernel.default_block_size

    def mtp_config(self, num_speculative_tokens: int) -> dict:
        """`speculative_config` for MTP: vLLM 0.32's drafter picks its kernel apart from the target's, so it is
        named there as well."""
        return {"method": "mtp", "num_speculative_tokens": num_speculative_tokens,
                "attention_backend": self.kernel.name}

    def engine_args(self, mtp: int = 0) -> dict:
        """`LLM`/`EngineArgs` keywords: kernel, dtype, block size, the PyTorch RoPE, and MTP if `mtp` > 0."""
        return {"dtype": self.dtype, "attention_backend": self.kernel.name, "block_size": self.block_size,
                "compilation_config": REFERENCE_ROPE, **({"speculative_config": self.mtp_config(mtp)} if mtp else {})}

    def serve_args(self) -> tuple[str, ...]:
        """The same as `vllm serve` flags (the block size goes in the instance's memory.block_size)."""
        return ("--dtype", self.dtype, "--attention-backend", self.kernel.name,
                "--compilation-config", json.dumps(REFERENCE_ROPE))


REFERENCE = CpuEngine(CPU_MLA, "float32")
"""Exact runs on any host: fp32 on the reference kernel (block size 16), where vLLM's outputs equal transformers'."""
AMX = CpuEngine(AMX_MLA, "bfloat16")
"""What vllm-cpu serves MLA models with on a CPU with AMX: bf16 on AMX_MLA (block size 128), prefix cache on."""


GQA = CpuEngine(CPU_ATTN, "float32", block=32)
"""GQA models on vLLM's CPU attention kernel, on any x86 host: fp32 (exact), vLLM's prefix cache and chunked prefill
on, block size 32 (the kernel's multiple, small enough that the tiny model's short prompts fill several blocks)."""


CPU_ENGINES = {engine.kernel.name: engine for engine in (REFERENCE, AMX, GQA)}


def host_engine() -> CpuEngine:
    """The engine a user of this host runs: AMX where the CPU has AMX tiles, else the reference kernel."""
    return AMX if host_has_amx() else REFERENCE


def cpu_instance(name: str, host: str, port: int, tp: int = 1, cores: Sequence[int] | None = None,
                 kv_cache_bytes: int = 128 << 20, max_model_len: int = 2048, log_stats: bool = False,
                 env: Mapping[str, str] | None = None, extra_args: Sequence[str] = (),
                 engine: CpuEngine = REFERENCE, **settings) -> InstanceSettings:
    """An instance of vllm-cpu 0.32.0 that starts fast here: `engine`'s kernel, dtype and block size (default
    the exact reference), eager, a small KV budget, one core per TP rank; `settings` are further instance keys
    (kv_port, enable_kvpp, kv_transfer_config, ...)."""
    return InstanceSettings(
        name=name, hosts=(host,), port=port, tp=tp, enforce_eager=True,
        memory=Memory(kv_cache_memory_bytes=kv_cache_bytes, max_model_len=max_model_len, block_size=engine.block_size),
        # Stats feed /metrics (connector counters); off by default to keep logs short.
        extra_args=(*engine.serve_args(), *([] if log_stats else ["--disable-log-stats"]), *extra_args),
        env={"VLLM_CPU_OMP_THREADS_BIND": cpu_bind(tp, cores), "TOKENIZERS_PARALLELISM": "false", **(env or {})},
        **settings)


def single_instance(model: str | os.PathLike, inst: InstanceSettings) -> ResolvedInstance:
    """One instance serving `model` alone (no P/D, no pool), resolved."""
    return resolve(placed(Spec(model=Model(path=str(model)), prefill=(inst,), platform=VLLM_CPU.name))).instances[0]


class Engine(ManagedProcess):
    """One resolved instance on this machine, started with the argv and environment that `kvpp render
    --launcher api-server` writes for it, run by this interpreter and listening on its host only. The
    rendered pool config files it names are written to `config_dir` (default: the log's folder)."""

    def __init__(self, resolved: ResolvedInstance, log_path: str | os.PathLike,
                 config_dir: str | os.PathLike | None = None):
        self.resolved = resolved
        node = resolved.nodes[0]
        self.host, self.port = node.host, resolved.instance.port
        env = node.env
        if resolved.config_files:
            config_dir = Path(config_dir or Path(log_path).parent)
            config_dir.mkdir(parents=True, exist_ok=True)
            for file, text in resolved.config_files.items():
                (config_dir / file).write_text(text)
            env = {k: str(config_dir / v.file) if isinstance(v, ConfigFile) else v for k, v in env.items()}
        argv = resolved.serve_command(0, "api-server", python=sys.executable, listen=self.host)
        super().__init__(resolved.instance.name, argv, log_path, env=env)

    @property
    def url(self) -> str:
        return host_url("http", self.host, self.port)

    @property
    def kv_events(self) -> tuple[str, str] | None:
        """Where a front reads this instance's KV cache events: (live, replay) endpoints; None if it publishes none."""
        inst = self.resolved.instance
        if not inst.kv_events:
            return None
        return host_url("tcp", self.host, inst.kv_events_port), host_url("tcp", self.host, inst.events_replay_port)

    def wait_ready(self, timeout: float = 300.0) -> Engine:
        self.wait_http(f"{self.url}/health", timeout)
        return self


class VllmServer(Engine):
    """An engine of one cpu_instance, without connectors of its own (`extra_args` may add them)."""

    def __init__(self, name: str, model: str | os.PathLike, port: int, log_path: str | os.PathLike,
                 tp: int = 1, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 kv_cache_bytes: int = 128 << 20, max_model_len: int = 2048, host: str = LOOPBACK,
                 cores: Sequence[int] | None = None, log_stats: bool = False, engine: CpuEngine = REFERENCE):
        inst = cpu_instance(name, host, port, tp, cores, kv_cache_bytes, max_model_len, log_stats, env, extra_args,
                            engine)
        super().__init__(single_instance(model, inst), log_path)


def start_servers(servers: Sequence[Engine], started: list[ManagedProcess], timeout: float) -> None:
    """Start every server, then wait for each, so engines load side by side. Each is added to `started`
    as soon as it runs, so the caller's cleanup stops it even when another one fails to come up."""
    for server in servers:
        started.append(server.start())
    for server in servers:
        server.wait_ready(timeout)
