"""A connector's start: its settings come from this process's launch check, whose rules the plugin
installed in kvpp_core; without them a connector gets an error saying so, never a check that skipped
the connectors' rules."""

from __future__ import annotations

import pytest

from kvpp_core import startup
from kvpp_core.config import KvppConfigError

from connectors.common.names import STORE
from connectors.common.startup import connector_settings
from connectors.launch import check_launch
from connectors.store.settings import parse_store_settings

from tests.helpers.store_config import pool_config

pytestmark = pytest.mark.unit


@pytest.fixture
def no_rules_installed(monkeypatch):
    """A process the plugin never ran in, and which has checked nothing yet."""
    monkeypatch.setattr(startup, "_rules", None)
    monkeypatch.setattr(startup, "_latest", None)


def test_without_the_plugins_rules_a_connector_is_told_so(store_engine_config, no_rules_installed):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from connectors.store.connector import AscendStoreConnector

    with pytest.raises(RuntimeError, match="no connector rules in this process: the kvpp vLLM plugin installs them"):
        AscendStoreConnector(pool_config(store_engine_config, {"load_async": True}), KVConnectorRole.SCHEDULER)


def test_a_check_already_made_serves_the_connector_without_installed_rules(store_engine_config, no_rules_installed):
    cfg = pool_config(store_engine_config, {"load_async": True}, kvpp=False)
    check_launch(cfg)
    assert connector_settings(cfg, STORE, parse_store_settings).load_async is True


def test_the_installed_rules_are_the_ones_a_connector_gets(store_engine_config, no_rules_installed):
    from connectors.launch import connector_rules

    startup.install_rules(connector_rules)
    with pytest.raises(KvppConfigError, match="kv_connector_extra_config.load_asnyc: unknown option"):
        connector_settings(pool_config(store_engine_config, {"load_asnyc": True}, kvpp=False), STORE,
                           parse_store_settings)
