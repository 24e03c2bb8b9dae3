"""Side-channel tokens a prefill worker can check before it has heard of the hold.

The scheduler gives each held request a token: its issue time, a random nonce and an HMAC of both
with the request id, under a key that only this engine's scheduler and workers know (the key
reaches the workers in every step's metadata, so before any token is issued). A notice, renewal or
metadata request can arrive before the worker's hold announcement; with such a token the worker
tells a genuine early message from a stranger's at once, so a peer that holds no recent token
cannot fill the tables that keep early messages waiting (the deferred queue, the early notices).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import struct
import time

KEY_BYTES = 32
_HEAD = struct.Struct(">Q8s")  # issue time (ms since the epoch), nonce
_MAC_BYTES = 24
_HEAD_CHARS = 22  # base64url of 16 bytes, unpadded


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _mac(key: bytes, request_id: str, head: bytes) -> bytes:
    return hmac.new(key, head + request_id.encode(), hashlib.sha256).digest()[:_MAC_BYTES]


def issue(key: bytes, request_id: str, now: float | None = None) -> str:
    """A fresh token for `request_id` (54 characters of base64url: what messages.Token accepts)."""
    issued_ms = int((time.time() if now is None else now) * 1000)
    head = _HEAD.pack(issued_ms, secrets.token_bytes(8))
    return _b64(head) + _b64(_mac(key, request_id, head))


def issued_age(key: bytes, request_id: str, token: str, now: float | None = None) -> float | None:
    """Seconds since `key` issued `token` for `request_id` (MAC compared in constant time), or None for
    anything this engine did not issue, malformed or from the future included."""
    try:
        head = base64.urlsafe_b64decode(token[:_HEAD_CHARS] + "==")
        mac = base64.urlsafe_b64decode(token[_HEAD_CHARS:] + "==")
        issued_ms, _ = _HEAD.unpack(head)
    except (ValueError, struct.error):  # binascii.Error is a ValueError
        return None
    if not hmac.compare_digest(mac, _mac(key, request_id, head)):
        return None
    age = (time.time() if now is None else now) - issued_ms / 1000
    return max(age, 0.0) if age >= -1.0 else None  # a second of slack: the scheduler's clock is this host's
