"""KV-cache capacity with and without KVPP, per PP stage and kvpp rank.

Ownership comes from `kvpp_core.ownership` only. "Off" is the same computation with a group of one
rank: every rank then owns all of its stage's layers and needs no staging buffer, which is exactly
the replicated baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from kvpp_core.config import ZERO_COPY
from kvpp_core.model import ModelSpec
from kvpp_core.ownership import rank_bytes_per_block, rank_layout
from kvpp_core.topology import Topology

DEFAULT_BLOCK_SIZE = 128
"""Block size of the Ascend deployments the presets describe; vLLM's CPU MLA backend needs 16."""


@dataclass(frozen=True)
class RankPlan:
    kvpp_rank: int
    owned: tuple[int, ...]
    """Target layer ids this rank keeps persistently (contiguous; empty when layers < group size)."""
    staging_slots: int
    bytes_per_block_off: int
    bytes_per_block_on: int
    blocks_off: int
    blocks_on: int
    tokens_off: int
    tokens_on: int

    @property
    def owned_range(self) -> str:
        return f"{self.owned[0]}-{self.owned[-1]}" if self.owned else "-"


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: tuple[int, ...]
    mtp_layers: tuple[int, ...]
    """Ids of MTP layers (numbered after the target layers); replicated on every rank of the last stage."""
    memory_bytes: int
    ranks: tuple[RankPlan, ...]

    @property
    def blocks_off(self) -> int:
        return min(r.blocks_off for r in self.ranks)

    @property
    def blocks_on(self) -> int:
        return min(r.blocks_on for r in self.ranks)


@dataclass(frozen=True)
class CapacityPlan:
    model: ModelSpec
    topology: Topology
    block_size: int
    staging: int
    stages: tuple[StagePlan, ...]

    @property
    def zero_copy(self) -> bool:
        return self.staging == ZERO_COPY and self.topology.group_size > 1

    @property
    def mode(self) -> str:
        """Where the plan's "on" layout applies (kvpp_core.validation enforces it at launch)."""
        if self.zero_copy:
            return ("zero-copy (kvpp_staging_buffers 0): foreign layers are read in place from their owner's pages; "
                    "only where each cache-replica group's ranks share one x86-64 CPU host (KV in /dev/shm); "
                    "GPUs, NPUs and groups spanning hosts use staging buffers")
        return (f"staging ({self.staging} buffer(s) per rank): each foreign layer is copied from its owner "
                "before it runs; any device, any host layout")

    @property
    def blocks_off(self) -> int:
        return min(s.blocks_off for s in self.stages)

    @property
    def blocks_on(self) -> int:
        return min(s.blocks_on for s in self.stages)

    @property
    def tokens_off(self) -> int:
        return self.blocks_off * self.block_size

    @property
    def tokens_on(self) -> int:
        return self.blocks_on * self.block_size

    @property
    def ratio(self) -> float:
        return self.blocks_on / self.blocks_off

    @property
    def memory_saving(self) -> float:
        """KV memory the replicated layout would need beyond KVPP's for the same token count."""
        return 1.0 - 1.0 / self.ratio

    @property
    def binding_stages_off(self) -> tuple[int, ...]:
        """Stages whose ranks hold the fewest blocks without KVPP (several when they tie)."""
        return tuple(s.stage for s in self.stages if s.blocks_off == self.blocks_off)

    @property
    def binding_stages_on(self) -> tuple[int, ...]:
        return tuple(s.stage for s in self.stages if s.blocks_on == self.blocks_on)

    @property
    def binding_stage_off(self) -> int:
        return self.binding_stages_off[0]

    @property
    def binding_stage_on(self) -> int:
        return self.binding_stages_on[0]

    def to_json(self) -> dict:
        stages = []
        for s in self.stages:
            ranks = [dict(asdict(r), owned=list(r.owned), owned_range=r.owned_range) for r in s.ranks]
            stages.append(dict(stage=s.stage, layers=[s.layers[0], s.layers[-1]], num_layers=len(s.layers),
                               mtp_layers=list(s.mtp_layers), memory_bytes=s.memory_bytes,
                               blocks_off=s.blocks_off, blocks_on=s.blocks_on, ranks=ranks))
        topo = asdict(self.topology)
        topo["pp_layers"] = list(self.topology.pp_layers) if self.topology.pp_layers else None
        return dict(
            model=asdict(self.model),
            topology=dict(topo, group_size=self.topology.group_size, groups_per_stage=self.topology.groups_per_stage),
            replica_group=self.topology.describe_group(),
            block_size=self.block_size,
            staging=self.staging,
            mode="zero-copy" if self.zero_copy else "staging",
            bundle_bytes_per_token=self.model.token_bytes(self.topology.tp),
            page_bytes=self.model.page_bytes(self.block_size, self.topology.tp),
            blocks_off=self.blocks_off,
            blocks_on=self.blocks_on,
            tokens_off=self.tokens_off,
            tokens_on=self.tokens_on,
            ratio=self.ratio,
            memory_saving=self.memory_saving,
            binding_stage_off=self.binding_stage_off,
            binding_stage_on=self.binding_stage_on,
            binding_stages_off=list(self.binding_stages_off),
            binding_stages_on=list(self.binding_stages_on),
            stages=stages,
        )


def plan_capacity(
    model: ModelSpec,
    topo: Topology,
    memory_bytes: int | Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    staging: int = 2,
) -> CapacityPlan:
    """Blocks and tokens each rank can hold with KVPP off and on.

    `memory_bytes` is the KV memory free on each rank: one value for all, or one per PP stage.
    MTP caches count as `model.mtp_layers` replicated bundles on the last stage (use
    `model.with_overrides(mtp_layers=0)` when serving without MTP). The cache-replica group comes from the model
    (`topo.kv_heads` is set from it): a GQA model's is the TP ranks holding one KV head.
    """
    problem = plan_problem(model, topo)
    if problem:
        raise ValueError(problem)
    topo = replace(topo, kv_heads=model.replicated_kv_heads)
    page = model.page_bytes(block_size, topo.tp)
    stage_ranges = topo.stage_layers(model.num_layers)
    if staging == ZERO_COPY and any(len(layers) < topo.group_size for layers in stage_ranges):
        raise ValueError(zero_copy_layer_problem(topo, stage_ranges))
    memory = _per_stage_memory(memory_bytes, topo.pp)
    stages = []
    for index, layers in enumerate(stage_ranges):
        last = index == topo.pp - 1
        mtp_ids = tuple(range(model.num_layers, model.num_layers + model.mtp_layers)) if last else ()
        bundles = {layer: page for layer in layers}
        mtp_bundles = [page] * len(mtp_ids)
        replicated = rank_layout(layers, 1, 0, staging)
        per_block_off = rank_bytes_per_block(replicated, bundles, mtp_bundles)
        ranks = []
        for rank in range(topo.group_size):
            layout = rank_layout(layers, topo.group_size, rank, staging)
            per_block_on = rank_bytes_per_block(layout, bundles, mtp_bundles)
            blocks_off, blocks_on = memory[index] // per_block_off, memory[index] // per_block_on
            ranks.append(RankPlan(
                kvpp_rank=rank, owned=layout.owned, staging_slots=layout.staging_slots,
                bytes_per_block_off=per_block_off, bytes_per_block_on=per_block_on,
                blocks_off=blocks_off, blocks_on=blocks_on,
                tokens_off=blocks_off * block_size, tokens_on=blocks_on * block_size,
            ))
        stages.append(StagePlan(index, tuple(layers), mtp_ids, memory[index], tuple(ranks)))
    plan = CapacityPlan(model, topo, block_size, staging, tuple(stages))
    if plan.blocks_off == 0:
        stage = plan.stages[plan.binding_stage_off]
        need = stage.ranks[0].bytes_per_block_off
        raise ValueError(
            f"stage {stage.stage} has {stage.memory_bytes} bytes of KV memory per rank, less than one block "
            f"without KVPP ({need} bytes); give each rank more memory"
        )
    return plan


def plan_problem(model: ModelSpec, topo: Topology) -> str | None:
    """Why KVPP has nothing to plan for `model` on `topo` (None when it has): a model whose layers KVPP does not
    handle, a TP that splits heads unevenly, or a GQA model whose KV heads TP does not replicate."""
    if not model.supports_kvpp:
        if model.hybrid:
            return (f"model {model.name} is hybrid: {model.mixed}; KVPP plans models whose every layer is one "
                    "full-attention (or MLA/SFA) cache, and vLLM gives the other layers KV cache groups of their own")
        return f"model {model.name} uses {model.attention} attention; KVPP plans MLA/SFA and GQA models"
    if model.num_heads and model.num_heads % topo.tp:
        return (f"TP {topo.tp} does not divide the {model.num_heads} attention heads of {model.name}; "
                f"choose a TP size that divides {model.num_heads}")
    heads = model.replicated_kv_heads
    if heads is not None:
        try:
            model.kv_heads_per_rank(topo.tp)
        except ValueError as exc:
            return str(exc)
        if topo.tp <= heads:
            return (f"no KV head of {model.name} is replicated at TP {topo.tp}: its {heads} KV heads are split over "
                    f"the TP ranks, {heads // topo.tp} per rank, and no two ranks hold the same one, so there is no "
                    f"copy for KVPP to remove; KVPP pays off from TP {2 * heads} (each KV head on 2 ranks)")
        if topo.pcp > 1:
            return (f"PCP {topo.pcp} with a GQA model: KVPP's replica groups of GQA heads are TP ranks only; set "
                    "--prefill-context-parallel-size 1")
    return None


def zero_copy_layer_shortage(topo: Topology, stage_ranges: Sequence[range]) -> str | None:
    """Why zero-copy cannot run when a stage has fewer layers than group ranks (None when none has): a rank owning
    none would keep no pages to carve its views of foreign layers from (and bind no capacity at all)."""
    short = [f"stage {i} ({len(r)} layers)" for i, r in enumerate(stage_ranges) if len(r) < topo.group_size]
    if not short:
        return None
    return (f"every rank must own a layer, and {', '.join(short)} has fewer layers than its {topo.group_size} "
            "group ranks")


def zero_copy_layer_problem(topo: Topology, stage_ranges: Sequence[range]) -> str:
    return (f"kvpp_staging_buffers 0 (zero-copy): {zero_copy_layer_shortage(topo, stage_ranges)}; set "
            "kvpp_staging_buffers to 1 or 2, or give each PP stage at least as many layers as ranks")


def _per_stage_memory(memory_bytes: int | Sequence[int], pp: int) -> list[int]:
    values = [memory_bytes] if isinstance(memory_bytes, int) else list(memory_bytes)
    if len(values) == 1:
        values = values * pp
    if len(values) != pp:
        raise ValueError(f"give one memory size for every rank or one per PP stage ({pp}), got {len(values)}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"KV memory per rank must be a positive number of bytes, got {value!r}")
    return values
