"""The Mooncake settings one engine process shares: the TCP progress timeout both connectors bound."""

import pytest

from connectors.common.mooncake_env import PROGRESS_TIMEOUT_ENV, bound_progress, progress_timeout_s


@pytest.mark.unit
def test_the_shortest_bound_a_connector_asks_for_wins_and_the_users_value_stays(monkeypatch):
    """A prefill running the P/D connector (2 s stall bound) and the pool (3 s ceiling) in one process: whichever
    starts first, Mooncake's progress timeout ends up at 2 s; a value the environment held before stays."""
    for order in ((3.0, 1.5), (1.5, 3.0)):
        monkeypatch.delenv(PROGRESS_TIMEOUT_ENV, raising=False)
        assert [bound_progress(s) for s in order][-1] == "2" and progress_timeout_s() == 2
    monkeypatch.setenv(PROGRESS_TIMEOUT_ENV, "7")
    assert bound_progress(1.5) == "7" and bound_progress(0.2) == "7"
    monkeypatch.delenv(PROGRESS_TIMEOUT_ENV)
    assert bound_progress(0.2) == "1"  # whole seconds, at least 1
