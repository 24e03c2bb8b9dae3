"""ZeroMQ side channel: each worker answers metadata requests and done-notices on its handshake port.

Every client call has a deadline (a fresh REQ socket per call, LINGER 0), so a dead or hung peer
costs at most `timeout_s` and never wedges the caller. Frames have a size limit on both sides
(ZeroMQ's MAXMSGSIZE drops the connection of an oversize sender), and so have whole messages: parts
are received one at a time and counted, those past a request's three (a reply's one) are dropped
unkept. Requests waiting for their hold take at most MAX_DEFERRED_PER_REQUEST of the MAX_DEFERRED
slots per request id. A peer that is refused learns a
fixed `PeerError` code only; the reason goes to this side's log (rate-limited) and its counters.
With CURVE keys the channel is encrypted and a client without a trusted key gets no reply at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from connectors.common.hosts import host_url

from connectors.mooncake.affinity import run_unpinned, unpin_current_thread
from connectors.mooncake.curve import CurveKeys
from connectors.mooncake.messages import (
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Message,
    MessageError,
    PeerError,
    decode,
    encode,
)

# Plain logging under "vllm." (not vllm.logger.init_logger): the stand-in peer of the tests and
# benchmarks imports this without starting vLLM; inside vLLM the same handlers print it.
logger = logging.getLogger(f"vllm.{__name__}")

IDLE_POLL_MS = 100
DEFERRED_POLL_MS = 5
MAX_DEFERRED = 256
"""Requests waiting for their hold to be announced; beyond that a request is refused at once."""
MAX_DEFERRED_PER_REQUEST = 64
"""Of those, the most for one request id (one per decode worker asking this prefill worker)."""
RECEIVE_BATCH = 64
"""Requests read per turn of the server loop, between two rounds of asking the deferred ones again."""
REQUEST_PARTS = 3
"""A REQ envelope as a ROUTER receives it: the peer's identity, an empty delimiter, the payload."""


class ChannelError(RuntimeError):
    """The peer did not answer in time or answered with an error."""


class NoAnswer(ChannelError):
    """Nothing came back within the deadline (peer down, hung, or it refused our CURVE key)."""


class PortInUseError(RuntimeError):
    """The handshake port is taken, usually by another instance with an overlapping kv_port range."""


class Refused(Exception):
    """Raised by a handler: the peer gets `code` (or `reply`, a partial answer of a batch whose
    refused items it marks), the log and the counters get `detail` and `code`."""

    def __init__(self, code: PeerError, detail: str, reply: Message | None = None) -> None:
        super().__init__(detail)
        self.code = code
        self.reply = reply


def endpoint(host: str, port: int) -> str:
    """tcp endpoint of a host name or IP literal (IPv6 in brackets)."""
    return host_url("tcp", host, port)


class _LogLimiter:
    """At most one line per code per second, so a flood of bad frames cannot flood the log."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, code: str, what: str, detail: str) -> None:
        now = time.monotonic()
        if now - self._last.get(code, -1.0) < 1.0:
            self._suppressed[code] = self._suppressed.get(code, 0) + 1
            return
        self._last[code] = now
        more = self._suppressed.pop(code, 0)
        logger.warning("%s refused a side-channel request (%s): %s%s", what, code, detail,
                       f" (+{more} more since the last line)" if more else "")


class SideChannelServer:
    """A ROUTER socket served by a daemon thread.

    `handler` maps a request to a reply, raises `Refused`, or returns None for "not yet" (the
    request names a hold this worker has not been told about yet): such a request is asked again
    every few ms until `defer_s` passes, then refused as unknown. `on_refused(code)` counts refusals
    (CURVE denials included, as "unauthorized").
    """

    def __init__(self, host: str, port: int, handler: Callable[[Message], Message | None], what: str,
                 on_refused: Callable[[str], None] = lambda code: None, defer_s: float = 0.0,
                 curve: CurveKeys | None = None) -> None:
        self._handler = handler
        self._on_refused = on_refused
        self._defer_s = defer_s
        self._what = what
        self._log = _LogLimiter()
        self._deferred: list[tuple[float, bytes, Message]] = []
        self._auth = None
        # libzmq starts its I/O thread with the first socket: do that off the rank's pinned cores.
        self._ctx, self._sock = run_unpinned(lambda: self._bind_router(host, port, curve))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvpp-sidechannel-{port}", daemon=True)
        self._thread.start()

    def _bind_router(self, host: str, port: int, curve: CurveKeys | None):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        sock.setsockopt(zmq.IPV6, 1)
        if curve is not None:
            self._auth = curve.serve(ctx, sock, on_denied=lambda: self._on_refused("unauthorized"))
        try:
            sock.bind(endpoint(host, port))
        except zmq.ZMQError as exc:
            self._close(ctx, sock)
            raise PortInUseError(f"{self._what} cannot bind {endpoint(host, port)}: {exc}") from exc
        return ctx, sock

    def _serve(self) -> None:
        unpin_current_thread()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(DEFERRED_POLL_MS if self._deferred else IDLE_POLL_MS):
                for _ in range(RECEIVE_BATCH):  # what queued up, before the deferred are asked again
                    self._receive()
                    if not self._sock.poll(0):
                        break
            if self._deferred:
                deferred, self._deferred = self._deferred, []
                for deadline, identity, message in deferred:
                    self._answer(identity, message, deadline)
        self._sock.close()  # in the thread that used it: ZeroMQ sockets are not thread-safe

    def _receive(self) -> None:
        frames, parts = [], 0
        while True:  # never collect more parts than an envelope has, however many the peer sends
            frame = self._sock.recv(copy=False)
            parts += 1
            if parts <= REQUEST_PARTS:
                frames.append(frame)
            if not frame.more:
                break
        if parts != REQUEST_PARTS or frames[1].bytes != b"":
            self._refuse(None, "malformed", f"{parts} frames, not a REQ envelope", frames[-1])
            return
        identity, payload = frames[0].bytes, frames[2]
        try:
            message = decode(payload.bytes, max_bytes=MAX_REQUEST_BYTES)
        except MessageError as exc:
            self._refuse(identity, "malformed", str(exc), payload)
            return
        self._answer(identity, message, time.monotonic() + self._defer_s)

    def _answer(self, identity: bytes, message: Message, deadline: float) -> None:
        try:
            reply = self._handler(message)
        except Refused as exc:
            self._refuse(identity, exc.code, str(exc), reply=exc.reply)
            return
        except Exception as exc:  # the server thread must outlive one bad request
            logger.exception("%s failed to answer %s", self._what, type(message).__name__)
            self._refuse(identity, "internal", f"{type(exc).__name__}: {exc}")
            return
        if reply is None:
            if time.monotonic() < deadline and self._may_defer(message):
                self._deferred.append((deadline, identity, message))
            else:
                self._refuse(identity, "unknown_request", f"no live hold for {type(message).__name__} "
                             f"{getattr(message, 'request_id', '')!r}")
            return
        self._sock.send_multipart([identity, b"", encode(reply)])

    def _may_defer(self, message: Message) -> bool:
        request_id = getattr(message, "request_id", None)
        return len(self._deferred) < MAX_DEFERRED and sum(
            getattr(m, "request_id", None) == request_id for _, _, m in self._deferred) < MAX_DEFERRED_PER_REQUEST

    def _refuse(self, identity: bytes | None, code: PeerError, detail: str, frame: zmq.Frame | None = None,
                reply: Message | None = None) -> None:
        self._on_refused(code)
        peer = ""
        if frame is not None:
            try:
                peer = f" from {frame.get('Peer-Address')}"
            except zmq.ZMQError:
                pass
        self._log.warn(code, self._what, detail + peer)
        if identity is not None:
            reply = reply or Ack(version=PROTOCOL_VERSION, ok=False, error=code)
            self._sock.send_multipart([identity, b"", encode(reply)])

    def _close(self, ctx: zmq.Context, sock: zmq.Socket | None) -> None:
        if sock is not None:
            sock.close()
        if self._auth is not None:
            self._auth.stop()
        ctx.term()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._close(self._ctx, None)


_client_ctx: zmq.Context | None = None


def _client_context() -> zmq.Context:
    """Our own context, not zmq.Context.instance(): vLLM's workers share that one (and its single
    I/O thread, pinned to the rank's core) with their per-step notify sockets."""
    global _client_ctx
    if _client_ctx is None:
        _client_ctx = zmq.Context()
    return _client_ctx


def _client_socket(secure: Callable[[zmq.Socket], None] | None) -> zmq.Socket:
    sock = _client_context().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
    sock.setsockopt(zmq.IPV6, 1)
    if secure is not None:
        secure(sock)
    return sock


class Calls:
    """One request sent to several peers at once; the answers are collected later, so the caller
    can do other work (a read) meanwhile and the peers answer in parallel. Every answer is bounded
    by one deadline. Use from one thread (ZeroMQ sockets are not thread-safe).

    `secure` sets CURVE keys on each socket (CurveKeys.client); a server that does not admit them
    never answers, which ends as `NoAnswer`.
    """

    def __init__(self, targets: list[tuple[str, int]], message: Message, timeout_s: float, expected: type,
                 secure: Callable[[zmq.Socket], None] | None = None) -> None:
        self.sent_at = time.monotonic()
        self._timeout_s = timeout_s
        self._message = message
        self._expected = expected
        self._socks = []
        self._results: list[Message | ChannelError] | None = None
        frame = encode(message)
        try:
            for host, port in targets:
                sock = _client_socket(secure)
                self._socks.append((endpoint(host, port), sock))
                sock.connect(self._socks[-1][0])
                sock.send(frame, zmq.NOBLOCK)  # queued until connected; the deadline bounds the rest
        except zmq.ZMQError as exc:
            self.close()
            raise ChannelError(f"cannot send {type(message).__name__} to {self._socks[-1][0]}: {exc}") from exc

    def close(self) -> None:
        """Give up on the answers (idempotent)."""
        for _, sock in self._socks:
            sock.close()

    def results(self, until: float | None = None) -> list[Message | ChannelError]:
        """Per target, in order: its answer of the expected type, or the ChannelError why not; waits
        until the call's deadline, or `until` (time.monotonic) if that comes first. Collected once:
        later calls return the same list."""
        if self._results is None:
            self._results = self._collect(until)
        return self._results

    def _collect(self, until: float | None) -> list[Message | ChannelError]:
        out: dict[int, Message | ChannelError] = {}
        poller = zmq.Poller()
        index = {}
        for i, (_, sock) in enumerate(self._socks):
            poller.register(sock, zmq.POLLIN)
            index[id(sock)] = i
        deadline = self.sent_at + self._timeout_s
        if until is not None:
            deadline = min(deadline, until)
        try:
            while len(out) < len(self._socks):
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    break
                for sock, _ in poller.poll(left_ms):
                    i = index[id(sock)]
                    out[i] = self._check(self._socks[i][0], sock)
                    poller.unregister(sock)
        finally:
            self.close()
        waited = round(deadline - self.sent_at, 2)
        return [out[i] if i in out else NoAnswer(f"no answer from {where} within {waited}s")
                for i, (where, _) in enumerate(self._socks)]

    def _check(self, where: str, sock: zmq.Socket) -> Message | ChannelError:
        try:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
            if frame.more:  # the rest is dropped with the socket, never collected
                return ChannelError(f"{where}: a reply of several parts, not one message")
            reply = decode(frame.bytes, max_bytes=MAX_REPLY_BYTES)
        except (MessageError, zmq.ZMQError) as exc:  # an oversize reply drops the connection
            return ChannelError(f"{where}: {exc}")
        if isinstance(reply, Ack) and not reply.ok:
            return ChannelError(f"{where} refused {type(self._message).__name__}: {reply.error}")
        if not isinstance(reply, self._expected):
            return ChannelError(f"{where} answered {type(reply).__name__} to {type(self._message).__name__}")
        return reply


def call(host: str, port: int, message: Message, timeout_s: float, expected: type,
         secure: Callable[[zmq.Socket], None] | None = None) -> Message:
    """Send one request and wait at most `timeout_s` for its reply of type `expected`."""
    (reply,) = Calls([(host, port)], message, timeout_s, expected, secure).results()
    if isinstance(reply, ChannelError):
        raise reply
    return reply
