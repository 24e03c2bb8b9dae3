"""Which KVPP serves enable_kvpp where vllm-ascend is installed (a stand-in package on sys.path, see
tests/helpers/fake_ascend.py): none without it (this project's adapter), vllm-ascend's own when its
source reads enable_kvpp (the launch check then follows its matrix), and a refusal when it does not."""

import importlib
import os
import subprocess
import sys

import pytest

from kvpp_core import ascend
from kvpp_core.config import KvppConfigError

from connectors.launch import check_launch

from tests.helpers.fake_ascend import VERSION, write_fake_vllm_ascend
from tests.helpers.paths import REPO
from tests.helpers.store_config import pool_config


@pytest.fixture
def fake_ascend(tmp_path, monkeypatch):
    """Install a stand-in vllm-ascend (native KVPP or not) for the test's duration."""
    def install(native: bool):
        root = write_fake_vllm_ascend(tmp_path / ("native" if native else "plain"), native)
        monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()
        ascend.installed.cache_clear()
        return root

    yield install
    ascend.installed.cache_clear()


@pytest.mark.unit
def test_without_vllm_ascend_this_project_serves_kvpp():
    ascend.installed.cache_clear()
    assert ascend.installed() is None
    assert ascend.implementation() == ascend.OURS and ascend.platform() is None and ascend.refusal() is None


@pytest.mark.unit
def test_vllm_ascend_with_its_own_kvpp_is_deferred_to(fake_ascend):
    root = fake_ascend(native=True)
    found = ascend.installed()
    assert found == ascend.VllmAscend(VERSION, str(root / "vllm_ascend"), True)
    assert ascend.implementation() == f"vllm-ascend (native) {VERSION}"
    assert ascend.platform() == "ascend" and ascend.refusal() is None


@pytest.mark.unit
def test_vllm_ascend_without_kvpp_is_refused(fake_ascend):
    fake_ascend(native=False)
    assert ascend.installed().native_kvpp is False
    message = ascend.refusal()
    assert f"vllm-ascend {VERSION}" in message and "does not implement KVPP" in message
    assert "patches only vLLM's GPU Worker and CPUWorker" in message and 'remove "enable_kvpp"' in message


@pytest.mark.unit
def test_the_launch_check_refuses_kvpp_on_vllm_ascend_without_it(fake_ascend, store_engine_config):
    fake_ascend(native=False)
    with pytest.raises(KvppConfigError, match=f"enable_kvpp: vllm-ascend {VERSION} .* does not implement KVPP"):
        check_launch(pool_config(store_engine_config, {"load_async": True}))
    check_launch(pool_config(store_engine_config, {"load_async": True}, kvpp=False))  # KVPP off: nothing to refuse


@pytest.mark.unit
def test_the_launch_check_applies_vllm_ascends_matrix_under_its_kvpp(fake_ascend, store_engine_config):
    fake_ascend(native=True)
    cfg = pool_config(store_engine_config, {"load_async": True})
    assert check_launch(cfg).warnings == []
    cfg.model_config.enforce_eager = False  # fine for this adapter with PIECEWISE graphs, not for vllm-ascend
    from vllm.config import CUDAGraphMode

    cfg.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    with pytest.raises(KvppConfigError, match="vllm-ascend's KVPP runs in eager mode only"):
        check_launch(cfg)


@pytest.mark.unit
@pytest.mark.parametrize("kvpp", [True, False])
def test_our_connector_forced_in_under_vllm_ascends_kvpp_is_refused(fake_ascend, store_engine_config, kvpp):
    """Under vllm-ascend only kv_connector_module_path reaches this project's connectors, and vllm-ascend's
    KVPP lays out caches they cannot read; without KVPP the layout is vLLM's and they may serve."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connectors.store.connector import AscendStoreConnector

    fake_ascend(native=True)
    cfg = pool_config(store_engine_config, {"load_async": True}, kvpp=kvpp)
    if not kvpp:
        assert AscendStoreConnector(cfg, KVConnectorRole.SCHEDULER) is not None
        return
    with pytest.raises(KvppConfigError, match="kv_connector_module_path: this project's AscendStoreConnector was "
                       f"loaded under vllm-ascend, whose own KVPP \\(vllm-ascend \\(native\\) {VERSION}\\)"):
        AscendStoreConnector(cfg, KVConnectorRole.SCHEDULER)


@pytest.mark.integration
def test_the_plugin_patches_nothing_and_leaves_the_connector_names_to_vllm_ascend(tmp_path):
    """A fresh process (install() runs once per process) with the stand-in on its path."""
    root = write_fake_vllm_ascend(tmp_path, native=True)
    probe = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from connectors import plugin\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F\n"
        "plugin.register()\n"
        "from vllm.v1.worker.gpu_worker import Worker\n"
        "from vllm.v1.worker.cpu_worker import CPUWorker\n"
        "patched = [c.__name__ for c in (Worker, CPUWorker) for m in ('initialize_from_config', 'execute_model')\n"
        "           if getattr(getattr(c, m), 'kvpp_patch', False)]\n"
        "print('PATCHED', patched, 'NAMES', sorted(set(plugin.CONNECTORS) & set(F._registry)))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)]), "VLLM_PLUGINS": ""}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=180)
    assert "PATCHED [] NAMES []" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert f"vllm-ascend {VERSION} is installed: KVPP implementation vllm-ascend (native) {VERSION}" in proc.stderr + proc.stdout
