"""Mooncake settings that hold for a whole process: its client libraries read them from the environment, so the P/D
transfer engine and the pool's store client of one engine process share them."""

from __future__ import annotations

import math
import os

PROGRESS_TIMEOUT_ENV = "MC_TCP_PROGRESS_TIMEOUT_SEC"
"""Mooncake's bound on a TCP transfer that makes no progress (default 30 s), read whenever a transfer connects."""
SETTER_ENV = "KVPP_MC_PROGRESS_TIMEOUT_PID"
"""The process whose connector set PROGRESS_TIMEOUT_ENV. Children inherit the environment: an engine started by a
process that ran a connector itself (a test, a harness, a tool) sets its own bound instead of keeping its parent's as
if the user had given it (measured: a test's 20 s pool bound held a chaos decode's given-up reads past its backstop)."""


def bound_progress(seconds: float) -> str:
    """Bound Mooncake's TCP progress timeout to `seconds` (whole seconds, at least 1) in this process and return the
    value in force. The shortest bound any connector of the process asks for wins, so each connector's transfers end
    within its own bound; a value the environment held that no connector set (the user's) stays, and one a
    connector of a parent process set is replaced."""
    wanted = max(1, math.ceil(seconds))
    setter = os.environ.get(SETTER_ENV)
    users = setter is None and PROGRESS_TIMEOUT_ENV in os.environ
    ours = setter == str(os.getpid())
    if not users and (not ours or wanted < progress_timeout_s()):
        os.environ[PROGRESS_TIMEOUT_ENV] = str(wanted)
        os.environ[SETTER_ENV] = str(os.getpid())
    return os.environ[PROGRESS_TIMEOUT_ENV]


def progress_timeout_s(env=os.environ) -> int:
    """Seconds without progress after which Mooncake's TCP transport drops a transfer (its default 30)."""
    try:
        value = int(env.get(PROGRESS_TIMEOUT_ENV, "30"))
    except ValueError:
        return 30
    return value if value > 0 else 30
