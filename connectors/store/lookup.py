"""Scheduler -> worker rank 0 lookup over ZeroMQ: "how many leading blocks of this prefix are pooled?"

The scheduler has no pool client of its own; worker rank 0 knows the cache layout and every shard a
block needs. Messages are typed msgspec structs, validated on both ends; every wait is bounded, and
anything unexpected (timeout, dead worker, malformed reply) is a miss. A lookup the pool did not answer is a
failure, not an answer of 0 blocks: the reply says so, and it proves no pooled block lost.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import zmq

from connectors.store.ipc import SocketOwnership, socket_path
from connectors.store.keys import HASH_HEX_LEN

MAX_BLOCKS = 1 << 20
_HEX = re.compile(rf"^[0-9a-f]{{{HASH_HEX_LEN}}}$")


class LookupRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    block_hashes: list[str]
    request_id: str = ""


class LookupReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    hit_blocks: int
    error: str = ""
    """Why there is no answer (empty: the pool answered). hit_blocks is then 0 and means nothing: the request is
    served as a miss, and the lookup says nothing of which blocks the pool holds."""
    counted: bool = False
    """The worker counted this failure (the pool did not answer it); the scheduler counts the others."""

    @property
    def answered(self) -> bool:
        return not self.error


class InvalidMessage(ValueError):
    pass


def validate_request(msg: LookupRequest) -> LookupRequest:
    if len(msg.block_hashes) > MAX_BLOCKS:
        raise InvalidMessage(f"lookup of {len(msg.block_hashes)} blocks exceeds {MAX_BLOCKS}")
    bad = next((h for h in msg.block_hashes if not _HEX.match(h)), None)
    if bad is not None:
        raise InvalidMessage(f"block hash {bad[:80]!r} is not {HASH_HEX_LEN} lowercase hex digits")
    return msg


def validate_reply(msg: LookupReply, asked: int) -> LookupReply:
    if not 0 <= msg.hit_blocks <= asked:
        raise InvalidMessage(f"reply claims {msg.hit_blocks} hit blocks for a lookup of {asked}")
    if msg.hit_blocks and not msg.answered:
        raise InvalidMessage(f"reply claims {msg.hit_blocks} hit blocks and a failure ({msg.error[:80]!r})")
    if msg.counted and msg.answered:
        raise InvalidMessage("reply counts a failure it does not name")
    return msg


OPTION = "kv_connector_extra_config.lookup_rpc_port"


@dataclass(frozen=True)
class LookupChannel:
    """One DP rank's lookup channel: a Unix socket in this user's private directory, named by
    lookup_rpc_port (a name, not a TCP port) so that the scheduler and worker rank 0 derive the same."""

    lookup_rpc_port: int
    dp_rank: int = 0

    @property
    def path(self) -> str:
        return socket_path(f"pool-lookup-{self.lookup_rpc_port}-dp{self.dp_rank}.sock")

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.path}"


def lookup_path(lookup_rpc_port: int, dp_rank: int) -> str:
    """The IPC endpoint of a lookup channel, for tools and tests that look for an engine's socket."""
    return LookupChannel(lookup_rpc_port, dp_rank).endpoint


class LookupServer:
    """Answers lookups on worker rank 0 in a daemon thread, with `lookup(hashes) -> LookupReply`. Owns its
    socket name exclusively (connectors.store.ipc): a second engine on the same lookup_rpc_port fails here."""

    def __init__(self, channel: LookupChannel, lookup: Callable[[Sequence[str]], LookupReply]) -> None:
        self._lookup = lookup
        self._owner = SocketOwnership(channel.path, OPTION, channel.lookup_rpc_port)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(channel.endpoint)  # replaces a stale socket file of a dead owner
        except zmq.ZMQError:
            self._sock.close(linger=0)
            self._owner.release(remove_socket=False)
            raise
        self._stop = threading.Event()
        self._decoder = msgspec.msgpack.Decoder(LookupRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._serve, name="kvpp-pool-lookup", daemon=True)
        self._thread.start()

    def _answer(self, raw: bytes) -> LookupReply:
        try:
            req = validate_request(self._decoder.decode(raw))
        except (msgspec.DecodeError, msgspec.ValidationError, InvalidMessage) as exc:
            return LookupReply(hit_blocks=0, error=f"invalid lookup: {exc}")
        try:
            return self._lookup(req.block_hashes)
        except Exception as exc:  # a lookup failure must answer "no answer", never kill the channel
            return LookupReply(hit_blocks=0, error=f"lookup failed: {exc}")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            raw = self._sock.recv()
            self._sock.send(self._encoder.encode(self._answer(raw)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        self._owner.release()  # not every libzmq removes its socket file; only its owner may


class LookupClient:
    """Scheduler side. `lookup` returns the worker's reply, or one naming why none came (timeout, channel error,
    malformed reply)."""

    def __init__(self, channel: LookupChannel, timeout_s: float) -> None:
        self._endpoint = channel.endpoint
        self._timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context.instance()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(LookupReply)
        self._sock = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        # A timed-out request must not wedge the REQ state machine, and a late reply to it must
        # not be taken as the answer to the next one.
        sock.setsockopt(zmq.REQ_RELAXED, 1)
        sock.setsockopt(zmq.REQ_CORRELATE, 1)
        sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        sock.connect(self._endpoint)
        return sock

    def lookup(self, block_hashes: list[str], request_id: str = "", timeout_s: float | None = None) -> LookupReply:
        """The worker's answer within the client's timeout, or `timeout_s` if shorter (what is left of the request's
        pool budget)."""
        if not block_hashes:
            return LookupReply(hit_blocks=0)
        timeout_ms = self._timeout_ms if timeout_s is None else min(self._timeout_ms, int(timeout_s * 1000))
        try:
            self._sock.send(self._encoder.encode(LookupRequest(block_hashes=block_hashes, request_id=request_id)))
            raw = self._reply_within(timeout_ms)
            if raw is None:
                return LookupReply(0, f"no lookup answer from worker rank 0 within {timeout_ms} ms")
            return validate_reply(self._decoder.decode(raw), len(block_hashes))
        except (zmq.ZMQError, msgspec.DecodeError, msgspec.ValidationError, InvalidMessage) as exc:
            self._sock.close(linger=0)
            self._sock = self._connect()
            return LookupReply(0, f"lookup channel error: {exc}")

    def _reply_within(self, timeout_ms: int) -> bytes | None:
        """The answer to the request just sent, or None at the deadline. A late reply to a timed-out
        request also wakes `poll`; REQ_CORRELATE drops it inside `recv`, so `recv` must not block."""
        deadline = time.monotonic() + timeout_ms / 1000
        while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
            if not self._sock.poll(left_ms, zmq.POLLIN):
                return None
            try:
                return self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                continue  # only a stale reply was queued
        return None

    def close(self) -> None:
        self._sock.close(linger=0)
