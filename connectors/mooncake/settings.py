"""MooncakeConnectorV2's settings: `kv_connector_extra_config` read once at startup into a typed struct,
by the project's one reader of user settings (unknown keys refused with the closest valid one, every
problem at once)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import math

import msgspec

from kvpp_core.config import Parsed, parse_struct

from connectors.common.names import EXTRA_CONFIG
from connectors.mooncake.transfer import DEFAULT_MAX_ENTRY_BYTES

MIN_STALL_TIMEOUT_S = 1.0  # Mooncake's TCP progress timeout counts whole seconds, at least 1


class MooncakeV2Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What MooncakeConnectorV2 reads from its kv_connector_extra_config."""

    protocol: str = "tcp"
    """Mooncake transport: 'tcp' runs anywhere; 'rdma' needs an RDMA NIC and device_name."""
    device_name: str = ""
    stall_timeout_s: Annotated[float, msgspec.Meta(ge=MIN_STALL_TIMEOUT_S)] = 2.0
    """A pull none of whose reads ends for this long (plus its in-flight bytes' time at the measured
    link rate) is given up and its blocks recomputed; also Mooncake's TCP progress timeout for this
    process (MC_TCP_PROGRESS_TIMEOUT_SEC, rounded up), so the given-up reads end that soon after."""
    transfer_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    """Over a transport other than tcp (rdma), which has no progress timeout: how long after a pull failed
    Mooncake has ended the reads it left in flight, so its blocks are held until then at most (earlier once
    Mooncake says each ended). Over tcp, Mooncake's progress timeout bounds them. Must exceed
    stall_timeout_s rounded up."""
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
    max_entry_bytes: Annotated[int, msgspec.Meta(ge=4096)] = DEFAULT_MAX_ENTRY_BYTES
    """Longest single copy; coalesced runs are cut to this so the engine spreads them over threads."""
    curve_secret_key_file: str = ""
    """This node's ZeroMQ certificate with its secret key: turns CURVE on for the side channel."""
    curve_public_keys_dir: str = ""
    """Directory of the public certificates of the peers this node trusts (CURVE)."""


_DEFAULTS = MooncakeV2Settings()
_HINTS = {"stall_timeout_s": "Mooncake's TCP progress timeout counts whole seconds, at least 1"}


def read_mooncake_v2_settings(extra: Mapping[str, Any] | None) -> Parsed[MooncakeV2Settings]:
    """The struct and every problem of `extra`: each field's, then (over the fields that converted, the
    others at their defaults) whether the initial lease covers one renewal and whether the bound on a failed
    pull's reads over a transport other than tcp leaves them at least what tcp's progress timeout does."""
    parsed = parse_struct(extra, MooncakeV2Settings, EXTRA_CONFIG, _HINTS)
    value = {**msgspec.structs.asdict(_DEFAULTS), **parsed.given}
    if value["lease_s"] > value["hold_timeout_s"]:
        parsed.problems.append((f"{EXTRA_CONFIG}.lease_s", (
            f"{value['lease_s']} exceeds hold_timeout_s {value['hold_timeout_s']}: the initial lease must cover "
            "one renewal; lower lease_s or raise hold_timeout_s")))
    if value["transfer_timeout_s"] <= math.ceil(value["stall_timeout_s"]):
        parsed.problems.append((f"{EXTRA_CONFIG}.transfer_timeout_s", (
            f"{value['transfer_timeout_s']:g} does not exceed stall_timeout_s {value['stall_timeout_s']:g} rounded "
            "up: a failed pull's reads need at least that long to end (what Mooncake's TCP progress timeout gives "
            "them); raise "
            "transfer_timeout_s or lower stall_timeout_s")))
    if parsed.problems:
        parsed.value = None
    return parsed


def parse_mooncake_v2_settings(extra: Mapping[str, Any] | None) -> MooncakeV2Settings:
    return read_mooncake_v2_settings(extra).value_or_raise()
