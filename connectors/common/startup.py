"""What each connector does first as vLLM builds it: take its settings from this process's launch check.

The check applies the rules the plugin installed in kvpp_core (`connectors.launch` composes them), so a
connector never imports the module that composes them; a process without them installed gets kvpp_core's
error saying so, not a check that skipped the connectors' rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kvpp_core import ascend, startup
from kvpp_core.config import KvppConfigError
from kvpp_core.vllm_adapter import quiet_shm_readers

T = TypeVar("T")


def connector_settings(vllm_config, connector: str, parse: Callable[[Mapping[str, Any] | None], T]) -> T:
    """`connector`'s settings as this process's check of `vllm_config` parsed them (checked now, every
    problem of the launch at once, if no check of it was made yet).

    Under vllm-ascend the caches are laid out by its own KVPP, which these connectors cannot read: only
    `kv_connector_module_path` reaches them there, so that is refused. The process's shared-memory
    readers stop spinning (CPU hosts): transfers need the cores they would spin on."""
    check = startup.checked(vllm_config)
    if check.kvpp.enabled and ascend.installed() is not None:
        raise KvppConfigError(
            f"kv_connector_module_path: this project's {vllm_config.kv_transfer_config.kv_connector} was loaded "
            f"under vllm-ascend, whose own KVPP ({ascend.implementation()}) lays out the KV caches, and this "
            "connector reads only the layout of this project's adapter, which patches nothing there; remove "
            "kv_connector_module_path to use vllm-ascend's connector of that name")
    quiet_shm_readers()
    return check.settings.get(connector, vllm_config.kv_transfer_config.kv_connector_extra_config, parse)
