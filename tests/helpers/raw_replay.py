"""A replay endpoint in vLLM's exact wire format (vLLM 0.32's `ZmqEventPublisher._service_replay`: each batch as
(identity, b"", topic, 8-byte big-endian seq, msgpack payload), then (identity, b"", topic, seq -1, b"")), answering
as vLLM's never does: only once released (a sync held in flight), or with batches that never end (a runaway or
hostile publisher)."""

from __future__ import annotations

import threading

import msgspec
import zmq

from deploy.services.ports import free_port

END = (-1).to_bytes(8, "big", signed=True)


class RawReplay:
    """A ROUTER on a free loopback port (`endpoint`) on a thread of its own. `held`: each request is answered with
    `batches` (from the asked sequence number on) and the end marker once `release()` was called. `endless`: each
    request, whatever it asks, is answered with all of `batches` over and over (the same sequence numbers, 100 messages
    a millisecond at most), never ending. `asked` counts the requests, `sent` the messages."""

    def __init__(self, batches, mode: str = "held"):
        encode = msgspec.msgpack.Encoder().encode
        self.payloads = [encode(b) for b in batches]
        self.mode = mode
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.asked = 0
        self.sent = 0
        self._released = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="raw-replay")

    def __enter__(self) -> RawReplay:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._released.set()
        self._thread.join(10)

    def release(self) -> None:
        self._released.set()

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                identity, _, start = sock.recv_multipart()
                self.asked += 1
                first = int.from_bytes(start, "big")
                frames = [[identity, b"", b"", seq.to_bytes(8, "big"), payload]
                          for seq, payload in enumerate(self.payloads) if seq >= first or self.mode == "endless"]
                if self.mode == "held":
                    self._released.wait()
                    self._send(sock, frames)
                    sock.send_multipart([identity, b"", b"", END, b""])
                else:  # until a new request comes (the proxy gave this one up and asks again)
                    while frames and not self._stop.is_set() and not sock.poll(0):
                        self._send(sock, (frames * (100 // len(frames) + 1))[:100])
                        self._stop.wait(0.001)
        finally:
            sock.close(linger=0)

    def _send(self, sock, frames) -> None:
        for message in frames:
            sock.send_multipart(message)
            self.sent += 1
