"""MooncakeConnectorV2's launch rules: its settings always, and the role KVPP needs of it."""

from __future__ import annotations

from kvpp_core.setup import KvppSetup
from kvpp_core.startup import ConnectorSettings
from kvpp_core.validation import Problem, error

from connectors.common.names import MOONCAKE
from connectors.mooncake.settings import read_mooncake_v2_settings


def mooncake_v2_rules(setup: KvppSetup, settings: ConnectorSettings) -> list[Problem]:
    problems = []
    if setup.kvpp.enabled and setup.kv_role not in ("kv_producer", "kv_consumer"):
        problems.append(error("kv_role", (
            f"{MOONCAKE} supports KVPP only with kv_role kv_producer (the prefill node), got {setup.kv_role!r}; "
            'set "kv_role": "kv_producer"')))
    return problems + settings.record(MOONCAKE, setup.kv_extra, read_mooncake_v2_settings(setup.kv_extra))
