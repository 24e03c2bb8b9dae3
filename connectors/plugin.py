"""vLLM general-plugin entry point (`vllm.general_plugins: kvpp`).

vLLM calls `register()` in every process it starts (API server, engine core, workers), before
configs are built; it must be cheap and idempotent. It installs the KVPP adapter (whose patches
stay inert unless `enable_kvpp` is set) and, in kvpp_core's launch check, the connectors' launch rules
(`connectors.launch`), and makes the connectors reachable by name.
"""

from __future__ import annotations

from kvpp_core import ascend

from connectors.common.names import MOONCAKE, STORE

CONNECTORS = {
    MOONCAKE: ("connectors.mooncake.connector", "MooncakeConnectorV2"),
    STORE: ("connectors.store.connector", "AscendStoreConnector"),
}


def _register_connectors() -> None:
    """Register our connectors under their names unless something else owns them; where vllm-ascend is
    installed, never: it registers its own under the same names from its own plugin, which vLLM may load
    after this one and which fails on a name already taken. `kv_connector_module_path` reaches ours then."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    found = ascend.installed()
    if found is not None:
        from vllm.logger import init_logger

        init_logger("vllm.kvpp.plugin").info(
            "vllm-ascend %s is installed: KVPP implementation %s; this project's adapter patches nothing and "
            "the names %s are left to vllm-ascend's connectors", found.version, ascend.implementation(),
            ", ".join(CONNECTORS))
        return
    for name, (module, cls) in CONNECTORS.items():
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, cls)


def register() -> None:
    from kvpp_core import vllm_adapter

    from connectors.launch import connector_rules

    vllm_adapter.install(connector_rules)
    _register_connectors()
