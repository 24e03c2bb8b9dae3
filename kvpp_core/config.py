"""KVPP settings as users write them in vLLM's `--additional-config`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENABLE_KEY = "enable_kvpp"
STAGING_KEY = "kvpp_staging_buffers"
STAGING_RANGE = range(1, 4)
DEFAULT_STAGING = 2


class KvppConfigError(ValueError):
    """A KVPP setting the user must change; the message names the option and the fix."""


@dataclass(frozen=True)
class KvppConfig:
    enabled: bool = False
    staging_buffers: int = DEFAULT_STAGING


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise KvppConfigError(
        f"additional_config.{ENABLE_KEY} must be true or false (a JSON bool, or the string "
        f'"true"/"false"), got {value!r}; write --additional-config \'{{"{ENABLE_KEY}": true}}\''
    )


def _parse_staging(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in STAGING_RANGE:
        raise KvppConfigError(
            f"additional_config.{STAGING_KEY} must be an integer from {STAGING_RANGE.start} to "
            f"{STAGING_RANGE.stop - 1} (2 overlaps the next layer's broadcast with compute; 1 saves "
            f"memory but serialises them), got {value!r}"
        )
    return value


def parse_additional_config(additional: Mapping[str, Any] | None) -> KvppConfig:
    """Read the KVPP keys of vLLM's additional_config; other plugins' keys are left alone."""
    additional = dict(additional or {})
    if "kvpp_size" in additional:
        raise KvppConfigError(
            "additional_config.kvpp_size is not supported: the KVPP group is always the TP ranks of a "
            "PP stage (PCP x TP with PCP); remove kvpp_size and set only "
            f'{{"{ENABLE_KEY}": true}}'
        )
    known = {ENABLE_KEY, STAGING_KEY}
    unknown = sorted(k for k in additional if k.startswith("kvpp") and k not in known)
    if unknown:
        raise KvppConfigError(
            f"additional_config has unknown KVPP option(s) {', '.join(unknown)}; the only KVPP keys "
            f"are {ENABLE_KEY} and {STAGING_KEY} (broadcast granularity and group size are not knobs)"
        )
    enabled = _parse_bool(additional[ENABLE_KEY]) if ENABLE_KEY in additional else False
    staging = _parse_staging(additional[STAGING_KEY]) if STAGING_KEY in additional else DEFAULT_STAGING
    return KvppConfig(enabled=enabled, staging_buffers=staging)
