"""What the scheduler side tells the workers each step, and what the workers report back (passed by vLLM
in-process or over its own executor IPC, never over a socket of this connector)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class BlockJob:
    """Move whole blocks of one request: block_ids[i] holds the tokens hashed by block_hashes[i]."""

    req_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[str, ...]
    budget_s: float | None = None
    """A load: what is left of its request's pool budget (request_budget_ms) when it was scheduled; the worker's
    load ends within it from when it received the job, waiting for its turn included."""

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


@dataclass(frozen=True)
class ShardReport:
    """One worker's save outcomes since its last report, by pool block hash: `landed` blocks have this
    worker's share in the pool (its shard written or already there, or no shard of its own to write);
    `failed` blocks do not (a put or the existence check failed)."""

    worker: int
    """The worker's rank in vLLM's world group: each of the engine's workers reports under its own."""
    landed: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()


@dataclass(frozen=True)
class SavedShards(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler side each step (vLLM's worker metadata: built per worker, combined
    by `aggregate` and handed to the scheduler side in-process or over vLLM's own executor IPC, which a
    MultiConnector also forwards to its children, unlike connector KV events)."""

    reports: tuple[ShardReport, ...]

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "SavedShards":
        if not isinstance(other, SavedShards):
            raise TypeError(f"cannot combine pool shard reports with {type(other).__name__}")
        return SavedShards(self.reports + other.reports)
