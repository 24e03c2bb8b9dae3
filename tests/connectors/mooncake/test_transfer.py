"""MooncakeConnectorV2's pull path between two processes with real Mooncake transfer engines and
ZeroMQ side channels on loopback: bytes intact, batches split, KVPP owners, dead peers bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import zmq

from connectors.mooncake.channel import ChannelError, PortInUseError, SideChannelServer, call
from connectors.mooncake.messages import PROTOCOL_VERSION, MessageError, MetaRequest, WorkerMeta, decode
from connectors.mooncake.transfer import Desc, MooncakeTransfer, TransferError, coalesce, cut_entries, split_batches
from deploy.services.ports import free_port_range
from testbed.mooncake_peer import TOKEN, layer_name, pages
from tests.helpers.mooncake_peers import handle, make_puller
from tests.helpers.paths import REPO


@pytest.fixture
def decode_side():
    te = MooncakeTransfer("127.0.0.1", timeout_s=5)
    yield te
    te.close()


@pytest.mark.integration
def test_pull_moves_scattered_blocks_intact_and_releases_hold(peers, decode_side, free_port):
    peer = peers(free_port, layers=4, blocks=32, seed=7, holds={"r1": TOKEN})
    kv, puller = make_puller(decode_side, layers=4, blocks=16)
    remote, local = [5, 6, 7, 20, 21, 3], [0, 1, 2, 3, 4, 5]
    h = handle(peer.port, "r1", remote)
    nbytes, entries, _, _ = puller.read(h, local, remote)
    expected = pages(4, 32, 7)
    assert torch.equal(kv[:, local], expected[:, remote])
    assert not kv[:, 6:].any()  # nothing written outside the requested blocks
    assert nbytes == 4 * len(remote) * kv[0, 0].numel() * 4
    assert entries == 4 * 3  # per layer: runs 5-7, 20-21 and 3 coalesce to three entries
    assert puller.notify(h, ok=True) == (True, [])
    assert peer.line(timeout=5) == {"released": "r1"}


@pytest.mark.integration
def test_batches_beyond_transport_limit_are_split(peers, free_port):
    # 2100 entries in one tcp batch fail (rc -1, pages half-written) in some runs and not in others
    # here; split into batches of <= 1024 they always arrive intact.
    peer = peers(free_port, layers=1, blocks=4200, seed=3, holds={"r": TOKEN})
    te = MooncakeTransfer("127.0.0.1", timeout_s=5, max_batch_entries=1024)
    try:
        kv, puller = make_puller(te, layers=1, blocks=2100)
        remote = list(range(0, 4200, 2))  # every other page: 2100 entries that cannot coalesce
        _, entries, _, _ = puller.read(handle(peer.port, "r", remote), list(range(2100)), remote)
        expected = pages(1, 4200, 3)[0, remote]
        wrong = [i for i in range(2100) if not torch.equal(kv[0, i], expected[i])]
        assert entries == 2100 and not wrong, f"{entries} entries; {len(wrong)} pages differ, first {wrong[:8]}"
    finally:
        te.close()


@pytest.mark.integration
def test_kvpp_layers_are_read_from_their_owners(peers, decode_side):
    base = free_port_range(2)
    # A TP=2 KVPP prefill: rank 0 owns layers 0-1, rank 1 layers 2-3; different content per rank
    # proves each layer came from its owner.
    peers(base, layers=4, blocks=16, seed=100, tp_rank=0, tp_size=2, owned=(0, 1), holds={"r": TOKEN})
    peers(base + 1, layers=4, blocks=16, seed=101, tp_rank=1, tp_size=2, owned=(2, 3), holds={"r": TOKEN})
    kv, puller = make_puller(decode_side, layers=4, blocks=8)
    blocks = [1, 2, 3]
    puller.read(handle(base, "r", blocks, tp=2), blocks, blocks)
    rank0, rank1 = pages(4, 16, 100), pages(4, 16, 101)
    for layer, source in ((0, rank0), (1, rank0), (2, rank1), (3, rank1)):
        assert torch.equal(kv[layer, blocks], source[layer, blocks]), layer_name(layer)


@pytest.mark.integration
def test_dead_prefill_fails_within_bounded_time(peers, decode_side, free_port):
    peer = peers(free_port, layers=2, blocks=8, seed=1, holds={"r": TOKEN})
    kv, puller = make_puller(decode_side, layers=2, blocks=8, timeout=1.0)
    h = handle(peer.port, "r", [1, 2])
    puller.read(h, [0, 1], [1, 2])  # metadata now cached, TE connected
    peer.kill()
    start = time.monotonic()
    with pytest.raises(TransferError):
        puller.read(h, [0, 1], [1, 2])
    assert time.monotonic() - start < 20  # liveness: MC_TRANSFER_TIMEOUT=5 with room for a loaded host; not 30 s
    puller.forget(h)
    start = time.monotonic()
    with pytest.raises(ChannelError, match="no answer"):
        puller.read(h, [0, 1], [1, 2])
    held, errors = puller.notify(h, ok=False)
    assert held is None and len(errors) == 1
    assert time.monotonic() - start < 15  # liveness: two 1 s call bounds, with room for a loaded host


@pytest.mark.integration
def test_restarted_prefill_with_other_engine_id_is_refused(peers, decode_side, free_port):
    peers(free_port, layers=1, blocks=4, engine_id="new-engine", holds={"r": TOKEN})
    _, puller = make_puller(decode_side, layers=1, blocks=4)
    with pytest.raises(ChannelError, match="is engine new-engine"):
        puller.read(handle(free_port, "r", [0], engine="old-engine"), [0], [0])


@pytest.mark.integration
def test_side_channel_answers_garbage_with_error_and_keeps_serving(peers, free_port):
    peers(free_port, layers=1, blocks=4, holds={"r": TOKEN})
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(f"tcp://127.0.0.1:{free_port}")
    sock.send(b"\x80\x04\x95 pickle? no")
    reply = decode(sock.recv())
    sock.close()
    assert reply.ok is False and reply.error == "malformed"  # a code, not the decoder's message
    meta = call("127.0.0.1", free_port, MetaRequest(version=PROTOCOL_VERSION, request_id="r", token=TOKEN), 3.0,
                WorkerMeta)
    assert meta.layers[0].name == layer_name(0)


@pytest.mark.integration
def test_hold_expires_when_no_decode_pulls_and_late_reader_is_told(peers, decode_side, free_port):
    peer = peers(free_port, layers=1, blocks=4, hold_timeout=1, holds={"orphan": TOKEN})
    # Liveness: the 1 s hold expires far inside 15 s (the 30 s default would not); that it lasts its timeout
    # first is test_holds.py's, on a clock the test moves.
    assert peer.line(timeout=15) == {"expired": "orphan"}
    # A decode that comes after the timeout gets no addresses and learns the blocks are gone.
    _, puller = make_puller(decode_side, layers=1, blocks=4)
    h = handle(free_port, "orphan", [0])
    with pytest.raises(ChannelError, match="refused MetaRequest: expired"):
        puller.read(h, [0], [0])
    assert puller.notify(h, ok=True) == (False, [])


@pytest.mark.integration
def test_taken_handshake_port_is_a_clear_error(free_port):
    first = SideChannelServer("127.0.0.1", free_port, lambda m: m, what="first")
    try:
        with pytest.raises(PortInUseError, match=f"second cannot bind tcp://127.0.0.1:{free_port}"):
            SideChannelServer("127.0.0.1", free_port, lambda m: m, what="second")
    finally:
        first.close()


@pytest.mark.integration
def test_call_to_nobody_is_bounded(free_port):
    start = time.monotonic()
    with pytest.raises(ChannelError):
        call("127.0.0.1", free_port, MetaRequest(version=PROTOCOL_VERSION, request_id="r", token=TOKEN), 0.5,
             WorkerMeta)
    assert time.monotonic() - start < 10  # liveness: the 0.5 s bound with room for a loaded host; unbounded hangs
    with pytest.raises(MessageError):
        decode(b"")


@pytest.mark.integration
def test_read_is_trusted_under_the_lease_it_renewed_while_reading(peers, decode_side, free_port):
    peer = peers(free_port, layers=2, blocks=8, seed=4, hold_timeout=1, lease=1, holds={"r": TOKEN, "orphan": TOKEN})
    kv, puller = make_puller(decode_side, layers=2, blocks=8)
    h = handle(peer.port, "r", [1, 2])
    claim = puller.claim(h)  # travels while the read runs
    puller.read(h, [0, 1], [1, 2])
    lease_end = puller.lease_end(claim)
    assert lease_end == claim.sent_at + 1.0  # a whole 1 s lease, counted from before the read
    assert torch.equal(kv[:, :2], pages(2, 8, 4)[:, [1, 2]])
    assert peer.line(timeout=5) == {"expired": "orphan"}  # never claimed: its initial lease lapsed
    late = handle(peer.port, "orphan", [3])
    claim = puller.claim(late)
    puller.read(late, [2], [3])
    assert puller.lease_end(claim) is None  # the decode must not trust what it read
    assert puller.notify(late, ok=True) == (False, [])


@pytest.mark.integration
def test_leases_keep_a_live_decode_s_blocks_and_lapse_soon_after_it_stops(peers, free_port):
    from connectors.mooncake.leases import LeaseKeeper

    # Initial lease 8 s, a renewal grants 1 s: the decode renews every 1/3 s.
    peer = peers(free_port, layers=1, blocks=4, hold_timeout=8, lease=1, holds={"r": TOKEN})
    keeper = LeaseKeeper(timeout_s=1.0)
    keeper.add("decode-req", handle(peer.port, "r", [0], remote_lease_s=1.0))
    try:
        with pytest.raises(TimeoutError):
            peer.line(timeout=11)  # kept well past the 8 s initial lease while renewed
    finally:
        keeper.close()  # the decode dies: no more renewals
    stopped = time.monotonic()
    assert peer.line(timeout=15) == {"expired": "r"}
    # Liveness: one 1 s lease after the last renewal, with 3.5 s for a loaded host; a renewal that restored the
    # 8 s initial lease would take up to 8 s.
    assert time.monotonic() - stopped < 4.5


@pytest.mark.integration
def test_lease_renewal_without_the_token_is_refused_counted_and_keeps_nothing(peers, free_port):
    from connectors.mooncake.leases import LeaseKeeper

    peer = peers(free_port, layers=1, blocks=4, hold_timeout=3, lease=1, holds={"r": TOKEN})
    keeper = LeaseKeeper(timeout_s=1.0)
    keeper.add("decode-req", handle(peer.port, "r", [0], remote_lease_s=1.0, token="f" * 43))
    lines = []
    try:
        while not lines or lines[-1] == {"refused": "unauthorized"}:  # a heartbeat every 1/3 s
            lines.append(peer.line(timeout=5))
    finally:
        keeper.close()
    # Counted: every renewal before the expiry was refused, so none extended the 3 s initial lease (an accepted
    # one would print no refusal and keep the hold past peer.line's bound).
    assert len(lines) > 2 and lines[-1] == {"expired": "r"}


@pytest.mark.integration
def test_blocks_given_in_descending_order_are_read_as_one_range(peers, decode_side, free_port):
    peer = peers(free_port, layers=3, blocks=16, seed=9, holds={"r": TOKEN})
    kv, puller = make_puller(decode_side, layers=3, blocks=8)
    remote, local = [12, 11, 10, 9], [7, 6, 5, 4]  # how vLLM hands out blocks it freed in reverse
    _, entries, _, _ = puller.read(handle(peer.port, "r", remote), local, remote)
    assert entries == 3  # one copy per layer, not one per page
    assert torch.equal(kv[:, local], pages(3, 16, 9)[:, remote]) and not kv[:, :4].any()


@pytest.mark.integration
def test_a_raw_transfer_between_ipv6_engines(tmp_path):
    """Two transfer engines on ::1 (separate processes, no MC_USE_IPV6 exported): MooncakeTransfer puts
    Mooncake in IPv6 mode for its IPv6 host and publishes a bracketed session that the reader dials."""
    script = REPO / "tests" / "helpers" / "te_host.py"
    env = {k: v for k, v in os.environ.items() if k != "MC_USE_IPV6"}
    env.update(PYTHONPATH=str(REPO), MC_LOG_LEVEL="ERROR")
    server = subprocess.Popen([sys.executable, str(script), "serve", "::1", "4", "7"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        served = json.loads(server.stdout.readline())
        assert served["session"].startswith("[::1]:"), served
        out = subprocess.run([sys.executable, str(script), "read", "::1", served["session"], str(served["addr"]),
                              str(served["nbytes"]), "7"], env=env, capture_output=True, text=True, timeout=60)
        result = json.loads(out.stdout.splitlines()[-1])
        assert result["ok"] and result["intact"], result
    finally:
        server.stdin.close()
        server.wait(timeout=30)


@pytest.mark.unit
def test_coalesce_merges_runs_adjacent_on_both_sides_only():
    descs = [Desc(0, 1000, 10), Desc(10, 1010, 10), Desc(20, 1020, 10),  # one run
             Desc(30, 2000, 10),  # local adjacent, remote not
             Desc(50, 2010, 10),  # remote adjacent, local not
             Desc(60, 2020, 5)]
    assert coalesce(descs) == [Desc(0, 1000, 30), Desc(30, 2000, 10), Desc(50, 2010, 15)]


@pytest.mark.unit
def test_coalesce_keeps_order_and_rejects_empty_copies():
    assert coalesce([Desc(10, 10, 5), Desc(0, 0, 5)]) == [Desc(10, 10, 5), Desc(0, 0, 5)]
    with pytest.raises(ValueError, match="positive"):
        coalesce([Desc(0, 0, 0)])


@pytest.mark.unit
def test_split_batches_respects_limit():
    descs = [Desc(i * 20, i * 20, 10) for i in range(2500)]
    batches = split_batches(descs, 1024)
    assert [len(b) for b in batches] == [1024, 1024, 452]
    assert [d for b in batches for d in b] == descs
    with pytest.raises(ValueError):
        split_batches(descs, 0)


@pytest.mark.unit
def test_cut_entries_bounds_each_copy():
    cut = cut_entries([Desc(0, 1000, 25), Desc(100, 2000, 10)], max_bytes=10)
    assert cut == [Desc(0, 1000, 10), Desc(10, 1010, 10), Desc(20, 1020, 5), Desc(100, 2000, 10)]
    with pytest.raises(ValueError):
        cut_entries([], 0)
