"""Starting a MooncakeConnectorV2 P/D pair on loopback, shared by the engine tests and the bench."""

from __future__ import annotations

import json
from pathlib import Path

from deploy.services.processes import VllmServer, free_port


def kv_config(role: str, kv_port: int, policy: str = "fail", **extra) -> str:
    """--kv-transfer-config for MooncakeConnectorV2, loaded by module path (works with or without
    the plugin's name registration)."""
    return json.dumps({
        "kv_connector": "MooncakeConnectorV2",
        "kv_connector_module_path": "connectors.mooncake.connector",
        "kv_role": role, "kv_port": kv_port, "kv_load_failure_policy": policy,
        "kv_connector_extra_config": extra,
    })


def pd_server(name: str, model: str, log_dir: Path, tp: int, cores: list[int], role: str, kv_port: int,
              policy: str = "fail", extra_args: tuple[str, ...] = (), server: dict | None = None,
              env: dict[str, str] | None = None, **extra) -> VllmServer:
    """A VllmServer running the connector, with stats on so its counters reach /metrics; `server`
    holds further VllmServer options (KV budget, max model length)."""
    return VllmServer(name, model, free_port(), Path(log_dir) / f"{name}.log", tp=tp, cores=cores,
                      env={"MC_LOG_LEVEL": "ERROR", **(env or {})}, log_stats=True, **(server or {}),
                      extra_args=["--kv-transfer-config", kv_config(role, kv_port, policy, **extra), *extra_args])
