"""AscendStoreConnector settings the store tests start from, and a vLLM config carrying them."""

from __future__ import annotations

BASE = {"backend": "mooncake", "lookup_rpc_port": 6000, "mooncake": {"master_server_address": "127.0.0.1:1"}}


def pool_config(cfg, extra=None, role="kv_both", events=False, kvpp=True):
    """A copy of `cfg` with the pool settings `BASE` + `extra`, the role, KV events and KVPP as given."""
    import copy

    from vllm.config import KVEventsConfig

    cfg = copy.deepcopy(cfg)
    cfg.additional_config = {"enable_kvpp": kvpp}
    cfg.kv_transfer_config.kv_role = role
    cfg.kv_transfer_config.kv_connector_extra_config = {**BASE, **(extra or {})}
    cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=events) if events else None
    return cfg
