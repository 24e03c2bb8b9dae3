"""The vLLM project's Rust router (`vllm-router`, PyPI `vllm-router`) in front of running P/D instances:
the engine tests and `kvpp chaos` put it where `kvpp proxy` usually is, with the argv a rendered
deployment runs (deploy.deployment.launch.vllm_router_args)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Sequence

from deploy.deployment.launch import vllm_router_args
from deploy.services.ports import free_port
from deploy.services.processes import LOOPBACK, ManagedProcess

STARTUP_TIMEOUT_S = 60


def vllm_router_command() -> str:
    """The `vllm-router` launcher of this Python environment (the test extra installs it), else on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        raise FileNotFoundError("vllm-router is not installed: pip install -e '.[test]' (it pins vllm-router), or "
                                "pip install vllm-router")
    return found


def start_vllm_router(prefill_urls: Sequence[str], decode_urls: Sequence[str], log_path: Path,
                      extra_args: Sequence[str] = ()) -> tuple[ManagedProcess, str, str]:
    """vllm-router in P/D mode on loopback, free ports; (the process, its URL, its metrics URL) once its
    /health answers (it first waits for every instance's /health)."""
    port, metrics_port = free_port(), free_port()
    argv = vllm_router_args(list(prefill_urls), list(decode_urls), LOOPBACK, port, metrics_port, extra_args)
    proc = ManagedProcess("vllm-router", [vllm_router_command(), *argv[1:]], log_path).start()
    url = f"http://{LOOPBACK}:{port}"
    try:
        proc.wait_http(f"{url}/health", timeout=STARTUP_TIMEOUT_S)
    except BaseException:
        proc.stop()
        raise
    return proc, url, f"http://{LOOPBACK}:{metrics_port}"
