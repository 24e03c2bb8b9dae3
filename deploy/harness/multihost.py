"""A rendered deployment running across test-bed hosts: spec, scripts and their processes.

`kvpp demo --hosts` and tests/deploy/harness/test_multihost_engine.py do what an operator does: write a spec whose
hosts are addresses, let `kvpp check` accept it and `kvpp render --format shell` write the scripts,
then run each script unchanged on its host, here a network namespace of deploy/harness/testbed.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import yaml

from kvpp_core.platforms import VLLM_CPU
from connectors.common.hosts import host_url, join_host_port

from deploy.services.processes import ProcessError, cpu_instance, http_ok
from deploy.deployment.render import render, write_files
from deploy.deployment.spec import parse_spec
from deploy.harness.engines import STAGING
from deploy.harness.testbed import Testbed

HOSTS = ("prefill", "decode", "pool", "proxy", "prefill2")
"""The demo deployment: a KVPP prefill, a decode, the pool, the proxy, and a second KVPP prefill that
reuses what the first one pooled."""
KV_PORT = {"prefill": 37000, "prefill2": 37000, "decode": 37010}
HTTP_PORT = {"prefill": 8100, "prefill2": 8101, "decode": 8200}
LOOKUP_PORT = {"prefill": 5601, "prefill2": 5602}
"""Distinct although the hosts differ: the namespaces share one filesystem, where lookup sockets live."""
POOL_PORT, PROXY_PORT = 50051, 8000
ROUTER_HOST = "router"
"""A further host for the same deployment rendered with vllm-router as its P/D front (router_spec)."""
FRONTS = ("proxy", ROUTER_HOST)
TRANSFER_TIMEOUT_S = 5


def _instance(name: str, host: str, tp: int, kv_cache_bytes: int, **extra: Any) -> dict[str, Any]:
    inst = cpu_instance(name, host, HTTP_PORT[name], tp, [0, 1] if tp == 2 else [1], kv_cache_bytes=kv_cache_bytes,
                        max_model_len=1024, log_stats=True, env={"MC_LOG_LEVEL": "ERROR"}, kv_port=KV_PORT[name],
                        **extra)
    return msgspec.json.decode(msgspec.json.encode(inst))  # the spec file's plain data


def cpu_spec(bed: Testbed, model: str, kv_cache_bytes: int = 96 << 20) -> dict[str, Any]:
    """The five-host deployment spec on this machine's CPU build of vLLM."""
    return {
        "model": {"path": model},
        "platform": VLLM_CPU.name,
        "prefill": [
            _instance("prefill", bed.address("prefill"), 2, kv_cache_bytes, enable_kvpp=True, additional_config=STAGING,
                      lookup_rpc_port=LOOKUP_PORT["prefill"]),
            # The same KV layout as the first (TP=2, KVPP): pooled objects are per owner shard, so only
            # instances with one layout share prefixes.
            _instance("prefill2", bed.address("prefill2"), 2, kv_cache_bytes, enable_kvpp=True, additional_config=STAGING,
                      lookup_rpc_port=LOOKUP_PORT["prefill2"]),
        ],
        "decode": [_instance("decode", bed.address("decode"), 1, kv_cache_bytes, kv_transfer_config={
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"transfer_timeout_s": TRANSFER_TIMEOUT_S}})],
        "pool": {"backend": "mooncake", "address": join_host_port(bed.address("pool"), POOL_PORT),
                 "lookup_rpc_port": LOOKUP_PORT["prefill"], "segment_size": "512MB",
                 # Every store call bounded by 5 s (floor and ceiling): the test asserts pool hits on a starved host,
                 # where the connector's default bounds (0.5-3 s) would count some calls failed.
                 "extra_config": {"load_async": True, "backend_timeout_ms": 5000, "backend_timeout_floor_ms": 5000,
                                  "lookup_timeout_ms": 10000}},
        "proxy": {"host": bed.address("proxy"), "port": PROXY_PORT},
    }


def router_spec(spec: dict[str, Any], bed: Testbed, policy: str = "round_robin") -> dict[str, Any]:
    """`spec` with vllm-router (`--policy`, round-robin by default: every prefill in turn) as its P/D front on
    the router host."""
    return {**spec, "proxy": {"router": "vllm-router", "host": bed.address(ROUTER_HOST), "port": PROXY_PORT,
                              "extra_args": ["--policy", policy]}}


class RenderedStack:
    """The spec rendered to `workdir/rendered` (render refuses a spec `kvpp check` finds errors in, with
    every error) and each script run in its host."""

    def __init__(self, bed: Testbed, spec: dict[str, Any], workdir: Path) -> None:
        self.bed, self.workdir = bed, Path(workdir)
        (self.workdir / "spec.yaml").write_text(yaml.safe_dump(spec))
        parsed = parse_spec(spec, str(self.workdir / "spec.yaml"))
        self.scripts = self.workdir / "rendered"
        write_files(render(parsed, "shell", launcher="api-server"), self.scripts)
        self.logs = self.workdir / "logs"
        self.procs: dict[str, subprocess.Popen] = {}
        # The scripts call `kvpp` and `python3`: this environment's, as on a host where it is installed.
        repo = str(Path(__file__).resolve().parents[2])
        self.env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                    "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}

    def log(self, host: str) -> Path:
        return self.logs / f"{host}.log"

    def start(self, host: str) -> None:
        script = "pool.sh" if host == "pool" else "proxy.sh" if host in FRONTS else f"{host}-node0.sh"
        self.procs[host] = self.bed.spawn(host, ["bash", self.scripts / script], self.log(host), env=self.env)

    def stop(self, host: str) -> None:
        proc = self.procs.pop(host)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def url(self, host: str) -> str:
        port = PROXY_PORT if host in FRONTS else HTTP_PORT[host]
        return host_url("http", self.bed.address(host), port)

    def wait_ready(self, hosts: list[str], timeout: float = 600.0, progress=None) -> None:
        """Wait for each host's service; a script that exits fails at once with its log tail."""
        for host in hosts:
            ready = (lambda: "mooncake pool on" in self.log(host).read_text()) if host == "pool" else \
                (lambda: http_ok(f"{self.url(host)}/health"))
            deadline = time.monotonic() + timeout
            next_note = time.monotonic() + 15
            while not ready():
                if self.procs[host].poll() is not None:
                    raise ProcessError(f"{host}'s script exited with {self.procs[host].returncode}:\n"
                                       f"{self.log(host).read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise ProcessError(f"{host} not ready within {timeout:.0f}s:\n{self.log(host).read_text()[-3000:]}")
                if progress is not None and time.monotonic() > next_note:
                    progress(f"waiting for {host} ({self.bed.address(host)})")
                    next_note = time.monotonic() + 15
                time.sleep(0.5)

    def start_all(self, progress=None) -> None:
        self.start("pool")
        self.wait_ready(["pool"], 60, progress)
        for host in ("prefill", "decode", "prefill2", "proxy"):
            self.start(host)
        self.wait_ready(["prefill", "decode", "prefill2", "proxy"], progress=progress)
