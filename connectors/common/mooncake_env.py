"""Mooncake settings that hold for a whole process: its client libraries read them from the environment, so the P/D
transfer engine and the pool's store client of one engine process share them."""

from __future__ import annotations

import math
import os

PROGRESS_TIMEOUT_ENV = "MC_TCP_PROGRESS_TIMEOUT_SEC"
"""Mooncake's bound on a TCP transfer that makes no progress (default 30 s), read whenever a transfer connects."""

_set_here: int | None = None
"""The value this process's connectors set (None: none did; a value found in the environment is the user's)."""


def bound_progress(seconds: float) -> str:
    """Bound Mooncake's TCP progress timeout to `seconds` (whole seconds, at least 1) in this process and return the
    value in force. The shortest bound any connector of the process asks for wins, so each connector's transfers end
    within its own bound; a value the environment held before any connector set one is the user's and stays."""
    global _set_here
    wanted = max(1, math.ceil(seconds))
    current = os.environ.get(PROGRESS_TIMEOUT_ENV)
    ours = _set_here is not None and current == str(_set_here)
    if current is None or (ours and wanted < _set_here):
        os.environ[PROGRESS_TIMEOUT_ENV] = str(wanted)
        _set_here = wanted
    return os.environ[PROGRESS_TIMEOUT_ENV]


def progress_timeout_s(env=os.environ) -> int:
    """Seconds without progress after which Mooncake's TCP transport drops a transfer (its default 30)."""
    try:
        value = int(env.get(PROGRESS_TIMEOUT_ENV, "30"))
    except ValueError:
        return 30
    return value if value > 0 else 30
