"""The connectors' launch rules, composed: each connector's own (by kv_connector name, each child of a
MultiConnector with its own), and what holds for any connector under KVPP. The plugin installs them in
kvpp_core's launch check, which the connectors read (connectors.common.startup); `kvpp check`/`kvpp plan`
apply the same ones to a deployment."""

from __future__ import annotations

from dataclasses import replace

from kvpp_core import startup
from kvpp_core.setup import KvppSetup
from kvpp_core.startup import ConnectorSettings, LaunchCheck
from kvpp_core.validation import DISABLE, Problem, error

from connectors.common.names import MOONCAKE, MULTI, STORE
from connectors.mooncake.rules import mooncake_v2_rules
from connectors.store.rules import store_rules

RULES = {MOONCAKE: mooncake_v2_rules, STORE: store_rules}


def connector_rules(setup: KvppSetup, settings: ConnectorSettings | None = None) -> list[Problem]:
    """Every problem of the connector(s) `setup` names; each one's parsed settings go to `settings`."""
    connector = setup.kv_connector
    if settings is None:
        settings = ConnectorSettings()
    if connector is None:
        return []
    if connector == MULTI:
        return _multi_connector_rules(setup, settings)
    rules = RULES.get(connector)
    if not setup.kvpp.enabled:
        return [] if rules is None else rules(setup, settings)
    problems = []
    if setup.kv_role == "kv_consumer":
        problems.append(error("kv_role", (
            "KVPP runs only on prefill nodes (kv_producer, or kv_both with the pool); a kv_consumer "
            f"(decode) node is not supported: {DISABLE} on that node")))
    if rules is None:
        problems.append(error("kv_connector", (
            f"{connector!r} is not validated with KVPP; use {MOONCAKE} (P/D prefill node) or {STORE} "
            f"(KV pool), or {DISABLE}")))
        return problems
    problems += rules(setup, settings)
    # Neither connector knows how PCP splits a request's tokens across ranks' shards.
    if setup.topology.pcp > 1:
        problems.append(error("prefill_context_parallel_size", (
            f"{connector} with KVPP does not support PCP (PCP {setup.topology.pcp}); set "
            f"--prefill-context-parallel-size 1 or {DISABLE}")))
    return problems


def _multi_connector_rules(setup: KvppSetup, settings: ConnectorSettings) -> list[Problem]:
    """vLLM's MultiConnector (e.g. P/D plus a pool on one prefill node): each child obeys its own rules."""
    children = setup.kv_extra.get("connectors")
    if not isinstance(children, list) or not children:
        return [error("kv_connector_extra_config.connectors", (
            f"{MULTI} needs a non-empty list of child connector configs under \"connectors\""))]
    problems = []
    for i, child in enumerate(children):
        where = f"kv_connector_extra_config.connectors[{i}]"
        if not isinstance(child, dict):
            problems.append(error(where, f"must be a connector config object, got {child!r}"))
            continue
        child_setup = replace(
            setup,
            kv_connector=child.get("kv_connector"),
            kv_role=child.get("kv_role", setup.kv_role),
            kv_extra=child.get("kv_connector_extra_config") or {},
        )
        problems += [replace(p, option=f"{where}.{p.option}") for p in connector_rules(child_setup, settings)]
    return problems


def check_launch(vllm_config) -> LaunchCheck:
    """Check `vllm_config` now with these rules, installed or not (tests)."""
    return startup.check(vllm_config, connector_rules)
