"""Fixtures of the MooncakeConnectorV2 tests: fake prefill processes and CURVE key pairs."""

from __future__ import annotations

import pytest

from connectors.mooncake.curve import create_keys
from testbed.mooncake_peer import PeerJob
from tests.helpers.mooncake_peers import Peer


@pytest.fixture
def peers():
    started: list[Peer] = []

    def start(port: int, **job) -> Peer:
        """A peer on side-channel `port`; `job`: further PeerJob fields."""
        started.append(Peer(PeerJob(port=port, **job)))
        return started[-1]

    yield start
    for peer in started:
        peer.stop()


@pytest.fixture
def keys(tmp_path):
    """Key pairs of a prefill (p), a decode (d) and a stranger (x); p and d trust each other."""
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    for name in ("p", "d", "x"):
        public, _ = create_keys(str(tmp_path), name)
        if name != "x":
            (trusted / public.name).write_bytes(public.read_bytes())
    return tmp_path
