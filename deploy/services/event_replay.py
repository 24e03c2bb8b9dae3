"""One round of asking a prefill's replay endpoint for its buffered KV event batches, within limits.

vLLM's replay endpoint (a ROUTER beside its PUB, `ZmqEventPublisher`) answers a request (an 8-byte start sequence
number) with every batch it still holds from there on, each as (seq, payload) after the ROUTER's delimiter, then an
end marker. Nothing in that protocol bounds an answer, so the proxy bounds a round: what it queues (RCVHWM
messages of at most MAX_MESSAGE_BYTES), and how many messages, bytes and seconds it reads (`ReplayLimits`) before it
abandons the round. A replay larger than the high-water marks arrives with holes (the publisher's ROUTER drops
past them), which the caller fills by asking again from the last batch it applied.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from deploy.services.kv_events import END_OF_REPLAY, MAX_MESSAGE_BYTES

REPLAY_HWM = 1000
"""Messages queued on the proxy's side of a replay (ZMQ's RCVHWM, as vLLM's ROUTER's SNDHWM); 0 would queue
without bound whatever a publisher sends faster than the proxy applies it."""
DRAIN = 256
"""Messages read in a row once the socket has some, before the event loop runs its other tasks (the live socket)."""
REPLAY_SILENCE_S = 1.0
"""A replay that sent batches and then nothing for this long has ended (ZMQ dropped its end marker with
batches past the high-water mark)."""


@dataclass(frozen=True)
class ReplayLimits:
    """What one replay round may read before it is abandoned."""

    batches: int = 100_000
    """Messages: ten times vLLM's default buffer (`buffer_steps` 10,000)."""
    bytes: int = 1 << 30
    seconds: float = 60.0
    """From the request on: the live batches that arrive meanwhile wait this long at most."""


class ReplayAbandoned(Exception):
    """A round went past one of its limits; `limit` names which (batches, bytes, seconds)."""

    def __init__(self, limit: str, detail: str):
        super().__init__(detail)
        self.limit = limit


LIMITS = ("batches", "bytes", "seconds")


async def replay(context: zmq.asyncio.Context, endpoint: str, start: int, timeout: float,
                 limits: ReplayLimits) -> AsyncIterator[list[bytes] | None]:
    """The messages (topic, seq, payload) a publisher's replay endpoint sends for the batches from `start` on,
    until its end marker, or None once some came and then nothing for REPLAY_SILENCE_S (ZMQ dropped the rest).
    Raises TimeoutError when nothing comes within `timeout`, ReplayAbandoned past `limits`."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, REPLAY_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.connect(endpoint)
    end = END_OF_REPLAY.to_bytes(8, "big", signed=True)
    deadline = time.monotonic() + limits.seconds
    wait, batches, size = timeout, 0, 0
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReplayAbandoned("seconds", f"still replaying after {limits.seconds:g} s")
            if not await sock.poll(max(1, int(min(wait, left) * 1000))):
                if wait > left:
                    continue  # the deadline came first
                if wait == timeout:
                    raise TimeoutError(f"no answer within {timeout:g} s")
                yield None
                return
            wait = min(timeout, REPLAY_SILENCE_S)
            for _ in range(DRAIN):
                try:
                    frames = await sock.recv_multipart(zmq.NOBLOCK)  # ready: no wait on the event loop
                except zmq.Again:
                    break
                frames = frames[1:] if frames[:1] == [b""] else frames  # a wrong shape is refused by the caller
                if len(frames) == 3 and frames[1] == end:
                    return
                batches += 1
                size += sum(map(len, frames))
                if batches > limits.batches:
                    raise ReplayAbandoned("batches", f"more than {limits.batches} batches")
                if size > limits.bytes:
                    raise ReplayAbandoned("bytes", f"more than {limits.bytes} bytes")
                yield frames
    finally:
        sock.close(linger=0)
