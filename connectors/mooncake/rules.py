"""MooncakeConnectorV2's launch rules: its settings always, and the role KVPP needs of it."""

from __future__ import annotations

from kvpp_core.setup import KvppSetup
from kvpp_core.startup import ConnectorSettings
from kvpp_core.validation import Problem, error

from connectors.mooncake.settings import parse_settings
from connectors.names import MOONCAKE


def mooncake_rules(setup: KvppSetup, settings: ConnectorSettings) -> list[Problem]:
    problems = []
    if setup.kvpp.enabled and setup.kv_role not in ("kv_producer", "kv_consumer"):
        problems.append(error("kv_role", (
            f"{MOONCAKE} supports KVPP only with kv_role kv_producer (the prefill node), got {setup.kv_role!r}; "
            'set "kv_role": "kv_producer"')))
    try:
        settings.add(MOONCAKE, setup.kv_extra, parse_settings(setup.kv_extra))
    except ValueError as exc:
        problems.append(error("kv_connector_extra_config", str(exc)))
    return problems
