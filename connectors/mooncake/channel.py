"""ZeroMQ side channel: each worker answers metadata requests and done-notices on its handshake port.

Every client call has a deadline (a fresh REQ socket per call, LINGER 0), so a dead or hung peer
costs at most `timeout_s` and never wedges the caller.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import zmq

from connectors.mooncake.affinity import run_unpinned, unpin_current_thread
from connectors.mooncake.messages import PROTOCOL_VERSION, Ack, Message, MessageError, decode, encode


class ChannelError(RuntimeError):
    """The peer did not answer in time or answered with an error."""


class PortInUseError(RuntimeError):
    """The handshake port is taken, usually by another instance with an overlapping kv_port range."""


class SideChannelServer:
    """A ROUTER socket served by a daemon thread; `handler` maps a request to a reply message."""

    def __init__(self, host: str, port: int, handler: Callable[[Message], Message], what: str) -> None:
        # libzmq starts its I/O thread with the first socket: do that off the rank's pinned cores.
        self._ctx, self._sock = run_unpinned(self._bind_router(host, port, what))
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvpp-sidechannel-{port}", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind_router(host: str, port: int, what: str):
        def bind():
            ctx = zmq.Context()
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError as exc:
                sock.close()
                ctx.term()
                raise PortInUseError(f"{what} cannot bind tcp://{host}:{port}: {exc}") from exc
            return ctx, sock

        return bind

    def _serve(self) -> None:
        unpin_current_thread()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                continue  # not a REQ envelope; nothing sensible to answer
            identity, _, payload = frames
            try:
                reply = self._handler(decode(payload))
            except MessageError as exc:
                reply = Ack(version=PROTOCOL_VERSION, ok=False, error=str(exc))
            except Exception as exc:  # the server thread must outlive one bad request
                reply = Ack(version=PROTOCOL_VERSION, ok=False, error=f"{type(exc).__name__}: {exc}")
            self._sock.send_multipart([identity, b"", encode(reply)])
        self._sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._ctx.term()


_client_ctx: zmq.Context | None = None


def _client_context() -> zmq.Context:
    """Our own context, not zmq.Context.instance(): vLLM's workers share that one (and its single
    I/O thread, pinned to the rank's core) with their per-step notify sockets."""
    global _client_ctx
    if _client_ctx is None:
        _client_ctx = zmq.Context()
    return _client_ctx


def call(host: str, port: int, message: Message, timeout_s: float, expected: type) -> Message:
    """Send one request and wait at most `timeout_s` for its reply of type `expected`."""
    sock = _client_context().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    ms = max(1, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, ms)
    sock.setsockopt(zmq.RCVTIMEO, ms)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(encode(message))
        frame = sock.recv()
    except zmq.Again as exc:
        raise ChannelError(f"no answer from tcp://{host}:{port} within {timeout_s}s") from exc
    finally:
        sock.close()
    reply = decode(frame)
    if isinstance(reply, Ack) and not reply.ok:
        raise ChannelError(f"tcp://{host}:{port} refused {type(message).__name__}: {reply.error}")
    if not isinstance(reply, expected):
        raise ChannelError(
            f"tcp://{host}:{port} answered {type(reply).__name__} to {type(message).__name__}"
        )
    return reply


class Calls:
    """One request sent to several peers at once; the answers are collected later, so the caller
    can do other work (a read) meanwhile and the peers answer in parallel. Every answer is bounded
    by one deadline. Use from one thread (ZeroMQ sockets are not thread-safe)."""

    def __init__(self, targets: list[tuple[str, int]], message: Message, timeout_s: float, expected: type) -> None:
        self.sent_at = time.monotonic()
        self._deadline = self.sent_at + timeout_s
        self._message = message
        self._expected = expected
        self._socks = []
        frame = encode(message)
        try:
            for host, port in targets:
                sock = _client_context().socket(zmq.REQ)
                self._socks.append((f"tcp://{host}:{port}", sock))
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(f"tcp://{host}:{port}")
                sock.send(frame, zmq.NOBLOCK)  # queued until connected; the deadline bounds the rest
        except zmq.ZMQError as exc:
            self.close()
            raise ChannelError(f"cannot send {type(message).__name__} to {self._socks[-1][0]}: {exc}") from exc

    def close(self) -> None:
        """Give up on the answers (idempotent)."""
        for _, sock in self._socks:
            sock.close()

    def results(self) -> list[Message | ChannelError]:
        """Per target, in order: its answer of the expected type, or the ChannelError why not."""
        out: dict[int, Message | ChannelError] = {}
        poller = zmq.Poller()
        index = {}
        for i, (_, sock) in enumerate(self._socks):
            poller.register(sock, zmq.POLLIN)
            index[id(sock)] = i
        try:
            while len(out) < len(self._socks):
                left_ms = int((self._deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    break
                for sock, _ in poller.poll(left_ms):
                    i = index[id(sock)]
                    out[i] = self._check(self._socks[i][0], sock.recv())
                    poller.unregister(sock)
        finally:
            self.close()
        return [out[i] if i in out else ChannelError(f"no answer from {address} within the deadline")
                for i, (address, _) in enumerate(self._socks)]

    def _check(self, address: str, frame: bytes) -> Message | ChannelError:
        try:
            reply = decode(frame)
        except MessageError as exc:
            return ChannelError(f"{address}: {exc}")
        if isinstance(reply, Ack) and not reply.ok:
            return ChannelError(f"{address} refused {type(self._message).__name__}: {reply.error}")
        if not isinstance(reply, self._expected):
            return ChannelError(f"{address} answered {type(reply).__name__} to {type(self._message).__name__}")
        return reply
