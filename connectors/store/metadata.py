"""What the scheduler side tells the workers each step (passed in-process by vLLM, not over a socket)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class BlockJob:
    """Move whole blocks of one request: block_ids[i] holds the tokens hashed by block_hashes[i]."""

    req_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.block_ids) != len(self.block_hashes):
            raise ValueError(f"{self.req_id}: {len(self.block_ids)} blocks but {len(self.block_hashes)} hashes")


@dataclass
class StoreMetadata(KVConnectorMetadata):
    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)
    sync_loads: bool = False
    """Loads must finish before this step's forward (load_async=false)."""
    drain_saves: bool = False
    """Finish in-flight saves before the forward: a preempted request's blocks are being reused."""
    idle: bool = False
    """The step schedules no tokens: the engine only polls for finished loads and saves."""
