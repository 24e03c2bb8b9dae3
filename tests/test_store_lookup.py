"""The scheduler -> worker-0 lookup channel over real ZeroMQ IPC: answers, bad input, dead peers, late replies."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import pytest
import zmq

from connectors.store.keys import block_hashes
from connectors.store.lookup import LookupClient, LookupReply, LookupServer, lookup_path

pytestmark = pytest.mark.integration

HASHES = block_hashes(list(range(16 * 6)), 16)


@pytest.fixture
def endpoint(tmp_path, monkeypatch, free_port):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    return lookup_path(free_port, dp_rank=1)


def test_path_is_per_port_and_dp_rank(endpoint, tmp_path):
    assert endpoint.startswith(f"ipc://{tmp_path}/") and endpoint.endswith("-dp1")
    assert lookup_path(5000, 0) != lookup_path(5000, 1) != lookup_path(5001, 1)


def test_answer_comes_from_the_worker(endpoint):
    server = LookupServer(endpoint, lambda hashes: 4 if hashes == HASHES else 0)
    client = LookupClient(endpoint, timeout_s=2)
    try:
        assert client.hit_blocks(HASHES) == (4, "")
        assert client.hit_blocks(HASHES[:2]) == (0, "")
        assert client.hit_blocks([]) == (0, "")
    finally:
        client.close()
        server.close()
    assert not os.path.exists(endpoint.removeprefix("ipc://")), "the socket file is removed on close"


def test_a_failing_lookup_is_a_miss_with_the_reason(endpoint):
    def boom(_hashes):
        raise RuntimeError("store unreachable")

    server = LookupServer(endpoint, boom)
    client = LookupClient(endpoint, timeout_s=2)
    try:
        hit, error = client.hit_blocks(HASHES)
        assert hit == 0 and "store unreachable" in error
    finally:
        client.close()
        server.close()


def test_malformed_requests_are_answered_with_an_error(endpoint):
    server = LookupServer(endpoint, lambda hashes: len(hashes))
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
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


def test_no_worker_means_a_bounded_miss(endpoint):
    client = LookupClient(endpoint, timeout_s=0.3)
    start = time.monotonic()
    hit, error = client.hit_blocks(HASHES)
    assert hit == 0 and "within 300 ms" in error
    assert time.monotonic() - start < 1.5
    client.close()


def test_a_late_reply_is_not_taken_for_the_next_answer(endpoint):
    slow = threading.Event()

    def count(hashes):
        if len(hashes) == 1:
            slow.wait(2)  # the first lookup answers after the client gave up
            return 1
        return 5

    server = LookupServer(endpoint, count)
    client = LookupClient(endpoint, timeout_s=0.3)
    try:
        assert client.hit_blocks(HASHES[:1])[0] == 0
        slow.set()
        assert client.hit_blocks(HASHES)[0] == 5
    finally:
        client.close()
        server.close()
