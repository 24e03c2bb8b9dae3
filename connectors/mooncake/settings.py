"""MooncakeConnectorV2 options from `kv_connector_extra_config`, checked once at startup."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from connectors.mooncake.transfer import DEFAULT_MAX_BATCH_ENTRIES, DEFAULT_MAX_ENTRY_BYTES, MIN_TRANSFER_TIMEOUT_S


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    protocol: str = "tcp"
    """Mooncake transport: 'tcp' runs anywhere; 'rdma' needs an RDMA NIC and device_name."""
    device_name: str = ""
    transfer_timeout_s: Annotated[int, msgspec.Meta(ge=MIN_TRANSFER_TIMEOUT_S)] = 30
    """Bound on one batch read from a hung peer (Mooncake's MC_TRANSFER_TIMEOUT)."""
    handshake_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    """Bound on one side-channel request (metadata fetch, done-notice)."""
    hold_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    """Initial lease: how long a prefill keeps a finished request's blocks for a decode that never
    claims them (NIXL's 30 s)."""
    lease_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    """How long a decode's lease renewal keeps the blocks: a claimed request's blocks are freed this
    long after its decode stops renewing (dies); a slow but live decode keeps them."""
    max_parallel_pulls: Annotated[int, msgspec.Meta(ge=1)] = 4
    """Pull threads per decode worker: pulls from different prefills run in parallel."""
    max_pulls_per_prefill: Annotated[int, msgspec.Meta(ge=1)] = 2
    """Of those, at most this many pull from one prefill at a time (a dead one cannot take all)."""
    max_batch_entries: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_MAX_BATCH_ENTRIES
    """Entries per batch_transfer_sync_read; over ~1024 the tcp transport fails half-written."""
    max_entry_bytes: Annotated[int, msgspec.Meta(ge=4096)] = DEFAULT_MAX_ENTRY_BYTES
    """Longest single copy; coalesced runs are cut to this so the engine spreads them over threads."""
    curve_secret_key_file: str = ""
    """This node's ZeroMQ certificate with its secret key: turns CURVE on for the side channel."""
    curve_public_keys_dir: str = ""
    """Directory of the public certificates of the peers this node trusts (CURVE)."""


def parse_settings(extra: Mapping[str, Any] | None) -> Settings:
    """Every problem at once: each unknown key (with the closest valid one) and each bad value."""
    extra = dict(extra or {})
    fields = Settings.__struct_fields__
    problems = []
    for key in sorted(k for k in extra if k not in fields):
        close = difflib.get_close_matches(key, fields, n=1)
        problems.append(f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    for key in fields:
        if key in extra:
            try:
                msgspec.convert({key: extra[key]}, Settings)
            except msgspec.ValidationError as exc:
                problems.append(str(exc))
    settings = None if problems else msgspec.convert(extra, Settings)
    if settings is not None and settings.lease_s > settings.hold_timeout_s:
        problems.append(f"lease_s {settings.lease_s} exceeds hold_timeout_s {settings.hold_timeout_s}; "
                        "the initial lease must cover one renewal")
    if problems:
        raise ValueError(
            f"invalid kv_connector_extra_config for MooncakeConnectorV2: {'; '.join(problems)} "
            f"(accepted keys: {', '.join(fields)})"
        )
    return settings


def local_host() -> str:
    """Address to bind and publish: VLLM_HOST_IP when set, else loopback."""
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"
