"""`kvpp pool up|down`: a KV pool on this machine for AscendStoreConnector, on loopback and free ports.

The pool's memory is held by the pool's own processes (a standalone Mooncake store client that only
contributes a segment, or the memcache MetaService), never by an engine, so pooled prefixes survive
engine restarts. `up` prints the exact `kv_connector_extra_config` to merge into --kv-transfer-config
and records its processes in a state file (pid, start time, command line); `down` stops exactly
those processes, after checking that each pid still is the process recorded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from kvpp_core.files import read_small_file
from connectors.common.hosts import join_host_port, mooncake_family

from connectors.store.backends.settings import BACKENDS, MemcacheSettings, MooncakeSettings
from connectors.store.settings import StoreSettings, parse_store_settings

from deploy.services.ports import free_port
from deploy.services.processes import (LOOPBACK, ManagedProcess, ProcessError, ProcessIdentity, boot_id, port_open,
                                       stop_recorded)

DEFAULT_STATE_DIR = Path(os.environ.get("KVPP_POOL_DIR", Path.home() / ".cache" / "kvpp" / "pool"))
STATE_FILE = "pool.json"
QUIET_ENV = {"MC_LOG_LEVEL": "ERROR"}


META_LOCK = "/tmp/mmc_meta_service.lock"


class MetaServiceBusy(ProcessError):
    """Another memcache MetaService holds the host-wide lock."""


class PoolInfo(msgspec.Struct, forbid_unknown_fields=True):
    """A running pool; also the state file's schema (a file that does not match is refused)."""

    backend: str
    kv_connector_extra_config: dict
    processes: list[ProcessIdentity]
    boot_id: str
    state_dir: str
    logs: list[str] = []
    mmc_local_config_path: str | None = None
    """memcache: the same settings as a file, for engines configured through $MMC_LOCAL_CONFIG_PATH."""

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @property
    def store_config(self) -> StoreSettings:
        """The connector settings this pool printed, as the connector reads them."""
        return parse_store_settings(self.kv_connector_extra_config)


def _identities(procs: list[ManagedProcess]) -> list[ProcessIdentity]:
    found = [ProcessIdentity.of(p.pid) for p in procs]
    if None in found:
        logs = ", ".join(str(p.log_path) for p in procs)
        raise ProcessError(f"a pool process exited right after starting; see {logs}")
    return found


def _bin(name: str) -> str:
    """A console script of this venv (mooncake_master ships in the Mooncake wheel)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise ValueError(f"{name} not found next to {sys.executable}; pip install mooncake-transfer-engine-non-cuda")
    return str(path)


def _wait_file(proc: ManagedProcess, path: Path, timeout: float) -> None:
    proc._wait(f"{path.name}", path.exists, timeout)


def start_mooncake(state_dir: Path, segment_bytes: int, lease_ttl_ms: int | None = None,
                   client_ttl_s: int | None = None) -> PoolInfo:
    rpc_port, metrics_port = free_port(), free_port()
    argv = [_bin("mooncake_master"), f"--rpc_address={LOOPBACK}", f"--rpc_port={rpc_port}",
            f"--metrics_host={LOOPBACK}", f"--metrics_port={metrics_port}"]
    if lease_ttl_ms is not None:
        argv.append(f"--default_kv_lease_ttl={lease_ttl_ms}")
    if client_ttl_s is not None:
        argv.append(f"--client_ttl={client_ttl_s}")
    master = ManagedProcess("mooncake_master", argv, state_dir / "mooncake_master.log", env=QUIET_ENV).start()
    procs = [master]
    try:
        master.wait_port(LOOPBACK, rpc_port, timeout=30)
        address = f"{LOOPBACK}:{rpc_port}"
        ready = state_dir / "holder.ready"
        ready.unlink(missing_ok=True)
        holder = ManagedProcess(
            "pool-holder",
            [sys.executable, "-m", "deploy.cli.pool_processes", "hold", "--master", address,
             "--segment-bytes", str(segment_bytes), "--ready-file", str(ready)],
            state_dir / "pool_holder.log", env=QUIET_ENV, cwd=Path(__file__).resolve().parents[2],
        ).start()
        procs.append(holder)
        _wait_file(holder, ready, timeout=60)
    except BaseException:
        for p in reversed(procs):
            p.stop()
        raise
    extra = {
        "backend": "mooncake",
        "lookup_rpc_port": free_port(),
        "mooncake": MooncakeSettings(master_server_address=address, protocol="tcp", local_hostname=LOOPBACK).explicit(),
    }
    return PoolInfo("mooncake", extra, _identities(procs), boot_id(), str(state_dir), [str(p.log_path) for p in procs])


def start_memcache(state_dir: Path, dram_size: str = "1GB") -> PoolInfo:
    """The MetaService (one per host). memcache data lives in the clients' local services: each
    engine contributes `dram_size`; a driver-less machine runs lookups only."""
    meta, store, metrics = free_port(), free_port(), free_port()
    proc = ManagedProcess(
        "memcache-meta-service",
        [sys.executable, "-m", "deploy.cli.pool_processes", "meta-service", "--meta-port", str(meta),
         "--config-store-port", str(store), "--metrics-port", str(metrics), "--log-dir", str(state_dir / "mmc")],
        state_dir / "meta_service.log", cwd=Path(__file__).resolve().parents[2],
    ).start()
    try:
        proc.wait_port(LOOPBACK, meta, timeout=30)
        proc.wait_port(LOOPBACK, store, timeout=30)  # clients register through the config store too
    except ProcessError as exc:
        proc.stop()
        if "already running" in proc.log_tail():
            raise MetaServiceBusy(
                f"a memcache MetaService is already running on this host (it holds {META_LOCK}); memcache "
                "allows one per host: stop it, or point the engines at it instead of starting a pool"
            ) from exc
        raise
    except BaseException:
        proc.stop()
        raise
    settings = MemcacheSettings(meta_service_url=f"tcp://{LOOPBACK}:{meta}",
                                config_store_url=f"tcp://{LOOPBACK}:{store}", protocol="host_tcp", dram_size=dram_size)
    conf = state_dir / "mmc-local.conf"
    conf.write_text(
        f"ock.mmc.meta_service_url = {settings.meta_service_url}\n"
        f"ock.mmc.local_service.config_store_url = {settings.config_store_url}\n"
        f"ock.mmc.local_service.protocol = {settings.protocol}\n"
        f"ock.mmc.local_service.dram.size = {dram_size}\n"
        "ock.mmc.log_level = error\n"
    )
    extra = {"backend": "memcache", "lookup_rpc_port": free_port(), "memcache": settings.explicit()}
    return PoolInfo("memcache", extra, _identities([proc]), boot_id(), str(state_dir), [str(proc.log_path)],
                    str(conf))


def pool_up(backend: str, state_dir: Path = DEFAULT_STATE_DIR, segment_bytes: int = 1 << 30,
            **mooncake_timers) -> PoolInfo:
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    state = state_dir / STATE_FILE
    if state.exists() and any(_is_running(p) for p in load_state(state).processes):
        raise ValueError(f"a pool is already running (state {state}); run `kvpp pool down` first")
    info = start_mooncake(state_dir, segment_bytes, **mooncake_timers) if backend == "mooncake" else start_memcache(state_dir)
    tmp = state.with_name(f".{STATE_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(info)))
    tmp.replace(state)
    return info


def load_state(state: Path) -> PoolInfo:
    """The state file `kvpp pool up` wrote; ValueError (one line) for anything else."""
    try:
        info = msgspec.json.decode(read_small_file(state, 1 << 20), type=PoolInfo)
    except FileNotFoundError:
        raise ValueError(f"no pool state at {state}; nothing to stop (was it started with another --state-dir?)"
                         ) from None
    except (OSError, msgspec.DecodeError) as exc:
        raise ValueError(f"{state} is not a pool state file kvpp pool up wrote ({' '.join(str(exc).split())}); "
                         "nothing was signalled: check `ps` for the pool's processes, then remove the file") from None
    if not info.processes:
        raise ValueError(f"{state} lists no processes; remove the file")
    return info


def _is_running(recorded: ProcessIdentity) -> bool:
    return ProcessIdentity.of(recorded.pid) == recorded


def pool_down(state_dir: Path = DEFAULT_STATE_DIR, timeout: float = 10.0) -> list[int]:
    """Stop the recorded pool processes (their process groups), newest first; returns the pids stopped.

    A pid that now belongs to another process (the pool died and the number was reused) is left
    alone with a warning; after a reboot no recorded process can still exist."""
    state = Path(state_dir) / STATE_FILE
    info = load_state(state)
    stopped = []
    same_boot = info.boot_id == boot_id()
    for recorded in reversed(info.processes):
        outcome = stop_recorded(recorded, timeout) if same_boot else "gone"
        if outcome == "stopped":
            stopped.append(recorded.pid)
        elif outcome == "foreign":
            print(f"kvpp: warning: pid {recorded.pid} is no longer the pool's {os.path.basename(recorded.cmdline[0])} "
                  "(the pid was reused); left alone", file=sys.stderr)
    state.unlink()
    return stopped


def serve_mooncake(host: str, port: int, segment_bytes: int, metrics_port: int | None = None,
                   ready_timeout: float = 60.0) -> int:
    """Run a Mooncake pool in the foreground, as rendered deployments do: `mooncake_master` on
    host:port plus a segment holder owning the pool's memory (so pooled prefixes outlive every
    engine). If either process dies the other is stopped and the exit status is non-zero, so a
    supervisor (systemd, Kubernetes) restarts the pool as a whole; SIGTERM stops both."""
    # Its metrics port defaults to a fixed 9003: a second pool on the host would fail to start.
    argv = [_bin("mooncake_master"), f"--rpc_address={host}", f"--rpc_port={port}", f"--metrics_host={host}",
            f"--metrics_port={metrics_port if metrics_port is not None else free_port(host)}"]
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    env = {**os.environ, **QUIET_ENV}
    mooncake_family(host, env)  # the master, the holder and the engines all speak the host's family
    with tempfile.TemporaryDirectory(prefix="kvpp-pool-") as tmp:
        ready = Path(tmp) / "holder.ready"
        procs = [subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent)]
        try:
            deadline = time.monotonic() + ready_timeout
            while not port_open(host, port):
                if stop or procs[0].poll() is not None or time.monotonic() > deadline:
                    print(f"kvpp pool serve: mooncake_master did not listen on {join_host_port(host, port)}",
                          file=sys.stderr)
                    return 1
                time.sleep(0.1)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "deploy.cli.pool_processes", "hold", "--master", join_host_port(host, port),
                 "--segment-bytes", str(segment_bytes), "--ready-file", str(ready), "--host", host],
                env=env, preexec_fn=_die_with_parent, cwd=Path(__file__).resolve().parents[2]))
            while not ready.exists():
                if stop or procs[1].poll() is not None or time.monotonic() > deadline:
                    print("kvpp pool serve: the segment holder did not join the pool", file=sys.stderr)
                    return 1
                time.sleep(0.1)
            print(f"kvpp pool serve: mooncake pool on {join_host_port(host, port)}, {segment_bytes} bytes held "
                  f"(master pid {procs[0].pid}, holder pid {procs[1].pid})", flush=True)
            while not stop:
                dead = [p for p in procs if p.poll() is not None]
                if dead:
                    print(f"kvpp pool serve: pid {dead[0].pid} exited with {dead[0].returncode}; stopping the pool",
                          file=sys.stderr)
                    return 1
                time.sleep(0.2)
            return 0
        finally:
            for proc in reversed(procs):
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _die_with_parent() -> None:
    """Child setup: SIGKILL this process when `kvpp pool serve` dies, however it dies (Linux)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# ---- pool-side processes (run as `python -m deploy.cli.pool_processes hold|meta-service`) ------------
def hold_segment(master: str, segment_bytes: int, ready_file: str, host: str = LOOPBACK) -> int:
    """Contribute `segment_bytes` of this process's memory to the Mooncake pool until SIGTERM; engines
    on other hosts read it at `host`."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(host, "P2PHANDSHAKE", segment_bytes, 0, "tcp", "", master)
    if rc != 0:
        print(f"pool holder: setup against {master} failed with {rc}", file=sys.stderr)
        return 1
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    Path(ready_file).write_text(str(os.getpid()))
    while not stop:
        time.sleep(0.2)
    store.close()
    return 0


def meta_service(meta_port: int, config_store_port: int, metrics_port: int, log_dir: str) -> int:
    """Run the memcache MetaService on loopback (blocking)."""
    import memcache_hybrid

    cfg = memcache_hybrid.MetaConfig()
    cfg.meta_service_url = f"tcp://{LOOPBACK}:{meta_port}"
    cfg.config_store_url = f"tcp://{LOOPBACK}:{config_store_port}"
    cfg.metrics_url = f"http://{LOOPBACK}:{metrics_port}"
    cfg.log_level = "error"
    cfg.log_path = log_dir
    if memcache_hybrid.MetaService.setup(cfg) != 0:
        print("memcache MetaService setup failed", file=sys.stderr)
        return 1
    return memcache_hybrid.MetaService.main()
