"""The deployment spec: settings read through the connectors' own structs."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_kvpp_check_reads_the_spec_pool_settings_as_the_same_struct():
    from deploy.deployment.spec import SpecError, parse_spec

    spec = {"model": {"path": "/m"}, "prefill": [{"name": "p", "hosts": ["h1"], "tp": 1}],
            "pool": {"backend": "mooncake", "address": "h9:50051", "lookup_rpc_port": 5600,
                     "settings": {"protocol": "rdma", "rdma_device": "mlx5_0"}}}
    with pytest.raises(SpecError, match="pool.settings.rdma_device: unknown option; did you mean rdma_devices?"):
        parse_spec(spec)
    spec["pool"]["settings"] = {"protocol": "rdma", "rdma_devices": "mlx5_0"}
    from deploy.deployment.launch import mooncake_store_config

    assert mooncake_store_config(parse_spec(spec)) == {"master_server_address": "h9:50051", "metadata_server":
                                                       "P2PHANDSHAKE", "protocol": "rdma", "rdma_devices": "mlx5_0"}
