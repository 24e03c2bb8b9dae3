"""The scheduler -> worker-0 lookup channel over real ZeroMQ IPC: answers, bad input, dead peers, late replies."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from tests.helpers.paths import REPO
import zmq

from connectors.store.keys import block_hashes
from connectors.store.ipc import IpcPathError, SocketInUse, private_dir
from connectors.store.lookup import (InvalidMessage, LookupChannel, LookupClient, LookupReply, LookupRequest, LookupServer,
                                     lookup_path, validate_reply, validate_request)

HASHES = block_hashes(list(range(16 * 6)), 16)


@pytest.fixture
def channel(runtime_dir, free_port):
    return LookupChannel(free_port, dp_rank=1)


@pytest.fixture
def endpoint(channel):
    return channel


@pytest.mark.integration
def test_sockets_live_in_a_private_directory_per_port_and_dp_rank(channel, runtime_dir):
    assert channel.path.startswith(f"{runtime_dir}/kvpp/") and channel.path.endswith("-dp1.sock")
    assert LookupChannel(5000, 0).path != LookupChannel(5000, 1).path != LookupChannel(5001, 1).path
    assert lookup_path(channel.lookup_rpc_port, 1) == f"ipc://{channel.path}"
    server = LookupServer(channel, lambda hashes: LookupReply(0))
    try:
        st = os.stat(runtime_dir / "kvpp")
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
        assert stat.S_ISSOCK(os.stat(channel.path).st_mode)
    finally:
        server.close()


@pytest.mark.integration
def test_without_xdg_runtime_dir_the_directory_is_per_user_in_tmp(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    assert private_dir() == f"{tmp_path}/kvpp-{os.getuid()}"
    assert stat.S_IMODE(os.stat(private_dir()).st_mode) == 0o700


@pytest.mark.integration
@pytest.mark.parametrize("plant", ["open-mode", "symlink", "file"])
def test_an_unsafe_socket_directory_is_refused(runtime_dir, plant):
    target = runtime_dir / "kvpp"
    if plant == "open-mode":
        target.mkdir(mode=0o777)
        os.chmod(target, 0o777)
    elif plant == "symlink":
        (runtime_dir / "elsewhere").mkdir(mode=0o700)
        target.symlink_to(runtime_dir / "elsewhere")
    else:
        target.write_text("x")
    with pytest.raises(IpcPathError, match="must be a directory owned by uid .* with mode 0700"):
        LookupChannel(6000).path


@pytest.mark.integration
def test_a_second_engine_on_the_same_port_fails_and_cannot_remove_the_first_ones_socket(channel):
    first = LookupServer(channel, lambda hashes: LookupReply(3))
    client = LookupClient(channel, timeout_s=2)
    try:
        with pytest.raises(SocketInUse, match=rf"lookup_rpc_port {channel.lookup_rpc_port} is already in use.*pid {os.getpid()}"):
            LookupServer(channel, lambda hashes: LookupReply(0))
        assert os.path.exists(channel.path), "the failed second server left the first one's socket alone"
        assert client.lookup(HASHES) == LookupReply(3), "the first engine still answers its own scheduler"
    finally:
        client.close()
        first.close()
    assert not os.path.exists(channel.path), "the owner removes its socket on close"
    LookupServer(channel, lambda hashes: LookupReply(0)).close()  # the name is free again


_OWNER = """
import sys, time
from connectors.store.lookup import LookupChannel, LookupReply, LookupServer
server = LookupServer(LookupChannel(int(sys.argv[1]), 1), lambda hashes: LookupReply(2))
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.integration
def test_a_port_held_by_another_process_fails_and_a_killed_owners_socket_is_reclaimed(channel):
    root = str(REPO)
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(channel.lookup_rpc_port)], stdout=subprocess.PIPE,
                             text=True, cwd=root, env={**os.environ, "PYTHONPATH": root})
    try:
        assert owner.stdout.readline().strip() == "ready"
        with pytest.raises(SocketInUse, match=f"pid {owner.pid}"):
            LookupServer(channel, lambda hashes: LookupReply(0))
        client = LookupClient(channel, timeout_s=2)
        assert client.lookup(HASHES) == LookupReply(2)
        client.close()
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert os.path.exists(channel.path), "a killed owner leaves its socket file behind"
    server = LookupServer(channel, lambda hashes: LookupReply(4))  # ...which the next engine reclaims
    client = LookupClient(channel, timeout_s=2)
    try:
        assert client.lookup(HASHES) == LookupReply(4)
    finally:
        client.close()
        server.close()


@pytest.mark.integration
def test_answer_comes_from_the_worker(endpoint):
    server = LookupServer(endpoint, lambda hashes: LookupReply(4 if hashes == HASHES else 0))
    client = LookupClient(endpoint, timeout_s=2)
    try:
        assert client.lookup(HASHES) == LookupReply(4)
        assert client.lookup(HASHES[:2]) == LookupReply(0)
        assert client.lookup([]) == LookupReply(0)
    finally:
        client.close()
        server.close()
    assert not os.path.exists(endpoint.path), "the socket file is removed on close"


@pytest.mark.integration
def test_a_failing_lookup_is_a_miss_with_the_reason(endpoint):
    def boom(_hashes):
        raise RuntimeError("store unreachable")

    server = LookupServer(endpoint, boom)
    client = LookupClient(endpoint, timeout_s=2)
    try:
        reply = client.lookup(HASHES)
        assert reply.hit_blocks == 0 and "store unreachable" in reply.error and not reply.counted
    finally:
        client.close()
        server.close()


@pytest.mark.integration
def test_a_lookup_the_pool_did_not_answer_reaches_the_scheduler_as_a_failure_the_worker_counted(endpoint):
    """Not as an answer of 0 blocks: that one would announce every pooled block of the prefix removed."""
    failed = LookupReply(0, "the pool did not answer: the store did not answer within its bound", counted=True)
    server = LookupServer(endpoint, lambda hashes: failed)
    client = LookupClient(endpoint, timeout_s=2)
    try:
        reply = client.lookup(HASHES)
        assert reply == failed and not reply.answered
    finally:
        client.close()
        server.close()


@pytest.mark.integration
def test_malformed_requests_are_answered_with_an_error(endpoint):
    server = LookupServer(endpoint, lambda hashes: LookupReply(len(hashes)))
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint.endpoint)
    try:
        for raw in (b"\x00garbage", msgspec.msgpack.encode({"block_hashes": ["zz"]}),
                    msgspec.msgpack.encode({"block_hashes": HASHES, "pickle": b"x"})):
            sock.send(raw)
            assert sock.poll(2000)
            reply = msgspec.msgpack.decode(sock.recv(), type=LookupReply)
            assert reply.hit_blocks == 0 and reply.error.startswith("invalid lookup")
    finally:
        sock.close()
        server.close()


@pytest.mark.integration
def test_no_worker_means_a_bounded_miss(endpoint):
    client = LookupClient(endpoint, timeout_s=0.3)
    start = time.monotonic()
    reply = client.lookup(HASHES)
    assert reply.hit_blocks == 0 and "within 300 ms" in reply.error and not reply.counted
    assert time.monotonic() - start < 10  # liveness: the 0.3 s bound with room for a loaded host; no worker: forever
    client.close()


@pytest.mark.integration
def test_a_late_reply_is_not_taken_for_the_next_answer(endpoint):
    late = threading.Event()

    def count(hashes):
        if len(hashes) == 1:
            late.wait(10)  # the first lookup answers only after the client gave up
            return LookupReply(1)
        return LookupReply(5)

    server = LookupServer(endpoint, count)
    client = LookupClient(endpoint, timeout_s=2.0)
    try:
        assert client.lookup(HASHES[:1]) == LookupReply(0, "no lookup answer from worker rank 0 within 2000 ms")
        late.set()
        assert client.lookup(HASHES) == LookupReply(5)
    finally:
        client.close()
        server.close()


@pytest.mark.integration
def test_a_late_reply_does_not_stretch_the_next_lookup_past_its_bound(endpoint):
    late, never = threading.Event(), threading.Event()

    def count(hashes):
        if len(hashes) == 1:
            late.wait(10)
            return LookupReply(1)
        never.wait(10)  # the second lookup is never answered in time
        return LookupReply(5)

    server = LookupServer(endpoint, count)
    client = LookupClient(endpoint, timeout_s=0.5)
    try:
        assert not client.lookup(HASHES[:1]).answered
        late.set()  # its reply now wakes the client's wait for the second answer
        start = time.monotonic()
        assert client.lookup(HASHES) == LookupReply(0, "no lookup answer from worker rank 0 within 500 ms")
        # Liveness: 10x the 0.5 s bound, short of the server's 10 s; the answer (0, not the late 5) is the proof.
        assert time.monotonic() - start < 5
    finally:
        never.set()
        client.close()
        server.close()


@pytest.mark.unit
def test_lookup_messages_round_trip_and_validate():
    hashes = block_hashes(list(range(64)), 16)
    raw = msgspec.msgpack.encode(LookupRequest(block_hashes=hashes, request_id="r1"))
    assert validate_request(msgspec.msgpack.decode(raw, type=LookupRequest)).block_hashes == hashes
    with pytest.raises(InvalidMessage, match="hex"):
        validate_request(LookupRequest(block_hashes=["../../etc/passwd"]))
    with pytest.raises(InvalidMessage, match="hex"):
        validate_request(LookupRequest(block_hashes=[hashes[0].upper()]))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"block_hashes": [1, 2]}), type=LookupRequest)
    with pytest.raises(msgspec.ValidationError):  # unknown fields are refused, not ignored
        msgspec.msgpack.decode(msgspec.msgpack.encode({"block_hashes": [], "x": 1}), type=LookupRequest)
    with pytest.raises(InvalidMessage, match="claims 5"):
        validate_reply(LookupReply(hit_blocks=5), asked=4)
    with pytest.raises(InvalidMessage):
        validate_reply(LookupReply(hit_blocks=-1), asked=4)
    with pytest.raises(InvalidMessage, match="hit blocks and a failure"):
        validate_reply(LookupReply(hit_blocks=2, error="the pool did not answer"), asked=4)
    with pytest.raises(InvalidMessage, match="does not name"):
        validate_reply(LookupReply(hit_blocks=0, counted=True), asked=4)
