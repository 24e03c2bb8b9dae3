"""MooncakeConnectorV2's pull path between two processes with real Mooncake transfer engines and
ZeroMQ side channels on loopback: bytes intact through the lane window, KVPP owners, dead and stopped
peers bounded, nothing landing after a given-up pull's reads ended, reads after an idle gap."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import zmq

from connectors.mooncake.channel import ChannelError, PortInUseError, SideChannelServer, call
from connectors.mooncake.messages import PROTOCOL_VERSION, MessageError, MetaRequest, WorkerMeta, decode
from connectors.mooncake.plan import IncompatiblePeerError
from connectors.mooncake.stall import LinkRate, PrefillProgress, StallWatch
from connectors.common.mooncake_env import PROGRESS_TIMEOUT_ENV
from connectors.mooncake.transfer import (DRAIN_MARGIN_S, MAX_RETRIES, RETRY_PAUSE_S, Desc, MooncakeTransfer, Stalled,
                                          TransferError, coalesce, cut_entries)
from deploy.services.ports import free_port_range
from testbed.mooncake_peer import TOKEN, layer_name, pages
from tests.helpers.mooncake_peers import handle, make_puller
from tests.helpers.paths import REPO
from tests.helpers.clock import Clock

SENTINEL = -7.0
IDLE_GAP_S = 6.0  # longer than the ~5 s after which Mooncake #4209's lanes rejected transfers


@pytest.fixture
def decode_side():
    te = MooncakeTransfer("127.0.0.1")
    yield te
    te.close()


@pytest.mark.integration
def test_pull_moves_scattered_blocks_intact_and_releases_hold(peers, decode_side, free_port):
    peer = peers(free_port, layers=4, blocks=32, seed=7, holds={"r1": TOKEN})
    kv, puller = make_puller(decode_side, layers=4, blocks=16)
    remote, local = [5, 6, 7, 20, 21, 3], [0, 1, 2, 3, 4, 5]
    h = handle(peer.port, "r1", remote)
    nbytes, entries, _, _, _ = puller.read(h, local, remote)
    expected = pages(4, 32, 7)
    assert torch.equal(kv[:, local], expected[:, remote])
    assert not kv[:, 6:].any()  # nothing written outside the requested blocks
    assert nbytes == 4 * len(remote) * kv[0, 0].numel() * 4
    assert entries == 4 * 3  # per layer: runs 5-7, 20-21 and 3 coalesce to three entries
    assert puller.notify(h, ok=True) == (True, [])
    assert peer.line(timeout=5) == {"released": "r1"}


@pytest.mark.integration
def test_thousands_of_reads_arrive_intact_through_the_lane_window(peers, decode_side, free_port):
    # 2100 entries in one tcp batch failed (rc -1, pages half-written) in some runs here; one read per
    # piece, at most one per lane in flight, never queue in Mooncake and always arrive intact.
    peer = peers(free_port, layers=1, blocks=4200, seed=3, holds={"r": TOKEN})
    kv, puller = make_puller(decode_side, layers=1, blocks=2100)
    remote = list(range(0, 4200, 2))  # every other page: 2100 entries that cannot coalesce
    done = puller.read(handle(peer.port, "r", remote), list(range(2100)), remote)
    expected = pages(1, 4200, 3)[0, remote]
    wrong = [i for i in range(2100) if not torch.equal(kv[0, i], expected[i])]
    assert done.entries == 2100 and not wrong, f"{done.entries} entries; {len(wrong)} pages differ, first {wrong[:8]}"
    assert decode_side._in_flight == {}  # every lane given back


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
def test_a_gqa_decode_reads_each_layer_from_its_owner_among_the_ranks_holding_its_head(peers, decode_side):
    base = free_port_range(4)
    # A TP=4 KVPP prefill of a model with 2 KV heads: ranks 0-1 hold head 0, ranks 2-3 head 1, each pair a
    # cache-replica group whose first rank owns layers 0-1 and second layers 2-3; different content per rank.
    for t in range(4):
        peers(base + t, layers=4, blocks=16, seed=200 + t, tp_rank=t, tp_size=4, owned=(0, 1) if t % 2 == 0 else (2, 3),
              kv_heads=(t // 2,), holds={"r": TOKEN})
    # Rank 1 of a TP=2 decode holds head 1.
    kv, puller = make_puller(decode_side, layers=4, blocks=8, tp_rank=1, tp_size=2, kv_heads=(1,))
    blocks = [1, 2, 3]
    done = puller.read(handle(base, "r", blocks, tp=4), blocks, blocks)
    rank2, rank3 = pages(4, 16, 202), pages(4, 16, 203)
    for layer, source in ((0, rank2), (1, rank2), (2, rank3), (3, rank3)):
        assert torch.equal(kv[layer, blocks], source[layer, blocks]), layer_name(layer)
    assert done.nbytes == 4 * len(blocks) * kv[0, 0].numel() * 4  # each layer once, from one rank


@pytest.mark.integration
def test_a_decode_rank_holding_heads_no_prefill_rank_holds_is_refused_at_the_handshake(peers, decode_side):
    base = free_port_range(2)
    # A TP=2 prefill of a model with 2 KV heads holds one per rank; a TP=1 decode holds both.
    for t in range(2):
        peers(base + t, layers=2, blocks=8, seed=300 + t, tp_rank=t, tp_size=2, kv_heads=(t,), holds={"r": TOKEN})
    kv, puller = make_puller(decode_side, layers=2, blocks=8, kv_heads=(0, 1))
    with pytest.raises(IncompatiblePeerError, match=r"decode tp_rank 0 \(TP 1\) holds KV heads 0-1.*feeds decodes of "
                       r"TP 2 or 4 \(any multiple of 2\)"):
        puller.read(handle(base, "r", [1, 2], tp=2), [1, 2], [1, 2])
    assert not kv.any()  # refused before any read


@pytest.mark.integration
def test_dead_prefill_fails_within_bounded_time(peers, decode_side, free_port):
    peer = peers(free_port, layers=2, blocks=8, seed=1, holds={"r": TOKEN})
    kv, puller = make_puller(decode_side, layers=2, blocks=8, timeout=1.0)
    h = handle(peer.port, "r", [1, 2])
    puller.read(h, [0, 1], [1, 2])  # metadata now cached, TE connected
    peer.kill()
    start = time.monotonic()
    with pytest.raises(TransferError, match="failed again after a retry") as failed:
        puller.read(h, [0, 1], [1, 2])  # refused at once, and again on a fresh connection
    _drained(failed.value.drain, 12)  # what was still in flight ends too: nothing left that could write
    assert time.monotonic() - start < 20  # liveness, with room for a loaded host: never Mooncake's own 30 s
    puller.forget(h)
    start = time.monotonic()
    with pytest.raises(ChannelError, match="no answer"):
        puller.read(h, [0, 1], [1, 2])
    held, errors = puller.notify(h, ok=False)
    assert held is None and len(errors) == 1
    assert time.monotonic() - start < 15  # liveness: two 1 s call bounds, with room for a loaded host


class _StopAfterFirstRead(StallWatch):
    """A pull's stall watch that SIGSTOPs the prefill as soon as the pull's first read landed: the
    prefill stalls mid-pull, with reads in flight."""

    def __init__(self, pid: int, bound_s: float) -> None:
        super().__init__(bound_s, LinkRate(), PrefillProgress(), since=time.monotonic())
        self.pid, self.stopped_at = pid, None

    def progressed(self, now: float) -> None:
        super().progressed(now)
        if self.stopped_at is None:
            os.kill(self.pid, signal.SIGSTOP)
            self.stopped_at = time.monotonic()


def _drained(drain, timeout_s: float) -> float:
    """Seconds until every read of `drain` ended (the engine can no longer write into their memory)."""
    start = time.monotonic()
    while drain is not None and not drain.ended():
        assert time.monotonic() - start < timeout_s, f"{len(drain)} reads still in flight after {timeout_s}s"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.integration
def test_a_prefill_stopped_mid_pull_is_given_up_and_nothing_lands_after_its_reads_ended(peers, free_port):
    """SIGSTOP of the prefill once the pull's first read landed: the pull is given up at its stall bound
    with reads in flight; once those ended, the memory the pull did not fill stays as it was after the
    prefill resumes (Mooncake's abandoned sync reads wrote it late, bench/pd_stall.py), and the next pull
    from the resumed prefill is whole."""
    bound = 2.0
    te = MooncakeTransfer("127.0.0.1", progress_timeout_s=bound)
    peer = peers(free_port, layers=4, blocks=1024, seed=5, holds={"r": TOKEN})
    try:
        kv, puller = make_puller(te, layers=4, blocks=1024)
        h, blocks = handle(peer.port, "r", list(range(1024))), list(range(1024))
        puller.read(h, [0], [0])  # metadata cached, lanes connected
        kv.fill_(SENTINEL)
        watch = _StopAfterFirstRead(peer.proc.pid, bound)
        with pytest.raises(Stalled) as stalled:
            puller.read(h, blocks, blocks, watch)
        gave_up = time.monotonic() - watch.stopped_at
        in_flight = len(stalled.value.drain or ())
        ended = _drained(stalled.value.drain, 30)
        after_drain = kv.clone()
        os.kill(peer.proc.pid, signal.SIGCONT)
        time.sleep(2 * bound)
        untouched = (after_drain == SENTINEL).all(dim=(2, 3))
        assert torch.equal(kv, after_drain), "bytes landed after every read of the given-up pull had ended"
        assert 0 < int(untouched.sum()) < untouched.numel(), "the prefill stopped mid-pull"
        assert te._in_flight == {}  # the drained reads gave their lanes back
        assert gave_up < bound + 10
        print(f"prefill stopped mid-pull: given up {gave_up:.2f} s after the stop with {in_flight} reads in flight, "
              f"which ended {ended:.2f} s later; {int(untouched.sum())} of {untouched.numel()} pages never written")
        kv.fill_(SENTINEL)
        puller.read(h, blocks, blocks)
        assert torch.equal(kv, pages(4, 1024, 5))
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
        te.close()


@pytest.mark.integration
def test_a_pull_after_an_idle_gap_longer_than_mooncake_s_lane_timeout_is_whole(peers, decode_side, free_port):
    """Mooncake #4209: after about 5 s idle a TCP lane rejected transfers for about 90 s. Here a pull
    6 s after the one before is whole at its first try (no read issued again), twice."""
    peer = peers(free_port, layers=2, blocks=64, seed=8, holds={"r": TOKEN})
    kv, puller = make_puller(decode_side, layers=2, blocks=64)
    h, blocks = handle(peer.port, "r", list(range(64))), list(range(64))
    puller.read(h, blocks, blocks)
    for gap in (IDLE_GAP_S, IDLE_GAP_S):
        time.sleep(gap)
        kv.zero_()
        done = puller.read(h, blocks, blocks, StallWatch(2.0, LinkRate(), PrefillProgress(), since=time.monotonic()))
        assert torch.equal(kv, pages(2, 64, 8)) and done.retried == 0


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
    entries = puller.read(handle(peer.port, "r", remote), local, remote).entries
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
def test_cut_entries_bounds_each_copy():
    cut = cut_entries([Desc(0, 1000, 25), Desc(100, 2000, 10)], max_bytes=10)
    assert cut == [Desc(0, 1000, 10), Desc(10, 1010, 10), Desc(20, 1020, 5), Desc(100, 2000, 10)]
    with pytest.raises(ValueError):
        cut_entries([], 0)


class _Engine:
    """A stand-in transfer engine for the read loop's bookkeeping: read `i` (numbered from 1 as started)
    ends as `outcome(i, polls)` says (1 completed, -1 failed, 0 in flight; an exception it raises is the binding's);
    `start(i)` may raise as the binding's start of read `i`."""

    def __init__(self, outcome, start=None) -> None:
        self.outcome = outcome
        self.start = start
        self.started: list[int] = []
        self.polls: dict[int, int] = {}
        self.live: set[int] = set()
        self.ended: set[int] = set()
        self.peak = 0

    def initialize(self, *args) -> int:
        return 0

    def batch_transfer_async_read(self, peer, local, remote, lengths) -> int:
        assert len(local) == len(remote) == len(lengths) == 1
        if self.start is not None:
            self.start(len(self.started) + 1)
        self.started.append(local[0])
        batch_id = len(self.started)
        self.live.add(batch_id)
        self.peak = max(self.peak, len(self.live))
        return batch_id

    def transfer_check_status(self, batch_id: int) -> int:
        assert batch_id not in self.ended, "a read the engine freed was asked again"
        self.polls[batch_id] = self.polls.get(batch_id, 0) + 1
        rc = self.outcome(batch_id, self.polls[batch_id])
        if rc in (1, -1):
            self.live.discard(batch_id)
            self.ended.add(batch_id)
        return rc


@pytest.fixture
def fake_engine(monkeypatch):
    """`fake_engine(outcome)`: a MooncakeTransfer on an _Engine, and that engine."""
    from connectors.mooncake import transfer as transfer_module

    def make(outcome, clock=time.monotonic, start=None):
        engine = _Engine(outcome, start)
        monkeypatch.setattr(transfer_module, "_import_engine", lambda: lambda: engine)
        return MooncakeTransfer("127.0.0.1", clock=clock), engine

    return make


def _pieces(n: int) -> list[Desc]:
    return [Desc(i << 21, i << 21, 1 << 20) for i in range(n)]  # n reads that cannot coalesce


@pytest.mark.unit
def test_at_most_one_read_per_lane_is_in_flight_and_every_lane_comes_back(fake_engine):
    te, engine = fake_engine(lambda i, polls: 1 if polls >= 2 else 0)
    moved = te.read("peer:1", _pieces(10))
    assert moved == (10 << 20, 10, 0)
    assert engine.peak == te.lanes == 4 and len(engine.started) == 10
    assert te._in_flight == {}


@pytest.mark.unit
def test_a_read_failing_at_once_is_issued_once_more(fake_engine):
    te, engine = fake_engine(lambda i, polls: -1 if i == 2 else 1)  # the second read fails, its reissue lands
    moved = te.read("peer:1", _pieces(5))
    assert moved.retried == 1 and len(engine.started) == 6 and engine.started.count(engine.started[1]) == 2
    assert te._in_flight == {}


@pytest.mark.unit
def test_a_read_failing_again_while_others_land_is_issued_again_after_a_pause(fake_engine):
    """A prefill resumed after a stall: a read meets a connection still closing, twice, while the others land."""
    second = 1 << 21  # the second read fails, and its first reissue
    te, engine = fake_engine(lambda i, polls: -1 if engine.started[i - 1] == second
                             and engine.started[:i].count(second) <= 2 else 1)
    started = time.monotonic()
    moved = te.read("peer:1", _pieces(8))
    assert moved.retried == 2 and len(engine.started) == 10 and engine.started.count(second) == 3
    assert time.monotonic() - started >= RETRY_PAUSE_S * 3  # paused 1x, then 2x, before the reissues
    assert te._in_flight == {}


@pytest.mark.unit
def test_a_read_that_keeps_failing_fails_the_pull_after_the_last_retry(fake_engine):
    ticks = itertools.count()
    te, engine = fake_engine(lambda i, polls: -1 if engine.started[i - 1] == 2 << 21 else 1,  # read 2, every time
                             clock=lambda: next(ticks) * 0.01)  # 10 ms a look: the others keep landing meanwhile
    last = f"failed again after a retry \\(retry {MAX_RETRIES} of at most {MAX_RETRIES},"
    with pytest.raises(TransferError, match=last):
        te.read("peer:1", _pieces(100))
    assert engine.started.count(2 << 21) == MAX_RETRIES + 1 and te._in_flight == {}


@pytest.mark.unit
def test_failing_again_fails_the_pull_with_the_reads_still_in_flight_to_drain(fake_engine):
    state = {"ended": False}
    te, engine = fake_engine(lambda i, polls: -1 if i in (1, 5) else (1 if state["ended"] else 0))
    with pytest.raises(TransferError, match="failed again after a retry") as failed:
        te.read("peer:1", _pieces(8))
    drain = failed.value.drain
    assert len(drain) == 3 and te._in_flight == {"peer:1": 3}  # reads 2-4 still hold their lanes
    assert not drain.ended() and not drain.ended()
    state["ended"] = True
    assert drain.ended() and te._in_flight == {}


@pytest.mark.unit
def test_a_stalled_pull_leaves_its_reads_in_flight_to_a_drain_that_ends_at_mooncake_s_own_bound(fake_engine,
                                                                                            monkeypatch):
    """The peer never answers: the pull is given up with its reads in flight. Its drain has not ended before
    Mooncake's own bound on them (its TCP progress timeout in force, plus a margin) expired, and then has; the reads
    Mooncake still calls in flight keep their lanes until it says they ended (a new read would queue behind them in
    Mooncake), and the next read on that peer asks it first."""
    monkeypatch.setenv(PROGRESS_TIMEOUT_ENV, "2")
    clock, state = Clock(), {"ended": False}
    te, engine = fake_engine(lambda i, polls: 1 if state["ended"] else 0, clock)
    assert te.engine_bound_s == 2 + DRAIN_MARGIN_S
    watch = StallWatch(0.05, LinkRate(initial=1e12), PrefillProgress(), since=clock.now - 1)
    with pytest.raises(Stalled, match="0 of 9 reads done") as stalled:
        te.read("peer:1", _pieces(9), watch)
    assert len(engine.started) == 4  # nothing beyond the lanes was ever started
    drain = stalled.value.drain
    clock.now += te.engine_bound_s - 0.01
    assert len(drain) == 4 and not drain.ended() and drain.outlived == 0
    clock.now += 0.01
    assert drain.ended() and drain.outlived == 4
    assert te._in_flight == {"peer:1": 4}, "the lanes follow the reads Mooncake still runs"
    state["ended"] = True
    assert te.read("peer:1", _pieces(2)).entries == 2  # the stragglers' end was asked before a lane was taken
    assert te._in_flight == {} and te._stragglers == {}


@pytest.mark.unit
def test_a_status_check_that_raises_fails_the_pull_with_every_read_in_flight_left_to_drain(fake_engine):
    """The binding raises something else than a transfer error while reads run (here its status check): the pull
    fails as a TransferError naming it, with every read in flight in its drain, the one whose check raised
    included; the drain ends only once the binding says each ended."""
    state = {"raising": True, "ended": False}

    def outcome(i, polls):
        if state["raising"] and i == 3:
            raise RuntimeError("binding hiccup")
        return 1 if state["ended"] else 0

    te, engine = fake_engine(outcome)
    with pytest.raises(TransferError, match="the Mooncake binding raised RuntimeError .*binding hiccup") as failed:
        te.read("peer:1", _pieces(8))
    assert isinstance(failed.value.__cause__, RuntimeError)
    drain = failed.value.drain
    assert len(drain) == 4 and te._in_flight == {"peer:1": 4}
    assert not drain.ended(), "its status check still raises: read 3 may still write"
    state["raising"] = False
    assert not drain.ended(), "it says the reads still run"
    state["ended"] = True
    assert drain.ended() and drain.outlived == 0 and te._in_flight == {}


@pytest.mark.unit
def test_a_start_that_raises_keeps_its_lane_and_the_blocks_until_mooncake_s_bound(fake_engine, monkeypatch):
    """The binding raises while starting a read: whether that read runs is unknown, so the pull's drain holds it
    (and its lane) until Mooncake's own bound expired, beside the reads that did start, which end when it says so."""
    monkeypatch.setenv(PROGRESS_TIMEOUT_ENV, "3")
    clock = Clock()

    def start(i):
        if i == 3:
            raise OSError("binding refused the start")

    te, engine = fake_engine(lambda i, polls: 1, clock, start)
    with pytest.raises(TransferError, match="raised OSError") as failed:
        te.read("peer:1", _pieces(6))
    drain = failed.value.drain
    assert len(engine.started) == 2 and len(drain) == 3 and te._in_flight == {"peer:1": 3}
    assert not drain.ended(), "the two started reads end now; the third is unknown until the bound"
    assert te._in_flight == {"peer:1": 1} and len(drain) == 1
    clock.now += te.engine_bound_s
    assert drain.ended() and drain.outlived == 0 and te._in_flight == {}


@pytest.mark.unit
def test_reads_mooncake_dropped_for_no_progress_stall_the_pull_instead_of_being_retried(fake_engine):
    clock = Clock()
    started = clock.now

    def outcome(i, polls):
        """Every status poll takes 0.1 s; each read fails at its third, 1.2 s into the pull: Mooncake's progress
        timeout (a refusal fails within half the 1 s stall bound of the read's start), not yet due at the second
        round of polls (0.8 s)."""
        clock.now += 0.1
        return -1 if polls >= 3 else 0

    te, engine = fake_engine(outcome, clock)
    watch = StallWatch(1.0, LinkRate(initial=1e12), PrefillProgress(), since=started)
    with pytest.raises(Stalled, match="4 dropped by Mooncake for no progress") as stalled:
        te.read("peer:1", _pieces(6), watch)
    assert len(engine.started) == 4 and stalled.value.drain is None  # none issued again, none left in flight


@pytest.mark.unit
def test_once_another_pull_found_the_prefill_stalled_a_pull_starts_no_further_read(fake_engine):
    progress = PrefillProgress()
    te, engine = fake_engine(lambda i, polls: 1 if polls >= 2 else (progress.gave_up() or 0))  # found stalled mid-pull
    watch = StallWatch(60.0, LinkRate(), progress, since=time.monotonic())
    with pytest.raises(Stalled, match="another pull from the prefill at peer:1 found it stalled") as stalled:
        te.read("peer:1", _pieces(9), watch)
    assert len(engine.started) == 4 and len(stalled.value.drain) == 4  # the first reads only, left to end


@pytest.mark.unit
def test_lanes_and_progress_timeout_are_read_as_mooncake_reads_them():
    from connectors.common.mooncake_env import progress_timeout_s
    from connectors.mooncake.transfer import lanes_per_peer

    assert [lanes_per_peer(env) for env in ({}, {"MC_TCP_LANES_PER_PEER": "8"}, {"MC_TCP_LANES_PER_PEER": "99"},
                                            {"MC_TCP_LANES_PER_PEER": "0"}, {"MC_TCP_LANES_PER_PEER": "x"})] == [4, 8, 16, 1, 4]
    assert [progress_timeout_s(env) for env in ({}, {"MC_TCP_PROGRESS_TIMEOUT_SEC": "2"},
                                                {"MC_TCP_PROGRESS_TIMEOUT_SEC": "0"})] == [30, 2, 30]


@pytest.mark.unit
def test_a_puller_s_bound_becomes_mooncake_s_progress_timeout_unless_one_is_set(fake_engine, monkeypatch):
    from connectors.common.mooncake_env import PROGRESS_TIMEOUT_ENV as PROGRESS_ENV, SETTER_ENV

    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    fake_engine(lambda i, polls: 1)
    MooncakeTransfer("127.0.0.1", progress_timeout_s=1.5)
    assert os.environ[PROGRESS_ENV] == "2"  # whole seconds, rounded up
    monkeypatch.delenv(SETTER_ENV)  # the operator's environment: a value no connector set
    monkeypatch.setenv(PROGRESS_ENV, "7")
    MooncakeTransfer("127.0.0.1", progress_timeout_s=1.5)
    assert os.environ[PROGRESS_ENV] == "7"  # the operator's setting wins
