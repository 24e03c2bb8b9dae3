"""MooncakeV2Worker without an engine: prefill and decode workers in this process, each with a real
Mooncake transfer engine and side channel on loopback; only vLLM's process groups are stood in for
(TP=1, PP=1), and the scheduler's step metadata is written by hand."""

from __future__ import annotations

import collections
import os
import secrets
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import zmq

from connectors.mooncake import messages as m
from connectors.mooncake import worker as worker_module
from connectors.mooncake.channel import ChannelError, call
from connectors.mooncake.messages import PrefillHandle
from connectors.mooncake.metadata import LoadSpec, MooncakeV2Metadata
from connectors.mooncake.settings import MooncakeV2Settings
from connectors.mooncake.worker import MooncakeV2Worker
from deploy.services.ports import free_port
from tests.helpers.mooncake_wire import KEY, OTHER, TOKEN, V, issued, names

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

LAYERS = names(2)
BLOCK_SHAPE = (16, 576)  # one MLA page of the tiny model: block_size 16, latent + rope 576


def vllm_config(kv_port: int) -> SimpleNamespace:
    """The parts of a VllmConfig the worker reads."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        prefill_context_parallel_size=1, data_parallel_size=1, data_parallel_rank=0),
        kv_transfer_config=SimpleNamespace(kv_port=kv_port),
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(use_mla=True, hf_config=SimpleNamespace(architectures=["DeepseekV2ForCausalLM"],
                                                                             num_hidden_layers=2)),
    )


def caches(blocks: int, seed: int | None = None) -> dict[str, torch.Tensor]:
    """One cache per layer; random pages when seeded, zeros otherwise."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return {name: torch.rand((blocks, *BLOCK_SHAPE), generator=gen) if gen else torch.zeros((blocks, *BLOCK_SHAPE))
            for name in LAYERS}


@pytest.fixture
def start_worker(monkeypatch):
    """Starts a worker on its own kv_port: `start_worker(engine_id, **settings)`; all are shut down after."""
    rank0 = SimpleNamespace(rank_in_group=0)
    monkeypatch.setattr(worker_module, "get_tp_group", lambda: rank0)
    monkeypatch.setattr(worker_module, "get_pp_group", lambda: rank0)
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    started: list[MooncakeV2Worker] = []

    def start(engine_id: str, **settings) -> MooncakeV2Worker:
        started.append(MooncakeV2Worker(vllm_config(free_port()), engine_id, MooncakeV2Settings(**settings)))
        return started[-1]

    yield start
    for w in started:
        w.shutdown()


def handle(prefill: MooncakeV2Worker, request_id: str, blocks: list[int], token: str = TOKEN) -> PrefillHandle:
    return PrefillHandle(remote_engine_id=prefill.engine_id, remote_request_id=request_id, remote_token=token,
                         remote_host="127.0.0.1", remote_kv_port=prefill.port, remote_tp_size=1,
                         remote_block_ids=blocks, remote_num_tokens=16 * len(blocks))


def finished_until(worker: MooncakeV2Worker, done, timeout_s: float = 20.0) -> tuple[set[str], set[str]]:
    """Step `get_finished` as the engine does until `done(sending, recving)` holds; the union of what it reported."""
    sending, recving = set(), set()
    deadline = time.monotonic() + timeout_s
    while not done(sending, recving):
        assert time.monotonic() < deadline, (sending, recving)
        s, r = worker.get_finished()
        sending |= s
        recving |= r
        time.sleep(0.01)
    return sending, recving


def test_a_pull_between_two_workers_moves_the_blocks_and_frees_them_on_the_prefill(start_worker):
    prefill, decode = start_worker("prefill"), start_worker("decode")
    source, target = caches(16, seed=3), caches(8)
    prefill.register_kv_caches(source)
    decode.register_kv_caches(target)
    prefill.start_load_kv(MooncakeV2Metadata(holds={"p-req": 30.0}, tokens={"p-req": TOKEN}))
    decode.start_load_kv(MooncakeV2Metadata(loads=[LoadSpec("d-req", handle(prefill, "p-req", [9, 4, 5]),
                                                            (0, 1, 2), (9, 4, 5), time.time())]))

    assert finished_until(decode, lambda s, r: "d-req" in r) == (set(), {"d-req"})
    assert decode.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        assert torch.equal(target[name][:3], source[name][[9, 4, 5]]) and not target[name][3:].any()
    pulled = decode.get_stats().reduce()
    assert (pulled["pulled_requests"], pulled["failed_pulls"]) == (1, 0)
    assert pulled["pulled_bytes"] == 3 * len(LAYERS) * source[LAYERS[0]][0].nbytes
    assert decode.get_stats() is None  # reported once, then reset
    # the done-notice reaches the prefill after the decode reported the request
    assert finished_until(prefill, lambda s, r: "p-req" in s) == ({"p-req"}, set())


def test_the_prefill_publishes_its_caches_to_token_holders_only_and_frees_a_lapsed_hold(start_worker):
    prefill = start_worker("prefill", hold_timeout_s=1.0, lease_s=1.0)
    source = caches(4, seed=1)
    prefill.register_kv_caches(source)
    prefill.start_load_kv(MooncakeV2Metadata(holds={"r": 0.5}, tokens={"r": TOKEN}))

    meta = call("127.0.0.1", prefill.port, m.MetaRequest(version=V, request_id="r", token=TOKEN), 2.0, m.WorkerMeta)
    assert [(layer.name, layer.base_addr, layer.num_blocks) for layer in meta.layers] == \
        [(name, t.data_ptr(), 4) for name, t in source.items()]
    assert (meta.engine_id, meta.model, meta.dtype, meta.kvpp) == ("prefill", "DeepseekV2ForCausalLM/layers=2",
                                                                  "float32", False)
    with pytest.raises(ChannelError, match="unauthorized"):
        call("127.0.0.1", prefill.port, m.MetaRequest(version=V, request_id="r", token=OTHER), 2.0, m.WorkerMeta)

    # Nobody claimed it: the 1 s lease lapses, within finished_until's 20 s liveness bound (a hold kept to the
    # 30 s default would not be).
    assert finished_until(prefill, lambda s, r: "r" in s) == ({"r"}, set())
    counted = prefill.get_stats().reduce()
    assert (counted["lapsed_holds"], counted["refused_requests"]) == (1, 1)


def test_a_failed_pull_is_reported_once_as_load_errors_of_its_blocks(start_worker, caplog):
    decode = start_worker("decode", handshake_timeout_s=0.5)
    decode.register_kv_caches(caches(8))
    nobody = SimpleNamespace(engine_id="gone", port=free_port())  # no prefill listens there
    decode.start_load_kv(MooncakeV2Metadata(loads=[LoadSpec("d-req", handle(nobody, "p-req", [1, 2]),
                                                            (6, 7), (1, 2), time.time())]))

    assert finished_until(decode, lambda s, r: "d-req" in r) == (set(), {"d-req"})
    assert decode.get_block_ids_with_load_errors() == {6, 7}  # vLLM's kv_load_failure_policy decides
    assert decode.get_block_ids_with_load_errors() == set()
    assert decode.get_stats().reduce()["failed_pulls"] == 1
    assert "request d-req: pulling KV from prefill gone failed" in caplog.text


class _Raising:
    """A decode's real transfer engine whose status check raises (the binding failing otherwise than with a failed
    transfer) until `calm` is set; the reads it started run on."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.calm = threading.Event()
        self.raised = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def transfer_check_status(self, batch_id: int) -> int:
        if not self.calm.is_set():
            self.raised += 1
            raise RuntimeError("binding hiccup")
        return self._engine.transfer_check_status(batch_id)


def _raising_pull(start_worker, monkeypatch, progress_s: str):
    """A pull whose binding raises at its first status check, Mooncake's progress bound the operator's `progress_s`:
    (prefill, decode, binding, pull future, the caches, kept alive: the engines read and write them)."""
    from connectors.common.mooncake_env import PROGRESS_TIMEOUT_ENV, SETTER_ENV

    monkeypatch.setenv(PROGRESS_TIMEOUT_ENV, progress_s)
    monkeypatch.delenv(SETTER_ENV, raising=False)
    prefill, decode = start_worker("prefill"), start_worker("decode")
    kept = caches(16, seed=3), caches(8)
    prefill.register_kv_caches(kept[0])
    decode.register_kv_caches(kept[1])
    binding = decode.transfer._engine = _Raising(decode.transfer._engine)
    prefill.start_load_kv(MooncakeV2Metadata(holds={"p-req": 30.0}, tokens={"p-req": TOKEN}))
    decode.start_load_kv(MooncakeV2Metadata(loads=[LoadSpec("d-req", handle(prefill, "p-req", [9, 4, 5]),
                                                            (0, 1, 2), (9, 4, 5), time.time())]))
    return prefill, decode, binding, decode._pulls["d-req"][0], kept


def test_a_pull_whose_binding_raises_keeps_its_blocks_until_mooncake_says_its_reads_ended(start_worker, monkeypatch):
    """Issue 41: the binding raises something else than a TransferError mid-pull. The pull fails, but its request is
    not reported (so vLLM neither reuses its blocks nor recomputes into them) while its reads may still write: the
    binding cannot say, and Mooncake's own bound (its progress timeout, the operator's 30 s here) is far. Once the
    binding says the reads ended, the request is reported with its blocks as load errors, in that same step."""
    prefill, decode, binding, pull, (source, target) = _raising_pull(start_worker, monkeypatch, "30")
    deadline = time.monotonic() + 20  # liveness: the pull fails at its first status check
    while not pull.done():
        assert time.monotonic() < deadline and decode.get_finished() == (set(), set())
        time.sleep(0.01)
    assert not pull.result().ok and binding.raised >= 1
    for _ in range(50):
        assert decode.get_finished() == (set(), set()), "reported while its reads may still write"
        assert decode.get_block_ids_with_load_errors() == set()
        time.sleep(0.01)
    assert sum(decode.transfer._in_flight.values()) == 4, "the lanes of the reads the binding said nothing of"
    binding.calm.set()
    _, recving = decode.get_finished()
    assert recving == {"d-req"} and decode.get_block_ids_with_load_errors() == {0, 1, 2}
    assert decode.transfer._in_flight == {}
    assert decode.get_stats().reduce()["failed_pulls"] == 1
    assert all(torch.equal(target[n][:3], source[n][[9, 4, 5]]) for n in LAYERS), "the reads it held for did land"


def test_a_pull_whose_reads_outlive_mooncake_s_bound_is_reported_then_and_their_lanes_stay_taken(start_worker,
                                                                                                monkeypatch, caplog):
    """The binding keeps raising: the request is reported once Mooncake's own bound expired (its 1 s progress
    timeout plus the margin, after the pull failed), not before; the lanes of the reads it still cannot say ended
    stay counted, and are given back once it says so, before the next pull from that prefill takes one."""
    from connectors.mooncake.transfer import DRAIN_MARGIN_S

    started = time.monotonic()
    prefill, decode, binding, pull, _ = _raising_pull(start_worker, monkeypatch, "1")
    assert finished_until(decode, lambda s, r: "d-req" in r) == (set(), {"d-req"})
    assert time.monotonic() - started >= 1 + DRAIN_MARGIN_S  # a lower bound: the bound ran from the pull's end
    assert decode.get_block_ids_with_load_errors() == {0, 1, 2}
    assert sum(decode.transfer._in_flight.values()) == 4
    assert "past its own bound (MC_TCP_PROGRESS_TIMEOUT_SEC=1)" in caplog.text
    binding.calm.set()
    prefill.start_load_kv(MooncakeV2Metadata(holds={"p-2": 30.0}, tokens={"p-2": TOKEN}))
    decode.start_load_kv(MooncakeV2Metadata(loads=[LoadSpec("d-2", handle(prefill, "p-2", [9]), (3,), (9,),
                                                            time.time())]))
    assert finished_until(decode, lambda s, r: "d-2" in r) == (set(), {"d-2"})
    assert decode.get_block_ids_with_load_errors() == set() and decode.transfer._in_flight == {}


def test_a_load_with_no_blocks_only_tells_the_prefill_to_free(start_worker):
    """A decode request aborted before it was scheduled: nothing is read, the prefill frees at once."""
    prefill, decode = start_worker("prefill"), start_worker("decode")
    prefill.register_kv_caches(caches(4, seed=2))
    decode.register_kv_caches(caches(4))
    prefill.start_load_kv(MooncakeV2Metadata(holds={"p-req": 30.0}, tokens={"p-req": TOKEN}))
    decode.start_load_kv(MooncakeV2Metadata(loads=[LoadSpec("d-req", handle(prefill, "p-req", [1]), (), ())]))

    assert finished_until(prefill, lambda s, r: "p-req" in s) == ({"p-req"}, set())
    assert decode.get_finished() == (set(), set())  # never a pull to report
    assert decode.get_stats() is None


def _flood(port: int, stop: threading.Event, sent: dict) -> None:
    """A stranger (no token the prefill issued) on one DEALER socket, pipelining without waiting for
    answers: metadata requests (the deferred queue), done-notices and lease renewals of made-up
    requests (the early-notice table), and messages of a thousand parts (the envelope check)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")

    def stranger_id() -> tuple[str, str]:
        return f"x-{secrets.token_hex(8)}", secrets.token_urlsafe(32)

    try:
        while not stop.is_set():
            for kind in ["meta"] * 300 + ["done"] * 150 + ["renew"] * 50:  # more than MAX_DEFERRED at once
                rid, token = stranger_id()
                message = {"meta": m.MetaRequest(version=V, request_id=rid, token=token),
                           "done": m.DoneNotice(version=V, request_id=rid, token=token, consumer="x", num_consumers=1,
                                                success=True),
                           "renew": m.LeaseRenewal(version=V, claims=[m.LeaseClaim(request_id=f"{rid}-{i}", token=token)
                                                                      for i in range(m.MAX_CLAIMS)])}[kind]
                sock.send_multipart([b"", m.encode(message)])
                sent[kind] += 1
                sent["total"] += 1
            sock.send_multipart([b"", b"x" * 1024] * 500)  # 1000 parts
            sent["parts"] += 1
            deadline = time.monotonic() + 5  # every request is answered; wait for the batch's answers
            while sent["answered"] < sent["total"] and sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                _, frame = sock.recv_multipart()
                reply = m.decode(frame)
                sent["answered"] += 1
                sent[f"answer:{reply.error if isinstance(reply, m.Ack) else type(reply).__name__}"] += 1
    finally:
        sock.close()


def test_a_stranger_flooding_every_side_channel_table_starves_no_real_pull(start_worker):
    """While a stranger floods the prefill worker's side channel, four real P/D requests whose decode
    asks before the prefill worker has heard of the hold (the early path: renewal kept, metadata
    request deferred) all pull their blocks intact and are released. The stranger's messages are refused
    at once and counted; none of its made-up requests is kept in the early-notice table or the deferred
    queue (with a token the prefill never issued they cannot be told from real early ones otherwise)."""
    prefill = start_worker("prefill", handshake_timeout_s=4.0)  # requests wait up to 2 s for their hold
    decode = start_worker("decode", handshake_timeout_s=4.0, max_pulls_per_prefill=4)
    source, target = caches(32, seed=7), caches(32)
    prefill.register_kv_caches(source)
    decode.register_kv_caches(target)
    prefill.start_load_kv(MooncakeV2Metadata(token_key=KEY))  # a first step: the scheduler's key arrives
    sent = collections.Counter()
    stop = threading.Event()
    flood = threading.Thread(target=_flood, args=(prefill.port, stop, sent), daemon=True)
    flood.start()
    try:
        while sent["total"] < 1000:  # the queue and tables are under fire before the real requests come
            time.sleep(0.05)
        requests = {f"p-{i}": (issued(f"p-{i}"), [4 * i + 1, 4 * i + 2, 4 * i + 3]) for i in range(4)}
        decode.start_load_kv(MooncakeV2Metadata(loads=[
            LoadSpec(f"d-{i}", handle(prefill, rid, blocks, token), (10 + 3 * i, 11 + 3 * i, 12 + 3 * i), tuple(blocks),
                     time.time()) for i, (rid, (token, blocks)) in enumerate(requests.items())]))
        time.sleep(0.5)  # the decode's renewals and metadata requests are in; then the hold announcement
        prefill.start_load_kv(MooncakeV2Metadata(holds=dict.fromkeys(requests, 30.0),
                                                 tokens={rid: token for rid, (token, _) in requests.items()},
                                                 token_key=KEY))
        assert finished_until(decode, lambda s, r: len(r) == 4) == (set(), {f"d-{i}" for i in range(4)})
        assert finished_until(prefill, lambda s, r: len(s) == 4) == (set(requests), set())
        unknown, deferred = list(prefill.holds._unknown), len(prefill._server._deferred)
    finally:
        stop.set()
        flood.join(timeout=10)
    assert decode.get_block_ids_with_load_errors() == set()
    for i, (_, blocks) in enumerate(requests.values()):
        for name in LAYERS:
            assert torch.equal(target[name][10 + 3 * i:13 + 3 * i], source[name][blocks])
    assert not any(rid.startswith("x-") for rid in unknown) and deferred == 0
    # Every stranger's request was answered, at once and alike: unauthorized (none deferred, none kept).
    answers = {k: v for k, v in sent.items() if k.startswith("answer:")}
    assert answers == {"answer:unauthorized": sent["answered"]} and sent["answered"] >= sent["total"] - 500, sent
    counted = prefill.get_stats().reduce()
    assert counted["refused_requests"] >= sent["answered"] and counted["malformed_frames"] >= 1
    print(f"stranger's flood: {sent['meta']} metadata requests, {sent['done']} done-notices, {sent['renew']} "
          f"renewals of {m.MAX_CLAIMS} claims, {sent['parts']} messages of 1000 parts; "
          f"{counted['refused_requests']} refused, {counted['malformed_frames']} malformed; 4 early P/D pulls intact")



def test_a_pull_from_a_stopped_prefill_is_given_up_and_reported_once_nothing_can_land(start_worker, peers, monkeypatch):
    """The decode's state machine with a stand-in prefill in its own process: a pull from it while it is
    SIGSTOPped is given up at the stall bound and reported as load errors of its blocks only once none
    of its reads can still write (the transfer engine gave every lane back); after SIGCONT nothing lands
    in those blocks, the next pull from the resumed prefill is whole, and the give-up is counted."""
    from testbed.mooncake_peer import MODEL_KEY, TOKEN as PEER_TOKEN, layer_name, pages

    monkeypatch.setattr(worker_module, "model_key", lambda config: MODEL_KEY)  # the stand-in's model
    decode = start_worker("decode", stall_timeout_s=2.0, transfer_timeout_s=10.0)
    peer = peers(free_port(), layers=2, blocks=64, seed=4, holds={"w": PEER_TOKEN, "r": PEER_TOKEN, "r2": PEER_TOKEN})
    target = {layer_name(i): torch.zeros((64, *BLOCK_SHAPE)) for i in range(2)}
    decode.register_kv_caches(target)
    blocks = tuple(range(16))

    def load(request_id: str) -> None:
        h = PrefillHandle(remote_engine_id="peer", remote_request_id=request_id, remote_token=PEER_TOKEN,
                          remote_host="127.0.0.1", remote_kv_port=peer.port, remote_tp_size=1,
                          remote_block_ids=list(blocks), remote_num_tokens=16 * len(blocks))
        decode.start_load_kv(MooncakeV2Metadata(loads=[LoadSpec(f"d-{request_id}", h, blocks, blocks, time.time())]))

    load("w")  # metadata cached and lanes connected, as for a prefill this decode pulled from before
    assert finished_until(decode, lambda s, r: "d-w" in r) == (set(), {"d-w"})
    assert decode.get_block_ids_with_load_errors() == set()
    decode.get_stats()
    for t in target.values():
        t.fill_(-7.0)
    os.kill(peer.proc.pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        load("r")
        assert finished_until(decode, lambda s, r: "d-r" in r, timeout_s=30) == (set(), {"d-r"})
        reported = time.monotonic() - stopped
        assert decode.transfer._in_flight == {}  # reported only once no read of the pull was in flight
        assert decode.get_block_ids_with_load_errors() == set(blocks)
        at_report = {name: t.clone() for name, t in target.items()}
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    time.sleep(4.0)
    assert all(torch.equal(target[name], at_report[name]) for name in target), "bytes landed after the report"
    counted = decode.get_stats().reduce()
    assert (counted["failed_pulls"], counted["stalled_pulls"], counted["pulled_requests"]) == (1, 1, 0)
    assert reported < 2.0 + 10, f"reported {reported:.1f} s after the prefill stopped"

    load("r2")
    assert finished_until(decode, lambda s, r: "d-r2" in r) == (set(), {"d-r2"})
    assert decode.get_block_ids_with_load_errors() == set()
    expected = pages(2, 64, 4)
    assert all(torch.equal(target[layer_name(i)][:16], expected[i, :16]) for i in range(2))
    print(f"a pull from a stopped prefill was reported failed {reported:.2f} s after the stop")


def test_a_read_whose_lease_grant_is_late_gets_a_whole_stall_bound_for_the_confirmation(start_worker, monkeypatch):
    """The read landed, but the prefill's side channel is slow (a busy prefill): its lease grant is waited for one
    stall bound, then the confirmation gets a whole bound of its own, so a live prefill that answers late keeps the
    read (cut to what the grant left, a crowd's confirmation once got 0.05 s and a good read was discarded)."""
    decode = start_worker("decode", stall_timeout_s=1.0)
    decode.register_kv_caches(caches(4))
    asked: dict[str, float] = {}

    def lease_end(claim, until):  # no grant in time: the wait runs out its deadline
        asked["lease_wait"] = until - time.monotonic()
        time.sleep(max(until - time.monotonic(), 0))
        return None

    def notify(handle, ok, timeout_s=None):
        asked["confirm_timeout"] = timeout_s
        return True, []  # the prefill confirms it held the blocks throughout

    moved = SimpleNamespace(nbytes=1, seconds=0.01, entries=1, retried=0, handshake_s=0.0)
    monkeypatch.setattr(decode._puller, "claim", lambda handle: SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(decode._puller, "read", lambda *args: moved)
    monkeypatch.setattr(decode._puller, "lease_end", lease_end)
    monkeypatch.setattr(decode._puller, "notify", notify)
    spec = LoadSpec("d-1", handle(decode, "p-1", [1]), (1,), (1,), time.time())
    pulled = decode._pull(spec, time.monotonic())
    assert pulled.ok  # confirmed: the read is kept
    assert 0 < asked["lease_wait"] <= 1.0 and asked["confirm_timeout"] == 1.0