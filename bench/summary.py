"""How the benches report a figure measured in several repeats: min / median / max, one shape for all."""

from __future__ import annotations

import statistics
from collections.abc import Iterable


def spread(values: Iterable[float]) -> dict[str, float]:
    """min / median / max of one figure over the repeats of a run."""
    values = list(values)
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}
