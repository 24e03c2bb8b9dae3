"""`kvpp pool serve`, the pool that rendered deployments start: mooncake_master plus a segment holder,
supervised in the foreground. Real processes on loopback: what an engine pooled outlives the engine,
the pool stops as a whole when one of its processes dies, and SIGTERM leaves nothing behind. `kvpp pool
down` signals a recorded pid only while it is still the process recorded (same start time and command
line): a reused pid, a foreign or corrupt state file never gets anyone killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from deploy.cli.main import main
from deploy.services.pool import STATE_FILE, PoolInfo, pool_down
from deploy.services.ports import free_port
from deploy.services.processes import ProcessIdentity, boot_id, running
from tests.helpers.paths import REPO

pytestmark = pytest.mark.integration

ENV = {**os.environ, "PYTHONPATH": str(REPO), "MC_LOG_LEVEL": "ERROR", "MC_STORE_CLIENT_SETUP_RETRIES": "1"}
# An engine-like client: it contributes no segment (global_segment_size 0), as the pool connector's default.
CLIENT = """
import sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", sys.argv[1]) == 0
if sys.argv[2] == "put":
    assert store.put("prefix-block-0", b"kv" * 4096) == 0
else:
    print(len(store.get("prefix-block-0")))
store.close()
"""


def client(address: str, op: str) -> str:
    out = subprocess.run([sys.executable, "-c", CLIENT, address, op], env=ENV, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


@pytest.fixture
def pool():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli.main", "pool", "serve", "--host", "127.0.0.1", "--port",
                             str(port), "--segment-size", "64MB"], env=ENV, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    line = proc.stdout.readline()
    assert "mooncake pool on 127.0.0.1" in line, line
    yield proc, f"127.0.0.1:{port}"
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_what_an_engine_pooled_outlives_the_engine(pool):
    _, address = pool
    client(address, "put")  # the writer exits here, as a restarted engine would
    assert client(address, "get") == str(2 * 4096)


def test_the_pool_stops_as_a_whole_when_a_process_dies_and_on_sigterm(pool):
    proc, address = pool
    master, holder = sorted(children(proc.pid))
    os.kill(holder, signal.SIGKILL)
    assert proc.wait(timeout=30) == 1, "the pool kept serving without its memory"
    deadline = time.monotonic() + 15
    while alive(master) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(master), "mooncake_master outlived its pool"


def test_sigterm_stops_master_and_holder(pool):
    proc, _ = pool
    kids = children(proc.pid)
    assert len(kids) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not any(alive(pid) for pid in kids)


def test_killing_the_supervisor_alone_takes_its_processes_with_it(pool):
    proc, _ = pool
    kids = children(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # the process only, not its group: no cleanup code runs
    proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in kids), "master or holder outlived a SIGKILLed pool"


# The pool connector's own backend (typed settings, Mooncake put in IPv6 mode for its IPv6 host).
BACKEND_CLIENT = """
import sys, torch
from connectors.store.backends import Status, open_backend
from connectors.store.settings import parse_store_settings
cfg = parse_store_settings({"backend": "mooncake", "lookup_rpc_port": 1,
                            "mooncake": {"master_server_address": sys.argv[1], "local_hostname": "::1"}})
b = open_backend(cfg, call_timeout_s=10)
t = torch.arange(4096, dtype=torch.float32) if sys.argv[2] == "put" else torch.zeros(4096)
b.register(t.data_ptr(), t.numel() * 4)
op = b.put if sys.argv[2] == "put" else b.get
print(op(["ipv6-block"], [[t.data_ptr()]], [[t.numel() * 4]]) == [Status.OK], float(t.sum()))
b.close()
"""


def test_an_ipv6_pool_serves_engines_on_bracketed_addresses():
    """`kvpp pool serve --host ::1` (as a spec with an IPv6 pool address renders it): master, holder and
    the pool connector's backend in other processes meet at [::1]:port, Mooncake in IPv6 mode."""
    port = free_port("::1")
    env = {k: v for k, v in ENV.items() if k != "MC_USE_IPV6"}
    proc = subprocess.Popen([sys.executable, "-m", "deploy.cli.main", "pool", "serve", "--host", "::1", "--port", str(port),
                             "--segment-size", "64MB"], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert f"mooncake pool on [::1]:{port}" in line, line
        results = []
        for op in ("put", "get"):  # two processes: the reader finds what the writer pooled in the holder
            out = subprocess.run([sys.executable, "-c", BACKEND_CLIENT, f"[::1]:{port}", op], env=env,
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr[-2000:]
            results.append(out.stdout.split())
        assert results == [["True", str(float(sum(range(4096))))]] * 2
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture
def sleepers():
    started = []

    def start(seconds: int) -> subprocess.Popen:
        proc = subprocess.Popen(["sleep", str(seconds)], start_new_session=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def identity(pid: int) -> ProcessIdentity:
    """`pid`'s identity once its exec has finished (the command line is empty until then)."""
    deadline = time.monotonic() + 10
    while (found := ProcessIdentity.of(pid)) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return found


def write_state(state_dir, processes) -> None:
    info = PoolInfo("mooncake", {"backend": "mooncake"}, processes, boot_id(), str(state_dir))
    (state_dir / STATE_FILE).write_bytes(msgspec.json.encode(info))


def test_a_reused_pid_is_left_alone(tmp_path, sleepers, capsys):
    pool = sleepers(600)
    recorded = identity(pool.pid)
    pool.kill()
    pool.wait()
    other = sleepers(601)  # the state file now points at another process, as after pid reuse
    write_state(tmp_path, [ProcessIdentity(other.pid, recorded.start_ticks, recorded.cmdline)])
    assert main(["pool", "down", "--state-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert f"pid {other.pid} is no longer the pool's sleep" in err and "left alone" in err
    assert running(other.pid) and not (tmp_path / STATE_FILE).exists()


def test_same_pid_and_start_time_but_another_command_is_left_alone(tmp_path, sleepers):
    other = sleepers(600)
    actual = identity(other.pid)
    write_state(tmp_path, [ProcessIdentity(other.pid, actual.start_ticks, ["mooncake_master", "--rpc_port=1"])])
    assert pool_down(tmp_path) == []
    assert running(other.pid)


def test_the_recorded_process_and_its_group_are_stopped(tmp_path):
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                               "subprocess.Popen(['sleep', '600']); time.sleep(600)"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(members := _group_members(leader.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        child = next(p for p in members if p != leader.pid)
        write_state(tmp_path, [identity(leader.pid)])
        assert pool_down(tmp_path, timeout=5) == [leader.pid]
        assert leader.poll() is not None and not running(child)
    finally:
        leader.kill()
        leader.wait()


def _group_members(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.parametrize("content", [
    b"{garbage", b"[]", b"", b"\xff\xfe",
    json.dumps({"pids": [0, -1]}).encode(),  # the old format: bare pids, kill(-1) would hit every process
    json.dumps({"backend": "mooncake", "kv_connector_extra_config": {}, "processes": [
        {"pid": 1, "start_ticks": 0, "cmdline": ["init"]}], "boot_id": "x", "state_dir": "s"}).encode(),
])
def test_corrupt_or_foreign_state_is_one_error_line(tmp_path, sleepers, capsys, content):
    bystander = sleepers(600)
    (tmp_path / STATE_FILE).write_bytes(content)
    assert main(["pool", "down", "--state-dir", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpp: error: ") and "nothing was signalled" in lines[0]
    assert running(bystander.pid) and (tmp_path / STATE_FILE).exists()


def test_old_format_pointing_at_a_live_process_is_refused(tmp_path, sleepers, capsys):
    bystander = sleepers(600)
    (tmp_path / STATE_FILE).write_text(json.dumps({"pids": [bystander.pid]}))
    assert main(["pool", "down", "--state-dir", str(tmp_path)]) == 2
    assert "not a pool state file kvpp pool up wrote" in capsys.readouterr().err
    assert running(bystander.pid)
