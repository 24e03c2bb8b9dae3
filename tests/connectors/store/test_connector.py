"""AscendStoreConnector's constructor: the one entry point that refuses a bad start."""

from __future__ import annotations

import pytest

from tests.helpers.store_config import pool_config

pytestmark = pytest.mark.unit


def test_the_connector_refuses_a_mistyped_key_through_the_one_entry_point(store_engine_config):
    """`"load_asnyc": true` used to leave load_async false in silence; KVPP on or off it now stops the start."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvpp_core.config import KvppConfigError

    from connectors.store.connector import AscendStoreConnector

    for kvpp in (False, True):
        with pytest.raises(KvppConfigError) as err:
            AscendStoreConnector(pool_config(store_engine_config, {"load_asnyc": True}, kvpp=kvpp), KVConnectorRole.SCHEDULER)
        assert "kv_connector_extra_config.load_asnyc: unknown option; did you mean load_async?" in str(err.value)
        assert "valid options: backend, lookup_rpc_port, mooncake, memcache, use_layerwise, load_async" in str(err.value)
