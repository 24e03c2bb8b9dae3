"""Starting a MooncakeConnectorV2 P/D pair on loopback, shared by the engine tests and the bench."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deploy.services.ports import free_port
from deploy.services.processes import LOOPBACK, Engine, cpu_instance, single_instance


def mooncake_config(role: str, kv_port: int, policy: str = "fail", **extra) -> dict[str, Any]:
    """kv_transfer_config of MooncakeConnectorV2, loaded by module path (works with or without the
    plugin's name registration)."""
    return {
        "kv_connector": "MooncakeConnectorV2",
        "kv_connector_module_path": "connectors.mooncake.connector",
        "kv_role": role, "kv_port": kv_port, "kv_load_failure_policy": policy,
        "kv_connector_extra_config": extra,
    }


def kv_config(role: str, kv_port: int, policy: str = "fail", **extra) -> str:
    """mooncake_config as the --kv-transfer-config flag takes it."""
    return json.dumps(mooncake_config(role, kv_port, policy, **extra))


def pd_server(name: str, model: str, log_dir: Path, tp: int, cores: list[int], role: str, kv_port: int,
              policy: str = "fail", extra_args: tuple[str, ...] = (), server: dict | None = None,
              env: dict[str, str] | None = None, **extra) -> Engine:
    """An engine running the connector, with stats on so its counters reach /metrics; `server` holds
    further cpu_instance options (KV budget, max model length, instance keys such as enable_kvpp)."""
    inst = cpu_instance(name, LOOPBACK, free_port(), tp, cores, log_stats=True, env={"MC_LOG_LEVEL": "ERROR", **(env or {})},
                        extra_args=extra_args, kv_transfer_config=mooncake_config(role, kv_port, policy, **extra),
                        **(server or {}))
    return Engine(single_instance(model, inst), Path(log_dir) / f"{name}.log")
