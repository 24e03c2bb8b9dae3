"""What the scheduler side tells the workers each step (in-process vLLM IPC, not the network)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from connectors.mooncake.messages import PrefillHandle


@dataclass(frozen=True)
class LoadSpec:
    """Pull `remote_block_ids` of a prefilled request into `local_block_ids` (same order).

    Empty block lists mean "nothing to read, only tell the prefill to free" (a decode request
    aborted before it was scheduled).
    """

    request_id: str
    handle: PrefillHandle
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    scheduled_at: float = 0.0
    """time.time() when the scheduler scheduled the load (its workers run on the same host)."""


@dataclass
class MooncakeV2Metadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    holds: dict[str, float] = field(default_factory=dict)
    """Producer: requests whose blocks the workers keep for a decode, -> seconds to keep them."""
    tokens: dict[str, str] = field(default_factory=dict)
    """Producer: the side-channel token issued for each request in `holds`."""
    token_key: bytes | None = None
    """The key those tokens are issued under, in every step's metadata: a worker checks with it the
    token of a request it has not been told about yet (tokens.py)."""
    idle: bool = False
    """The step schedules no tokens: the engine only polls for finished pulls."""
