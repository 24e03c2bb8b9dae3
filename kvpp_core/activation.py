"""Proof, at engine start, that KVPP is in place on every worker, or a refusal to start.

`enable_kvpp` only says what the user wants; what runs is decided by the worker class, which the
adapter patches (vLLM's GPU `Worker` and `CPUWorker`). A worker class it does not patch (a custom
`--worker-cls`, vllm-ascend's `NPUWorker`, a subclass overriding a patched method) would allocate
the replicated cache and never broadcast: the engine would start, silently without KVPP (or, with
only some methods overridden, attend over stale staging buffers). So once the KV caches are
allocated, every worker reports what it really holds (`WorkerProof`, built in
`kvpp_core.vllm_adapter.kvpp_activation`) and the engine core checks the reports together
(`refuse_unless_active`) before it warms up or serves anything.

What one report proves: the runtime is installed; the class runs the patched allocation, step and
memory paths; the caches are bound where the placement puts them (owned layers, staging slots);
the broadcast transport spans the whole cache-replica group. What only all reports together prove:
each group's ranks are 0..G-1 and own every target layer of their stage exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpp_core.config import ENABLE_KEY, KvppConfigError

DISABLE = f'remove "{ENABLE_KEY}" from --additional-config'


class KvppActivationError(KvppConfigError):
    """KVPP was requested but is not in place on every worker: the engine must not start."""


@dataclass(frozen=True)
class WorkerProof:
    """What one worker holds once its KV caches are allocated (plain values: it crosses vLLM's RPC)."""

    rank: int
    """Global rank of the worker."""
    worker_cls: str
    platform: str
    unpatched: tuple[str, ...] = ()
    """KVPP-patched worker methods that this worker's class overrides (so KVPP's versions never run)."""
    active: bool = False
    """The KVPP runtime (layout + broadcaster over the bound caches) is installed."""
    pp_rank: int | None = None
    kvpp_rank: int | None = None
    group_size: int | None = None
    group_ranks: tuple[int, ...] = ()
    """Global ranks of this worker's cache-replica group."""
    target_layers: tuple[int, ...] = ()
    """The stage's target layers, as this worker's caches name them."""
    owned: tuple[int, ...] = ()
    staging_slots: int = 0
    staging_needed: int = 0
    """Staging slots the placement binds foreign layers to (0 when the rank owns every target layer)."""
    bound_problem: str | None = None
    """Why the bound caches do not match the placement; None when they do."""
    transport: str | None = None
    """The broadcast transport, e.g. "shared memory" or "torch.distributed (gloo)"; None if missing."""
    transport_size: int | None = None
    """Ranks the transport reaches (the group size when it is in place)."""
    capacity_planned: bool = False
    """The block count was planned from this rank's KVPP bytes per block (determine_available_memory)."""

    @property
    def where(self) -> str:
        return f"worker rank {self.rank} ({self.worker_cls} on platform {self.platform})"


def worker_problems(proof: WorkerProof, patched: Sequence[str]) -> list[str]:
    """What is missing on one worker; `patched`: the worker classes the adapter patches, for the fix."""
    supported = (f"the KVPP adapter patches {', '.join(patched)} (and subclasses that do not override "
                 "determine_available_memory, initialize_from_config or execute_model); start the engine "
                 f"with one of them (leave --worker-cls unset) or {DISABLE}")
    if proof.unpatched:
        return [f"{proof.where} overrides {', '.join(proof.unpatched)}, so KVPP's versions never run; {supported}"]
    if not proof.active:
        return [f"{proof.where} allocated its KV cache without KVPP (no owned layers, staging buffers or "
                f"broadcast in place); {supported}"]
    problems = []
    if proof.bound_problem:
        problems.append(f"{proof.where}: {proof.bound_problem}")
    if proof.staging_slots != proof.staging_needed:
        problems.append(f"{proof.where} has {proof.staging_slots} staging buffer(s) bound but its layout needs "
                        f"{proof.staging_needed}")
    if proof.transport is None or proof.transport_size != proof.group_size:
        problems.append(f"{proof.where}: broadcast transport {proof.transport or 'missing'} reaches "
                        f"{proof.transport_size} rank(s), its group has {proof.group_size}")
    if not proof.capacity_planned:
        problems.append(f"{proof.where}: its block count was not planned from KVPP's bytes per block "
                        "(determine_available_memory did not run KVPP's version)")
    return problems


def group_problems(proofs: Sequence[WorkerProof]) -> list[str]:
    """Cross-rank facts of the active workers: per cache-replica group, kvpp ranks 0..G-1 and every
    target layer of the stage owned by exactly one of them."""
    groups: dict[tuple[int, ...], list[WorkerProof]] = {}
    for proof in proofs:
        if proof.active:
            groups.setdefault(proof.group_ranks, []).append(proof)
    problems = []
    for ranks, members in groups.items():
        where = f"cache-replica group of ranks {list(ranks)}"
        kvpp_ranks = sorted(p.kvpp_rank for p in members)
        if sorted(p.rank for p in members) != sorted(ranks) or kvpp_ranks != list(range(members[0].group_size)):
            problems.append(f"{where}: reports came from ranks {sorted(p.rank for p in members)} with kvpp ranks "
                            f"{kvpp_ranks}; expected one report per rank, kvpp ranks 0..{members[0].group_size - 1}")
            continue
        targets = {layer for p in members for layer in p.target_layers}
        owners: dict[int, list[int]] = {}
        for p in members:
            for layer in p.owned:
                owners.setdefault(layer, []).append(p.kvpp_rank)
        unowned = sorted(targets - set(owners))
        shared = {layer: r for layer, r in sorted(owners.items()) if len(r) > 1}
        if unowned or shared:
            problems.append(f"{where}: target layers {unowned} have no owner, {shared} more than one (layer: "
                            "kvpp ranks); each layer must be owned by exactly one rank")
    return problems


def refuse_unless_active(proofs: Sequence[WorkerProof], world_size: int, patched: Sequence[str]) -> None:
    """Raise KvppActivationError naming every worker whose KVPP allocation is not in place."""
    problems = [] if len(proofs) == world_size else [
        f"{len(proofs)} of the engine's {world_size} workers reported their KVPP allocation"]
    for proof in proofs:
        problems += worker_problems(proof, patched)
    problems += group_problems(proofs)
    if problems:
        raise KvppActivationError(
            f"KVPP was requested ({ENABLE_KEY}) but is not in place on every worker; the engine does not start "
            "without it:\n" + "\n".join(problems))
