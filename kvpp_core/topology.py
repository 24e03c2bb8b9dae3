"""Parallel layout of one serving instance as it shapes KVPP's cache-replica groups."""

from __future__ import annotations

from dataclasses import dataclass

RUNNERS = ("v1", "v2")


@dataclass(frozen=True)
class Topology:
    """TP/PP/PCP/DCP/DP sizes, an optional explicit PP layer split, the model runner version, and how the model's
    KV is replicated.

    The cache-replica group is the set of ranks holding the same KV, within one PP stage: for an MLA/SFA model
    (`kv_heads` None) the TP ranks of the stage, or PCP x TP ranks when PCP runs on Model Runner V2; for a GQA model
    (`kv_heads` its KV heads) the TP / kv_heads ranks vLLM gives one KV head (`QKVParallelLinear`: rank r holds head
    r // (TP / kv_heads)), a contiguous run of TP ranks, one group per head. It never spans DP replicas or PP stages.
    """

    tp: int
    pp: int = 1
    pp_layers: tuple[int, ...] | None = None
    pcp: int = 1
    dcp: int = 1
    dp: int = 1
    runner: str = "v1"
    kv_heads: int | None = None
    """A GQA model's KV heads (ModelSpec.replicated_kv_heads); None: a cache identical on every TP rank (MLA/SFA)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "pcp", "dcp", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        heads = self.kv_heads
        if heads is not None:
            if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
                raise ValueError(f"kv_heads must be an integer >= 1, got {heads!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.pp_layers is not None:
            split = tuple(self.pp_layers)
            object.__setattr__(self, "pp_layers", split)
            if len(split) != self.pp:
                raise ValueError(f"the PP layer split {_fmt(split)} has {len(split)} stages but pp is {self.pp}")
            if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split):
                raise ValueError(f"every PP stage needs at least one layer, got split {_fmt(split)}")

    @property
    def pcp_in_group(self) -> bool:
        """PCP ranks share caches only on Model Runner V2 (V1 + PCP is refused by validation)."""
        return self.pcp > 1 and self.runner == "v2"

    @property
    def group_size(self) -> int:
        if self.kv_heads is not None:
            return max(1, self.tp // self.kv_heads)
        return self.tp * self.pcp if self.pcp_in_group else self.tp

    @property
    def groups_per_stage(self) -> int:
        """Cache-replica groups among one stage's TP ranks: one per KV head a GQA model replicates, else one."""
        return self.tp // self.group_size if self.kv_heads is not None else 1

    def kvpp_rank(self, pcp_rank: int, tp_rank: int) -> int:
        if not 0 <= tp_rank < self.tp:
            raise ValueError(f"tp_rank {tp_rank} outside 0..{self.tp - 1}")
        if not 0 <= pcp_rank < self.pcp:
            raise ValueError(f"pcp_rank {pcp_rank} outside 0..{self.pcp - 1}")
        if self.kv_heads is not None:
            return tp_rank % self.group_size
        return pcp_rank * self.tp + tp_rank if self.pcp_in_group else tp_rank

    def replica_group(self, tp_rank: int) -> int:
        """Which of the stage's cache-replica groups TP rank `tp_rank` belongs to (a GQA model: the KV head it
        holds when TP > kv_heads); 0 for an MLA/SFA model."""
        if not 0 <= tp_rank < self.tp:
            raise ValueError(f"tp_rank {tp_rank} outside 0..{self.tp - 1}")
        return tp_rank // self.group_size if self.kv_heads is not None else 0

    def kv_heads_of(self, tp_rank: int) -> range | None:
        """The KV heads (global indices) TP rank `tp_rank` holds; None for an MLA/SFA model, whose one cache every
        rank holds whole."""
        if self.kv_heads is None:
            return None
        if self.tp >= self.kv_heads:
            head = tp_rank // (self.tp // self.kv_heads)
            return range(head, head + 1)
        per_rank = self.kv_heads // self.tp
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)

    def describe_group(self) -> str:
        """The cache-replica group in words, as `kvpp plan` and the start-up line name it."""
        size = self.group_size
        if self.kv_heads is None:
            ranks = f"PCP {self.pcp} x TP {self.tp} ranks" if self.pcp_in_group else f"{self.tp} TP ranks"
            return f"the {ranks} of each PP stage (the MLA/SFA cache is the same on every one)"
        if size == 1:
            return (f"none: TP {self.tp} does not exceed the {self.kv_heads} KV heads, so every rank holds KV heads "
                    "no other rank holds")
        runs = ", ".join(f"{g * size}-{g * size + size - 1}" for g in range(min(self.groups_per_stage, 4)))
        more = ", ..." if self.groups_per_stage > 4 else ""
        return (f"{self.groups_per_stage} per PP stage, one per KV head: its {size} TP ranks (ranks {runs}{more}) "
                "hold it identically")

    def stage_layers(self, num_layers: int) -> list[range]:
        """Target-layer ids of each PP stage.

        An explicit split must sum to `num_layers`. Otherwise the split matches vLLM's
        `get_pp_indices`: the remainder goes one layer each to the stages just before the last
        (the last stage also holds the final norm and head).
        """
        if self.pp_layers is not None:
            if sum(self.pp_layers) != num_layers:
                raise ValueError(
                    f"the PP layer split {_fmt(self.pp_layers)} sums to {sum(self.pp_layers)} but the model "
                    f"has {num_layers} target layers; give {self.pp} counts that sum to {num_layers}"
                )
            counts = list(self.pp_layers)
        else:
            if num_layers < self.pp:
                raise ValueError(f"pp {self.pp} exceeds the model's {num_layers} layers; use pp <= {num_layers}")
            counts = [num_layers // self.pp] * self.pp
            for i in range(2, num_layers % self.pp + 2):
                counts[-i] += 1
        ranges, start = [], 0
        for count in counts:
            ranges.append(range(start, start + count))
            start += count
        return ranges

    def describe(self) -> str:
        parts = [f"TP{self.tp}"]
        parts += [f"{name.upper()}{getattr(self, name)}" for name in ("pp", "pcp", "dcp", "dp") if getattr(self, name) > 1]
        if self.pp_layers is not None:
            parts.append(f"split {_fmt(self.pp_layers)}")
        return " ".join(parts) + f" (runner {self.runner})"


def _fmt(split: tuple[int, ...]) -> str:
    return "/".join(str(n) for n in split)
