"""A P/D deployment spec on IPv6 hosts, with a pool and a proxy."""

from __future__ import annotations


def ipv6_spec(backend="mooncake", prefill_hosts=("fd00::11", "fd00::12"), decode_host="fd00::21",
          pool="[fd00::9]:50051", proxy="fd00::40"):
    return {
        "model": {"path": "/models/m", "preset": "deepseek-v3"},
        "prefill": [{"name": "p", "hosts": list(prefill_hosts), "tp": 4, "pp": 2, "port": 8100, "kv_port": 37000,
                     "enable_kvpp": True, "enforce_eager": True}],
        "decode": [{"name": "d", "hosts": [decode_host], "tp": 4, "port": 8200, "kv_port": 37010}],
        "pool": {"backend": backend, "address": pool, "lookup_rpc_port": 5600, "extra_config": {"load_async": True}},
        "proxy": {"host": proxy, "port": 8000},
    }
