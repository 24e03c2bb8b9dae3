"""AscendStoreConnector's launch rules: its settings always, and with KVPP the role and the store flags
KVPP needs."""

from __future__ import annotations

import msgspec

from kvpp_core.setup import KvppSetup
from kvpp_core.startup import ConnectorSettings
from kvpp_core.validation import Problem, error

from connectors.common.names import STORE
from connectors.store.settings import StoreSettings, read_store_settings

# Extra-config keys KVPP depends on, and the value it needs.
_STORE_FLAGS = {"use_layerwise": False, "load_async": True, "discard_partial_chunks": True, "consumer_is_to_put": False}
_STORE_FLAG_WHY = {
    "use_layerwise": "layerwise pooling would save/load layers this rank does not own",
    "load_async": "KVPP restores its persistent buffers with asynchronous loads only",
    "discard_partial_chunks": "only whole blocks can be sharded by owner",
    "consumer_is_to_put": "consumer write-back is not supported with KVPP",
}


def store_rules(setup: KvppSetup, settings: ConnectorSettings) -> list[Problem]:
    problems = []
    kvpp = setup.kvpp.enabled
    if kvpp and setup.kv_role not in ("kv_producer", "kv_both", "kv_consumer"):
        problems.append(error("kv_role", (
            f"{STORE} supports KVPP with kv_role kv_producer or kv_both, got {setup.kv_role!r}; "
            'set "kv_role": "kv_producer" or "kv_both"')))
    parsed = read_store_settings(setup.kv_extra)
    problems += settings.record(STORE, setup.kv_extra, parsed)
    if not kvpp:
        return problems
    # KV events are allowed: the pool announces a block stored only once every owner shard landed
    # (connectors.store.events).
    return problems + _kvpp_flag_rules(parsed.given, {p.option for p in problems})


def _kvpp_flag_rules(given: dict, reported: set[str]) -> list[Problem]:
    """What KVPP needs of the flags that parsed (a flag already refused is not refused twice)."""
    problems = []
    defaults = {f.name: f.default for f in msgspec.inspect.type_info(StoreSettings).fields}
    for key, required in _STORE_FLAGS.items():
        option = f"kv_connector_extra_config.{key}"
        value = given.get(key, defaults[key])
        if option in reported or value == required:
            continue
        source = "is" if key in given else "defaults to"
        problems.append(error(option, (
            f"{source} {str(value).lower()} but KVPP needs {str(required).lower()} ({_STORE_FLAG_WHY[key]}); "
            f'set "{key}": {str(required).lower()}')))
    return problems
