"""A real subscriber to an engine's KV cache events (`--kv-events-config`, ZMQ): what a router reading them sees.

The engine publishes every step's `KVEventBatch` on a PUB socket and keeps them for replay on a ROUTER socket
beside it (`replay_endpoint`). `EventRecorder` subscribes before the first request; `collect()` then asks the
replay socket for every batch since sequence 0, waits until the live stream has delivered each one, and
checks that the two agree (a subscriber that connected in time loses nothing). vLLM's block hashes are salted
per process (PYTHONHASHSEED unset), so `collect()` names each hash by the order it first appeared in: two
engines that cached the same blocks in the same order give equal event lists.
"""

from __future__ import annotations

import threading
import time

import msgspec
import zmq

END_SEQ = -1
"""The replay socket's end-of-replay marker (vLLM's ZmqEventPublisher.END_SEQ)."""


def replay_endpoint(endpoint: str) -> str:
    return f"{endpoint}-replay"


def events_config(endpoint: str) -> dict:
    """The engine's `kv_events_config`: publish on `endpoint`, replay beside it."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
            "replay_endpoint": replay_endpoint(endpoint)}


class EventRecorder:
    """Every (sequence, payload) the engine's PUB socket delivered, read on a thread of its own."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVTIMEO, 100)
        self._sub.connect(endpoint)
        self._live: dict[int, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True, name="kv-events-recorder")
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                _topic, seq, payload = self._sub.recv_multipart()
            except zmq.Again:
                continue
            self._live[int.from_bytes(seq, "big", signed=True)] = payload

    def _replay(self, timeout: float) -> dict[int, bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        sock.connect(replay_endpoint(self.endpoint))
        try:
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            batches = {}
            while True:
                _empty, _topic, seq, payload = sock.recv_multipart()
                number = int.from_bytes(seq, "big", signed=True)
                if number == END_SEQ:
                    return batches
                batches[number] = payload
        finally:
            sock.close(linger=0)

    def collect(self, timeout: float = 30.0) -> list[list[list]]:
        """Every batch published so far, each a list of events with hashes named by first appearance; raises if
        the live stream lost or changed one within `timeout`."""
        from vllm.distributed.kv_events import KVEventBatch

        replayed = self._replay(timeout)
        deadline = time.monotonic() + timeout
        while not replayed.keys() <= self._live.keys() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join()
        self._sub.close(linger=0)
        missing = sorted(replayed.keys() - self._live.keys())
        if missing or any(self._live[seq] != payload for seq, payload in replayed.items()):
            raise RuntimeError(f"the live event stream lost batches {missing[:10]} or differs from the replay")
        if sorted(replayed) != list(range(len(replayed))):
            raise RuntimeError(f"the replay is not every batch from 0: {sorted(replayed)[:10]}...")
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        names: dict[bytes | int, int] = {}
        return [[_named(event, names) for event in decoder.decode(replayed[seq]).events] for seq in sorted(replayed)]


def _named(event, names: dict) -> list:
    def name(block_hash):
        return None if block_hash is None else names.setdefault(block_hash, len(names))

    kind = type(event).__name__
    if kind == "BlockStored":
        return [kind, [name(h) for h in event.block_hashes], name(event.parent_block_hash), event.token_ids,
                event.block_size, event.medium, event.locality]
    if kind == "BlockRemoved":
        return [kind, [name(h) for h in event.block_hashes], event.medium, event.locality]
    return [kind]
