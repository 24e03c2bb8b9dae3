"""Shared pytest fixtures. Markers (unit, integration, engine) are registered in pyproject.toml."""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.store_config import BASE

ENGINE_LOCK = "/tmp/kvpp-engine.lock"
_engine_lock_fd: int | None = None


def _inherited_engine_lock() -> bool:
    """True when an ancestor (e.g. `flock /tmp/kvpp-engine.lock make test`) passed us its locked fd;
    taking the lock again through a new open would then wait on ourselves forever."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") == ENGINE_LOCK:
                return True
        except OSError:
            continue
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the first `engine` test (and its module fixtures) take the machine-wide engine lock and
    keep it until the session ends, so engines of parallel runs never share the 24 GiB."""
    global _engine_lock_fd
    if _engine_lock_fd is not None or item.get_closest_marker("engine") is None or _inherited_engine_lock():
        return
    fd = os.open(ENGINE_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"\nwaiting for {ENGINE_LOCK} (another vLLM engine run holds it)", file=sys.stderr, flush=True)
        fcntl.flock(fd, fcntl.LOCK_EX)
    _engine_lock_fd = fd


@pytest.fixture
def runtime_dir(monkeypatch):
    """XDG_RUNTIME_DIR (where the pool's lookup sockets live) in a short private directory of its own: a Unix
    socket address holds ~100 characters, which a path under pytest's tmp_path can exceed."""
    path = Path(tempfile.mkdtemp(prefix="kvpp-rt-"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def free_port() -> int:
    """A TCP port free on 127.0.0.1, outside the ephemeral range and leased to this process (deploy.services.ports)."""
    from deploy.services.ports import free_port as pick

    return pick()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The project's 16-layer tiny MLA model (deploy/harness/tiny_model.py), built once per test session."""
    from deploy.harness.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny16", layers=16))


@pytest.fixture(scope="session")
def tiny_gqa_model(tmp_path_factory) -> str:
    """The tiny GQA model (`kvpp tiny-model --arch gqa`: Llama, 8 layers, 4 query heads, one KV head of 32), which a
    TP2 engine replicates on both ranks; vLLM keeps its prefix cache on every host. Built once per test session."""
    from deploy.harness.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-gqa", layers=8, arch="gqa"))


@pytest.fixture(scope="session")
def mtp_model(tmp_path_factory) -> str:
    """The tiny model with one MTP layer (`kvpp tiny-model --mtp 1`), for MTP speculative decoding
    (`{"method": "mtp", "num_speculative_tokens": 1}`); built once per test session."""
    from deploy.harness.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny16-mtp1", layers=16, mtp=1))


@pytest.fixture(scope="session")
def store_engine_config(tiny_model):
    """A real VllmConfig (no engine) for the tiny MLA model, TP=2, pool kv_both, KVPP off."""
    from vllm.engine.arg_utils import EngineArgs

    from deploy.services.processes import REFERENCE

    return EngineArgs(
        model=tiny_model, **REFERENCE.engine_args(), enforce_eager=True, tensor_parallel_size=2,
        kv_transfer_config={"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {**BASE, "load_async": True}},
    ).create_engine_config()


@pytest.fixture(scope="session")
def mtp_kvpp_tp2(mtp_model) -> dict:
    """One engine shape, one start: the MTP model under KVPP (staging, 2 buffers) at TP2 without any connector runs the runtime
    engine test's workload (its KVPP-on run), then answers the store engine test's KVPP prompts one at a
    time (their pool-free reference, under "references")."""
    from tests.helpers.mtp_tp2 import mtp_tp2_run
    from tests.helpers.pool_runs import KVPP_REFERENCED, MAX_TOKENS, pool_prompts

    prompts = pool_prompts(mtp_model)
    return mtp_tp2_run(mtp_model, kvpp=True, staging=2,
                       references={name: prompts[name] for name in KVPP_REFERENCED}, reference_max_tokens=MAX_TOKENS)


@pytest.fixture(scope="session")
def mtp_off_tp2(mtp_model) -> dict:
    """The runtime engine workload on the MTP model at TP2 with KVPP off: the reference of the staging and the
    zero-copy runs alike (tests/kvpp_core/test_runtime_engine.py, test_zero_copy_engine.py)."""
    from tests.helpers.mtp_tp2 import mtp_tp2_run

    return mtp_tp2_run(mtp_model)


@pytest.fixture(scope="session")
def pp_off_eager(tiny_model) -> dict:
    """The TP2 x PP2 (7 + 9) eager workload with KVPP off, the bytes test's probe first: the reference of the
    staging and zero-copy PP runs."""
    from tests.helpers.pp_pair import pp_run

    return pp_run(tiny_model, probe=True)


@pytest.fixture(scope="session")
def plain_tiny_answers(tiny_model, tmp_path_factory) -> dict:
    """One plain vLLM server of the tiny model (no plugin, no connector, TP=1), started once for the tiny-model
    test's text prompts (held against transformers) and the store engine test's KVPP-off reference."""
    from tests.helpers.plain_tiny import serve_plain
    from tests.helpers.pool_runs import MAX_TOKENS, OFF_SERVED, pool_prompts

    prompts = pool_prompts(tiny_model)
    return serve_plain(tiny_model, tmp_path_factory.mktemp("logs") / "vllm.log",
                       {name: prompts[name] for name in OFF_SERVED}, MAX_TOKENS)
