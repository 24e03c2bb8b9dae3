"""The code at a commit for before/after benches (bench/before.py): the packages an engine runs, archived from the
commit, imported ahead of this checkout's, with this checkout's testbed."""

import os
import subprocess
import sys

import pytest

from bench.before import PACKAGES, code_at
from tests.helpers.paths import REPO

pytestmark = pytest.mark.unit


def test_a_driver_imports_the_packages_of_the_commit_and_this_checkouts_testbed():
    committed = subprocess.run(["git", "-C", str(REPO), "ls-tree", "-r", "--name-only", "HEAD", "--", *PACKAGES],
                               capture_output=True, text=True, check=True).stdout.split()
    with code_at("HEAD") as before:
        assert sorted(str(p.relative_to(before.tree)) for p in before.tree.rglob("*") if p.is_file()) == sorted(committed)
        probe = ("import os, kvpp_core, testbed; print(os.path.dirname(os.path.dirname(kvpp_core.__file__)), "
                 "os.path.dirname(os.path.dirname(os.path.realpath(testbed.__file__))))")
        # Started from this checkout, as the benches start their engines: `-m` would put it first on sys.path.
        (before.overlay / "kvpp_probe.py").write_text(probe)
        offline = {**os.environ, **before.env, "PYTHONPATH": os.pathsep.join(map(str, before.roots))}
        out = subprocess.run([sys.executable, "-m", "kvpp_probe"], capture_output=True, text=True, env=offline,
                             cwd=REPO, check=True).stdout.split()
        assert out == [str(before.tree), str(REPO.resolve())]
        served = {**os.environ, **before.server_env}
        probe = "import kvpp_core, os; print(os.path.dirname(os.path.dirname(kvpp_core.__file__)))"
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=served, cwd=REPO,
                             check=True).stdout.split()
        assert out == [str(before.tree)]
        tree = before.tree
    assert not tree.exists()


def test_a_ref_that_is_no_commit_is_refused():
    with pytest.raises(ValueError, match="'no-such-ref' is not a commit"):
        with code_at("no-such-ref"):
            pass
