"""The decode's lease keeper against a real stand-in prefill worker (its own process, real ZeroMQ)."""

from __future__ import annotations

import pytest

from connectors.mooncake.leases import LeaseKeeper
from deploy.services.ports import free_port_range
from testbed.mooncake_peer import TOKEN
from tests.helpers.mooncake_peers import handle

pytestmark = pytest.mark.integration

LEASE_S = 1.5


def test_a_handle_that_cannot_be_renewed_costs_no_other_request_its_lease(peers, caplog):
    """A handle that parses but names a PCP prefill (no ports this decode can renew on) comes first in
    every round; the next request's renewals still go out every lease / 3, so its blocks outlive the
    initial lease many times over, and lapse once the keeper stops."""
    port = free_port_range(2)
    peer = peers(port, hold_timeout=LEASE_S, lease=LEASE_S, holds={"r": TOKEN})
    keeper = LeaseKeeper(timeout_s=2.0)
    try:
        # Due every heartbeat (lease / 3 under the 0.2 s tick), so it comes up in every round.
        keeper.add("bad", handle(port, "pcp", [1], remote_pcp_size=2, remote_lease_s=0.6))
        keeper.add("good", handle(port, "r", [1], remote_lease_s=LEASE_S))
        with pytest.raises(TimeoutError):  # nothing released or expired meanwhile
            peer.line(timeout=3 * LEASE_S)
        assert "good" in keeper and "bad" not in keeper
    finally:
        keeper.close()
    # Liveness: a keeper still renewing would keep the hold forever, so any bound tells; 10 leases leave a loaded
    # host ample room for the lapse (one lease after the last renewal) and the peer's report.
    assert peer.line(timeout=10 * LEASE_S) == {"expired": "r"}
    assert "request bad: lease not renewed: prefill peer runs PCP 2" in caplog.text
