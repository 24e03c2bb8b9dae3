"""`kvpp pool down` signals a recorded pid only while it is still the process recorded (same start
time and command line): a reused pid, a foreign or corrupt state file never gets anyone killed."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import msgspec
import pytest

from deploy.cli.main import main
from deploy.services.pool import STATE_FILE, PoolInfo, pool_down
from deploy.services.processes import ProcessIdentity, boot_id, running

pytestmark = pytest.mark.integration


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
