"""Managed processes: readiness waits, fail-fast on death with the log tail, group-wide stop."""

import ast
import os
import sys
import time
from pathlib import Path

import pytest

from deploy.services.ports import free_port
from deploy.services.processes import ManagedProcess, ProcessError, VllmServer, cpu_bind, port_open


@pytest.mark.unit
def test_cpu_bind_one_core_per_tp_rank():
    assert cpu_bind(2, cores=[0, 1]) == "0|1"
    assert cpu_bind(1, cores=[0, 1]) == "0,1"
    assert cpu_bind(1, cores=[3]) == "3"
    with pytest.raises(ValueError, match="tp=4 needs 4 CPU cores"):
        cpu_bind(4, cores=[0, 1])


@pytest.mark.unit
def test_vllm_server_command_line_carries_cpu_settings(tmp_path):
    srv = VllmServer("p", "/m", 8100, tmp_path / "log", tp=2, cores=[0, 1],
                     extra_args=["--kv-transfer-config", "{}"], env={"X": "1"})
    argv = srv.argv
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(argv, argv[1:]))
    assert pairs["--model"] == "/m" and pairs["--port"] == "8100" and pairs["--host"] == "127.0.0.1"
    assert pairs["--tensor-parallel-size"] == "2" and pairs["--dtype"] == "float32"
    assert pairs["--block-size"] == "16" and "--enforce-eager" in argv and pairs["--attention-backend"] == "CPU_MLA"
    assert pairs["--compilation-config"] == '{"custom_ops": ["-rotary_embedding"]}'
    assert argv[-2:] == ["--kv-transfer-config", "{}"]
    assert srv.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and srv.env["X"] == "1"
    assert srv.url == "http://127.0.0.1:8100" and "--disable-log-stats" in argv
    assert "--disable-log-stats" not in VllmServer("q", "/m", 1, tmp_path / "l", log_stats=True).argv


@pytest.mark.unit
def test_every_engine_the_project_builds_names_its_attention_backend():
    """vllm-cpu picks AMX_MLA on a host with AMX, which refuses the fp32 weights of the reference runs: every
    `LLM(...)` / `EngineArgs(...)` in the project passes `attention_backend` (by name, or in `**` keywords such
    as `REFERENCE.engine_args()`), so no engine depends on which CPU the host has."""
    root = Path(__file__).resolve().parents[3]
    unpinned = []
    for path in root.glob("*/**/*.py"):
        if path.parts[len(root.parts)] in {".venv", ".git"}:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in {"LLM", "EngineArgs"}
                    and not any(k.arg in {None, "attention_backend"} for k in node.keywords)):
                unpinned.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not unpinned, f"engines without attention_backend: {unpinned}"


@pytest.mark.unit
def test_log_tail_puts_early_error_lines_before_the_tail(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("ValueError: root cause\n" + "".join(f"line {i}\n" for i in range(50)))
    tail = ManagedProcess("x", ["true"], log).log_tail(lines=5)
    assert tail.splitlines() == ["ValueError: root cause", "...", *[f"line {i}" for i in range(45, 50)]]


@pytest.mark.integration
def test_http_server_ready_then_stopped_by_pid(tmp_path):
    port = free_port()
    proc = ManagedProcess("http", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                          tmp_path / "http.log", cwd=tmp_path)
    with proc:
        proc.wait_http(f"http://127.0.0.1:{port}/", timeout=30)
        pid = proc.pid
        assert port_open("127.0.0.1", port)
    assert proc.proc.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not port_open("127.0.0.1", port)


@pytest.mark.integration
def test_dead_process_fails_fast_with_its_log(tmp_path):
    proc = ManagedProcess("dies", [sys.executable, "-c", "import sys; print('boom here'); sys.exit(3)"],
                          tmp_path / "dies.log")
    start = time.monotonic()
    with proc, pytest.raises(ProcessError, match=r"(?s)exited with code 3.*boom here"):
        proc.wait_http(f"http://127.0.0.1:{free_port()}/health", timeout=60)
    assert time.monotonic() - start < 30  # liveness: a process that exits at once, not the 60 s readiness timeout


@pytest.mark.integration
def test_not_ready_times_out(tmp_path):
    proc = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "s.log")
    with proc, pytest.raises(ProcessError, match="not ready after 1 s"):
        proc.wait_port("127.0.0.1", free_port(), timeout=1)


@pytest.mark.integration
def test_stop_kills_grandchildren_and_escalates_to_sigkill(tmp_path):
    pidfile = tmp_path / "child.pid"
    # The leader ignores SIGTERM (forces SIGKILL) and has a child that would outlive it.
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(60)\n"
    )
    proc = ManagedProcess("stubborn", [sys.executable, "-c", code], tmp_path / "st.log").start()
    deadline = time.monotonic() + 20
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pidfile.read_text())
    start = time.monotonic()
    assert proc.stop(timeout=1) == -9
    assert time.monotonic() - start < 30  # liveness: SIGKILL after the 1 s grace; the leader would sleep 60 s
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # The grandchild is reparented to init, which reaps it shortly after SIGKILL.
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {child} survived stop()")
