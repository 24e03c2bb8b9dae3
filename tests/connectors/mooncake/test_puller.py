"""The decode's puller: how long a read is trusted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from connectors.mooncake import messages as m
from tests.helpers.mooncake_wire import V

pytestmark = pytest.mark.unit


def test_read_is_trusted_only_within_the_granted_lease():
    from connectors.mooncake.channel import ChannelError
    from connectors.mooncake.puller import Puller

    waited_until = []

    def claim(*grants):
        answers = [g if isinstance(g, ChannelError) else m.LeaseGrant(version=V, seconds=[g]) for g in grants]
        return SimpleNamespace(sent_at=50.0, results=lambda until=None: waited_until.append(until) or answers)

    assert Puller.lease_end(claim(5.0, 3.0)) == 53.0  # the shortest grant of all prefill workers
    assert Puller.lease_end(claim(5.0, 0.0)) is None  # one worker had freed the blocks
    assert Puller.lease_end(claim(5.0, ChannelError("no answer")), until=51.5) is None
    assert waited_until == [None, None, 51.5]  # a stalled prefill's grant is waited for until then only
