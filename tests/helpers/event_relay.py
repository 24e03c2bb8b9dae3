"""A ZMQ relay between a prefill's KV event publisher and a front, which drops the messages it is told to: an event
gap, as a subscriber sees one when its queue overflowed or the network lost a stretch of the stream."""

from __future__ import annotations

import threading

import zmq

from deploy.services.ports import free_port


class EventRelay:
    """SUB to `source`, PUB on a free loopback port (`endpoint`); between `pause()` and `resume()` every message is
    lost (counted in `dropped`)."""

    def __init__(self, source: str):
        self.source = source
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.relayed = self.dropped = 0
        self._paused = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="event-relay")

    def __enter__(self) -> EventRelay:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def pause(self) -> None:
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()

    def _run(self) -> None:
        context = zmq.Context.instance()
        sub, pub = context.socket(zmq.SUB), context.socket(zmq.PUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.source)
        pub.bind(self.endpoint)
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if self._paused.is_set():
                    self.dropped += 1
                else:
                    pub.send_multipart(frames)
                    self.relayed += 1
        finally:
            sub.close(linger=0)
            pub.close(linger=0)
