"""Wire messages of MooncakeConnectorV2's ZeroMQ side channel and of its kv_transfer_params.

Everything a peer sends is decoded into a typed msgspec struct and checked before use (no pickle):
a message from another version, a malformed frame or a bad address is a `MessageError`, never a
crash or a silently wrong read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

PROTOCOL_VERSION = 1

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class MessageError(ValueError):
    """A side-channel message or kv_transfer_params that cannot be used as sent."""


class _Versioned(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int

    def __post_init__(self) -> None:
        if self.version != PROTOCOL_VERSION:
            raise ValueError(
                f"protocol version {self.version}, this side speaks {PROTOCOL_VERSION}; run the same "
                "kvpp-connectors release on prefill and decode nodes"
            )


class LayerDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where one layer's paged cache lives in the publishing worker's registered memory.

    `owner` is the KVPP rank that persistently holds the layer (None: an MTP/draft layer or KVPP
    off, i.e. every rank of the group holds it).
    """

    name: str
    base_addr: Positive
    num_blocks: Positive
    block_len: Positive
    block_stride: Positive
    owner: NonNeg | None = None

    def __post_init__(self) -> None:
        if self.block_stride < self.block_len:
            raise ValueError(
                f"layer {self.name}: block_stride {self.block_stride} < block_len {self.block_len}"
            )


class WorkerMeta(_Versioned, tag="meta"):
    """What a worker publishes about itself: identity, compatibility keys and its layers."""

    engine_id: str
    tp_rank: NonNeg
    tp_size: Positive
    pp_rank: NonNeg
    te_host: str
    te_rpc_port: Port
    model: str
    dtype: str
    block_size: Positive
    kvpp: bool
    layers: list[LayerDesc]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError("duplicate layer names in published metadata")
        if self.kvpp:
            for layer in self.layers:
                if layer.owner is not None and layer.owner != self.tp_rank:
                    raise ValueError(
                        f"KVPP worker {self.tp_rank} publishes layer {layer.name} owned by rank "
                        f"{layer.owner}; a KVPP rank publishes only its own persistent layers"
                    )

    @property
    def te_session(self) -> str:
        return f"{self.te_host}:{self.te_rpc_port}"


class MetaRequest(_Versioned, tag="get_meta"):
    """Asks a worker for its WorkerMeta."""


class DoneNotice(_Versioned, tag="done"):
    """A decode worker finished reading (or gave up on) a request's blocks: free them."""

    request_id: str
    consumer: str
    num_consumers: Positive
    success: bool


class Ack(_Versioned, tag="ack"):
    ok: bool
    error: str = ""


class Released(_Versioned, tag="released"):
    """Reply to a DoneNotice. `held` False: this worker had already freed the blocks (its hold timed
    out), so what the decode read may have been overwritten and must not be used."""

    request_id: str
    held: bool


class LeaseClaim(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request a decode still means to pull."""

    request_id: str


MAX_CLAIMS = 4096  # per renewal message; a decode batches its claims per prefill worker


class LeaseRenewal(_Versioned, tag="lease"):
    """A decode renews its leases (NIXL-style heartbeat): keep these requests' blocks for another
    lease, counted from when the prefill worker reads this."""

    claims: Annotated[list[LeaseClaim], msgspec.Meta(max_length=MAX_CLAIMS)]


class LeaseGrant(_Versioned, tag="lease_grant"):
    """Reply to a LeaseRenewal, claim by claim: seconds the blocks stay held from now on (0: not
    held any more; the prefill freed them, so a pull of them must not be trusted)."""

    seconds: list[Annotated[float, msgspec.Meta(ge=0)]]


Message = WorkerMeta | MetaRequest | DoneNotice | Ack | Released | LeaseRenewal | LeaseGrant

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _ENCODER.encode(message)


def decode(frame: bytes, expected: type | None = None) -> Message:
    """Decode and validate one frame; `expected` narrows the accepted message type."""
    try:
        message = _DECODER.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        raise MessageError(f"invalid MooncakeConnectorV2 side-channel message: {exc}") from exc
    if expected is not None and not isinstance(message, expected):
        raise MessageError(
            f"expected a {expected.__name__} message, got {type(message).__name__}"
        )
    return message


class PrefillHandle(msgspec.Struct, frozen=True):
    """The kv_transfer_params a prefill returns and a decode request carries unchanged.

    Unknown keys are ignored on purpose: proxies and vLLM itself add their own.
    """

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_kv_port: Port
    remote_tp_size: Positive
    remote_block_ids: list[NonNeg]
    remote_num_tokens: NonNeg
    remote_pp_size: Positive = 1
    remote_pcp_size: Positive = 1
    remote_dp_size: Positive = 1
    remote_dp_rank: NonNeg = 0
    remote_hold_expires_at: float | None = None
    """Unix time after which the prefill frees the blocks unless a decode renews their lease."""
    remote_lease_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """How long one lease renewal keeps the blocks: the decode renews well within it."""
    protocol_version: int = PROTOCOL_VERSION
    do_remote_prefill: bool = True

    def __post_init__(self) -> None:
        if self.protocol_version != PROTOCOL_VERSION:
            raise ValueError(
                f"kv_transfer_params come from protocol version {self.protocol_version}, this "
                f"decode speaks {PROTOCOL_VERSION}"
            )
        if self.remote_dp_rank >= self.remote_dp_size:
            raise ValueError(
                f"remote_dp_rank {self.remote_dp_rank} outside remote_dp_size {self.remote_dp_size}"
            )

    def to_params(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def parse_handle(params: Mapping[str, Any]) -> PrefillHandle:
    """Validate a decode request's kv_transfer_params into a PrefillHandle."""
    try:
        return msgspec.convert(dict(params), PrefillHandle)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        raise MessageError(f"invalid kv_transfer_params for MooncakeConnectorV2: {exc}") from exc
