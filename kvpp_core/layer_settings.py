"""The settings that change how a layer moves between a group's ranks, read from each rank's own environment.

Each is one setting of the launch, not of a rank: a rank that saw another value would pick another transport
(its peers' handshake then waits on it), or send a layer whole where its peers send the step's blocks, and the
group's collectives would stop matching until the broadcast timeout. So every rank reads them here (`read`), and
at start, before the KV cache is sized, the ranks compare them (kvpp_core.agreement): a launch where one rank
differs is refused, naming the rank and its value (`refuse_differences`).

`KVPP_BROADCAST_TIMEOUT_S` is not among them: each rank's bound on its own waits changes when that rank gives up
on a peer, never what moves or in which order.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvpp_core.config import KvppConfigError

TRANSPORT_ENV = "KVPP_BROADCAST_TRANSPORT"
TRANSPORTS = ("auto", "shm", "collective")
"""auto: shared memory when the group's ranks share a CPU host, else the group's collective backend;
shm: shared memory or fail at startup; collective: always gloo/NCCL/HCCL (for comparison)."""
WHOLE_CACHE_ENV = "KVPP_BROADCAST_WHOLE_CACHE"
"""Set to 1 to broadcast every allocated block, not only the batch's history (the anchor's behaviour;
for comparison in bench/broadcast.py)."""


def transport_choice(env: Mapping[str, str] = os.environ) -> str:
    value = env.get(TRANSPORT_ENV, "auto").strip().lower()
    if value not in TRANSPORTS:
        raise KvppConfigError(
            f"{TRANSPORT_ENV}={value!r} is not a KVPP broadcast transport; use one of {', '.join(TRANSPORTS)} "
            f"(auto picks shared memory for one-host CPU groups), or unset it"
        )
    return value


def whole_cache(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(WHOLE_CACHE_ENV) == "1"


def read(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """This rank's settings as it acts on them (an unset variable as its default, whole cache as 1 or 0: the same choice, the same value). Never raises: a
    value `transport_choice` refuses is compared as written (every rank must reach the comparison)."""
    return {TRANSPORT_ENV: env.get(TRANSPORT_ENV, "auto").strip().lower(),
            WHOLE_CACHE_ENV: "1" if whole_cache(env) else "0"}


def refuse_differences(by_rank: Mapping[int, Mapping[str, str]]) -> None:
    """KvppConfigError naming, for each setting the ranks do not share, the first rank (in rank order) whose value
    differs from the lowest rank's, and both values."""
    ranks = sorted(by_rank)
    problems = []
    for name in by_rank[ranks[0]]:
        first = by_rank[ranks[0]].get(name)
        other = next((r for r in ranks if by_rank[r].get(name) != first), None)
        if other is not None:
            problems.append(
                f"{name} is {by_rank[other].get(name)} on rank {other} but {first} on rank {ranks[0]}: it changes how "
                "a layer moves, so ranks that differ stop matching each other's collectives (until the broadcast "
                f"timeout); set {name} alike in the environment of every rank (every node), or on none")
    if problems:
        raise KvppConfigError("\n".join(problems))
