"""The local stack's engines run exactly what `kvpp render` writes for their spec, which `kvpp check` accepts."""

import json
import sys

import msgspec
import pytest

from deploy.deployment import launch
from deploy.deployment.check import check_spec
from deploy.deployment.resolved import resolve
from deploy.deployment.spec import Model
from deploy.harness.engines import KV_BYTES, pd_servers, pd_spec
from deploy.services.processes import AMX, REFERENCE
from kvpp_core.model import resolve_model

POOL_EXTRA = {"backend": "mooncake", "lookup_rpc_port": 5999,
              "mooncake": {"master_server_address": "127.0.0.1:5555", "protocol": "tcp", "local_hostname": "127.0.0.1"}}


@pytest.mark.unit
@pytest.mark.parametrize("engine", [REFERENCE, AMX], ids=lambda e: e.kernel.name)
def test_the_stack_spec_passes_kvpp_check(engine):
    """On either kernel, as the demo runs it (the kernel's rules apply: it is named in the instances' args)."""
    spec = pd_spec("/models/tiny16", POOL_EXTRA, producer_extra={"hold_timeout_s": 20},
                   consumer_extra={"transfer_timeout_s": 5}, engine=engine)
    spec = msgspec.structs.replace(spec, model=Model(path="/models/tiny16", preset="kvpp-tiny"))
    assert [str(f) for f in check_spec(spec) if f.severity == "error"] == []
    prefill, decode = (i.kv_transfer_config for i in resolve(spec).instances)
    mooncake, store = prefill["kv_connector_extra_config"]["connectors"]
    assert mooncake["kv_connector_extra_config"] == {"hold_timeout_s": 20} and store["kv_connector"] == "AscendStoreConnector"
    assert decode["kv_connector_extra_config"] == {"transfer_timeout_s": 5}
    # The chaos harness's expected pull sizes come from the model, as the tiny model's pages are.
    assert resolve_model("kvpp-tiny").page_bytes(REFERENCE.block_size) == 16 * 576 * 4 and KV_BYTES == 64 << 20


@pytest.mark.unit
def test_engines_run_the_rendered_api_server_command_on_loopback(tmp_path):
    prefill, decode = pd_servers("/models/tiny16", tmp_path, POOL_EXTRA)
    for engine in (prefill, decode):
        rendered = engine.resolved.serve_command(0, "api-server")
        host = rendered.index("--host") + 1
        assert engine.argv[0] == sys.executable and engine.argv[host] == "127.0.0.1" and rendered[host] == "0.0.0.0"
        assert engine.argv[1:host] + engine.argv[host + 1:] == rendered[1:host] + rendered[host + 1:]
    config = json.loads((tmp_path / launch.MOONCAKE_CONFIG).read_text())
    assert prefill.env["MOONCAKE_CONFIG_PATH"] == str(tmp_path / launch.MOONCAKE_CONFIG)
    assert config["master_server_address"] == "127.0.0.1:5555" and "MOONCAKE_CONFIG_PATH" not in decode.env
