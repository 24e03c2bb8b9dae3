"""How the benches order compared modes (interleaved, rotating) and report a figure measured in several
repeats (min / median / max), one way for all."""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable


def spread(values: Iterable[float]) -> dict[str, float]:
    """min / median / max of one figure over the repeats of a run."""
    values = list(values)
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def interleaved(modes: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, mode) in run order: every round runs every mode, each round starting one mode later, so no
    mode always runs first (cold caches) or last (a warmer, busier machine)."""
    return [(r, modes[(r + i) % len(modes)]) for r in range(rounds) for i in range(len(modes))]


def host(note: str) -> dict:
    """What the results file says about the machine it ran on: cores, load averages (1/5/15 min) when it
    was written, and the caller's note (e.g. who else shared the host)."""
    return {"cores": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()], "note": note}
