"""Wire messages of MooncakeConnectorV2's ZeroMQ side channel and of its kv_transfer_params.

Everything a peer sends is decoded into a typed msgspec struct and checked before use (no pickle):
a message from another version, a malformed or oversize frame, a bad address or an out-of-bounds
handle is a `MessageError`, never a crash or a silently wrong read. Requests that touch a held
request carry its token (issued by the prefill in kv_transfer_params); refusals name only a fixed
`PeerError` code, never local details.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cached_property
from typing import Annotated, Any, Literal

import msgspec

from connectors.common.hosts import host_problem, join_host_port
from connectors.mooncake.ports import PortLayout

PROTOCOL_VERSION = 3
"""3: WorkerMeta names the KV heads a worker holds (GQA), and a layer's owner is its TP rank."""

MAX_CLAIMS = 128
"""Claims per lease renewal; a decode batches its claims per prefill worker in messages this big."""
MAX_REQUEST_BYTES = 64 << 10
"""Largest frame a side-channel server accepts: a renewal of MAX_CLAIMS claims with the longest ids
and tokens (52 KB); other requests are a few hundred bytes."""
MAX_REPLY_BYTES = 4 << 20
"""Largest reply a decode accepts (WorkerMeta of a few thousand layers fits easily)."""
MAX_FANOUT = 1024
"""Most prefill workers (tp * pp * pcp) one handle may make a decode worker contact."""
MAX_LAYERS = 8192
MAX_KV_HEADS = 4096
MAX_BLOCK_ID = (1 << 31) - 1
EXTRA_BLOCKS = 4
"""Blocks a prefill may hold beyond its prompt (speculative lookahead slots)."""

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_FANOUT)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
_IDENT = r"\A[!-~]{1,256}\Z"
Ident = Annotated[str, msgspec.Meta(pattern=_IDENT)]
"""Engine, request and consumer ids: 1-256 visible ASCII characters (no spaces or control codes)."""
Text = Annotated[str, msgspec.Meta(pattern=r"\A[ -~]{0,256}\Z")]
Token = Annotated[str, msgspec.Meta(pattern=r"\A[A-Za-z0-9_-]{32,128}\Z")]
"""A request's side-channel token (secrets.token_urlsafe): only the request's parties know it."""
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=253)]
CurveKey = Annotated[str, msgspec.Meta(pattern=r"\A[0-9a-zA-Z.:+=^!/*?&<>()\[\]{}@%$#-]{40}\Z")]
"""A Z85-encoded CURVE public key."""

PeerError = Literal["malformed", "unauthorized", "unknown_request", "expired", "not_ready", "internal"]
"""What a refused peer is told; the details stay in the refusing side's log."""



def is_ident(value: str) -> bool:
    return re.search(_IDENT, value) is not None


def check_host(host: str, what: str) -> None:
    problem = host_problem(host)
    if problem:
        raise ValueError(f"{what} {problem}")


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

    `owner` is the TP rank that persistently holds the layer, its KVPP owner within its cache-replica group
    (None: an MTP/draft layer or KVPP off, i.e. every rank of the group holds it).
    """

    name: Ident
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

    engine_id: Ident
    tp_rank: NonNeg
    tp_size: Count
    pp_rank: NonNeg
    pp_size: Count
    te_host: Host
    te_rpc_port: Port
    model: Text
    dtype: Text
    block_size: Positive
    kvpp: bool
    kv_heads: Annotated[list[NonNeg], msgspec.Meta(min_length=1, max_length=MAX_KV_HEADS)] | None
    """The KV heads (global indices, consecutive) this worker's caches hold, as vLLM splits a GQA model over TP
    (`kvpp_core.topology.Topology.kv_heads_of`); None: an MLA/SFA cache, the same on every TP rank. A decode
    worker reads each layer from a prefill worker holding exactly its heads (connectors.mooncake.heads)."""
    layers: Annotated[list[LayerDesc], msgspec.Meta(max_length=MAX_LAYERS)]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.pp_rank >= self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} outside pp_size {self.pp_size}")
        check_host(self.te_host, "te_host")
        heads = self.kv_heads
        if heads is not None and heads != list(range(heads[0], heads[0] + len(heads))):
            raise ValueError(f"kv_heads {heads[:8]} are not consecutive head indices; vLLM gives each TP rank a run")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError("duplicate layer names in published metadata")
        if self.kvpp:
            for layer in self.layers:
                if layer.owner is not None and layer.owner != self.tp_rank:
                    raise ValueError(
                        f"KVPP worker {self.tp_rank} publishes layer {layer.name} owned by TP rank "
                        f"{layer.owner}; a KVPP rank publishes only its own persistent layers"
                    )

    @property
    def heads(self) -> tuple[int, ...] | None:
        return None if self.kv_heads is None else tuple(self.kv_heads)

    @property
    def te_session(self) -> str:
        return join_host_port(self.te_host, self.te_rpc_port)


class MetaRequest(_Versioned, tag="get_meta"):
    """Asks a worker for its WorkerMeta, on behalf of a request it holds (proved by the token)."""

    request_id: Ident
    token: Token


class DoneNotice(_Versioned, tag="done"):
    """A decode worker finished reading (or gave up on) a request's blocks: free them."""

    request_id: Ident
    token: Token
    consumer: Ident
    num_consumers: Count
    success: bool


class Ack(_Versioned, tag="ack"):
    ok: bool
    error: PeerError | None = None


class Released(_Versioned, tag="released"):
    """Reply to a DoneNotice. `held` False: this worker had already freed the blocks (its hold timed
    out), so what the decode read may have been overwritten and must not be used."""

    request_id: str
    held: bool


class LeaseClaim(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request a decode still means to pull, with its token."""

    request_id: Ident
    token: Token


class LeaseRenewal(_Versioned, tag="lease"):
    """A decode renews its leases (NIXL-style heartbeat): keep these requests' blocks for another
    lease, counted from when the prefill worker reads this."""

    claims: Annotated[list[LeaseClaim], msgspec.Meta(max_length=MAX_CLAIMS)]


class LeaseGrant(_Versioned, tag="lease_grant"):
    """Reply to a LeaseRenewal, claim by claim: seconds the blocks stay held from now on (0: not
    held any more; the prefill freed them, so a pull of them must not be trusted)."""

    seconds: Annotated[list[Annotated[float, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_CLAIMS)]


Message = WorkerMeta | MetaRequest | DoneNotice | Ack | Released | LeaseRenewal | LeaseGrant

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _ENCODER.encode(message)


def decode(frame: bytes, expected: type | None = None, max_bytes: int = MAX_REPLY_BYTES) -> Message:
    """Decode and validate one frame; `expected` narrows the accepted message type."""
    if len(frame) > max_bytes:
        raise MessageError(f"side-channel frame of {len(frame)} bytes exceeds the {max_bytes}-byte limit")
    try:
        message = _DECODER.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        raise MessageError(f"invalid MooncakeConnectorV2 side-channel message: {exc}") from exc
    if expected is not None and not isinstance(message, expected):
        raise MessageError(
            f"expected a {expected.__name__} message, got {type(message).__name__}"
        )
    return message


class PrefillHandle(msgspec.Struct, frozen=True, dict=True):
    """The kv_transfer_params a prefill returns and a decode request carries unchanged.

    Unknown keys are ignored on purpose: proxies and vLLM itself add their own. It comes from an
    HTTP client, so everything is bounded before the decode connects anywhere.
    """

    remote_engine_id: Ident
    remote_request_id: Ident
    remote_token: Token
    remote_host: Host
    remote_kv_port: Port
    remote_tp_size: Count
    remote_block_ids: Annotated[list[BlockId], msgspec.Meta(max_length=1 << 20)]
    remote_num_tokens: NonNeg
    remote_pp_size: Count = 1
    remote_pcp_size: Count = 1
    remote_dp_size: Count = 1
    remote_dp_rank: NonNeg = 0
    remote_hold_expires_at: float | None = None
    """Unix time after which the prefill frees the blocks unless a decode renews their lease."""
    remote_lease_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """How long one lease renewal keeps the blocks: the decode renews well within it."""
    remote_curve_key: CurveKey | None = None
    """The prefill's CURVE public key when its side channel is encrypted."""
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
        check_host(self.remote_host, "remote_host")
        fanout = self.remote_tp_size * self.remote_pp_size * self.remote_pcp_size
        if fanout > MAX_FANOUT:
            raise ValueError(f"remote tp*pp*pcp = {fanout} prefill workers, more than {MAX_FANOUT}")
        self.port_layout  # the derived range fits 1-65535

    @cached_property
    def port_layout(self) -> PortLayout:
        """The prefill's side-channel ports, derived once per handle (every pull and lease renewal reads them)."""
        return PortLayout(self.remote_kv_port, tp=self.remote_tp_size, pp=self.remote_pp_size,
                          pcp=self.remote_pcp_size, dp=self.remote_dp_size)

    def check_blocks(self, block_size: int, max_tokens: int) -> None:
        """The block list covers remote_num_tokens (a short list would leave claimed tokens unread)
        and no more than a lookahead beyond; the token count fits this decode's max_model_len."""
        if self.remote_num_tokens > max_tokens:
            raise MessageError(
                f"invalid kv_transfer_params: remote_num_tokens {self.remote_num_tokens} exceeds this "
                f"decode's max_model_len {max_tokens}"
            )
        need = -(-self.remote_num_tokens // block_size)
        if not need <= len(self.remote_block_ids) <= need + EXTRA_BLOCKS:
            raise MessageError(
                f"invalid kv_transfer_params: {len(self.remote_block_ids)} remote_block_ids for "
                f"{self.remote_num_tokens} tokens of block size {block_size} (expected {need} to "
                f"{need + EXTRA_BLOCKS})"
            )

    def to_params(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def parse_handle(params: Mapping[str, Any]) -> PrefillHandle:
    """Validate a decode request's kv_transfer_params into a PrefillHandle."""
    try:
        return msgspec.convert(dict(params), PrefillHandle)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        raise MessageError(f"invalid kv_transfer_params for MooncakeConnectorV2: {exc}") from exc
