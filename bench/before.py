"""The project's code at an earlier commit, for benches that measure a change before and after it.

`code_at(REF)` writes `git archive REF` of the packages an engine runs (kvpp_core, connectors, deploy) into a
temporary tree. An offline engine run (testbed.engine_run.run_engine) imports them from there and testbed from
this checkout (`Before.roots`: a tree holding only a link to this checkout's testbed, then the archived one;
`Before.env`), so the same typed job runs on either code; a served engine imports them from `Before.tree`
(`Before.server_env`). Both leave the working directory off sys.path: `python -m`, started from this checkout,
would put it first and import this checkout's packages instead.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from testbed.scripts import ROOT

PACKAGES = ("kvpp_core", "connectors", "deploy")
SAFE_PATH = {"PYTHONSAFEPATH": "1"}
"""Python 3.11+: no working directory (nor script directory) at the head of sys.path."""


@dataclass(frozen=True)
class Before:
    ref: str
    commit: str
    tree: Path
    """The archived packages."""
    overlay: Path
    """A tree holding only `testbed`, a link to this checkout's."""

    @property
    def roots(self) -> tuple[Path, Path]:
        return self.overlay, self.tree

    @property
    def env(self) -> dict[str, str]:
        """What an offline engine run adds to its environment (with `roots`)."""
        return dict(SAFE_PATH)

    @property
    def server_env(self) -> dict[str, str]:
        """What a served engine's environment needs to run the archived packages."""
        return {"PYTHONPATH": str(self.tree), **SAFE_PATH}


@contextlib.contextmanager
def code_at(ref: str) -> Iterator[Before]:
    """The packages at `ref` (a commit of this checkout's repository) in a temporary tree, removed on exit."""
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise ValueError(f"{ref!r} is not a commit of {ROOT}: {found.stderr.strip()}")
    commit = found.stdout.strip()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, *PACKAGES], capture_output=True, check=True)
    with tempfile.TemporaryDirectory(prefix="kvpp-before-") as tmp:
        tree, overlay = Path(tmp, "tree"), Path(tmp, "overlay")
        tree.mkdir()
        overlay.mkdir()
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tree, filter="data")
        (overlay / "testbed").symlink_to(ROOT / "testbed")
        yield Before(ref, commit, tree, overlay)
