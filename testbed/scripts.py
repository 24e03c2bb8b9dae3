"""How a testbed driver starts in a process of its own: `python -m testbed.<module>`, with the checkout
root first on PYTHONPATH, since testbed/ is not installed and an engine's worker processes import testbed
(and tests) modules by name."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The checkout that holds testbed/."""


def script_argv(module: str, *args: str) -> list[str]:
    """The command line of the driver `testbed.<module>`, run by this interpreter."""
    return [sys.executable, "-m", f"testbed.{module}", *args]


def script_env(env: Mapping[str, str] | None = None, roots: Sequence[Path] = (ROOT,)) -> dict[str, str]:
    """This process's environment and `env`, with `roots` first on PYTHONPATH: this checkout, or (a benchmark of
    the code before a change, bench/before.py) the trees to import from instead."""
    merged = {**os.environ, **(env or {})}
    merged["PYTHONPATH"] = os.pathsep.join(p for p in (*map(str, roots), merged.get("PYTHONPATH")) if p)
    return merged
