"""The Mooncake settings one engine process shares: the TCP progress timeout both connectors bound."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from connectors.common.mooncake_env import PROGRESS_TIMEOUT_ENV, SETTER_ENV, bound_progress, progress_timeout_s

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.unit
def test_the_shortest_bound_a_connector_asks_for_wins_and_the_users_value_stays(monkeypatch):
    """A prefill running the P/D connector (2 s stall bound) and the pool (3 s ceiling) in one process: whichever
    starts first, Mooncake's progress timeout ends up at 2 s; a value the user's environment held before stays."""
    for order in ((3.0, 1.5), (1.5, 3.0)):
        monkeypatch.delenv(PROGRESS_TIMEOUT_ENV, raising=False)
        monkeypatch.delenv(SETTER_ENV, raising=False)
        assert [bound_progress(s) for s in order][-1] == "2" and progress_timeout_s() == 2
    monkeypatch.delenv(SETTER_ENV)
    monkeypatch.setenv(PROGRESS_TIMEOUT_ENV, "7")
    assert bound_progress(1.5) == "7" and bound_progress(0.2) == "7"
    monkeypatch.delenv(PROGRESS_TIMEOUT_ENV)
    assert bound_progress(0.2) == "1"  # whole seconds, at least 1


@pytest.mark.unit
def test_a_bound_a_parent_process_s_connector_set_is_not_taken_for_the_users(monkeypatch):
    """A process that ran a connector itself (the test suite's pool client with a 20 s bound) starts an engine: the
    engine inherits 20 s, but its P/D connector bounds its own transfers at 2 s, as in an engine started clean."""
    monkeypatch.delenv(PROGRESS_TIMEOUT_ENV, raising=False)
    monkeypatch.delenv(SETTER_ENV, raising=False)
    assert bound_progress(20.0) == "20" and os.environ[SETTER_ENV] == str(os.getpid())
    child = subprocess.run([sys.executable, "-c", "from connectors.common.mooncake_env import bound_progress; "
                            "print(bound_progress(2.0), bound_progress(3.0))"],
                           capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdout.split() == ["2", "2"]
