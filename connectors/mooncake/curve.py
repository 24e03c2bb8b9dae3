"""Optional ZeroMQ CURVE on MooncakeConnectorV2's side channel: encryption plus mutual keys.

Every node (prefill or decode instance) has one key pair, a ZeroMQ certificate
(`curve_secret_key_file`), and a directory of the public certificates it trusts
(`curve_public_keys_dir`). A side-channel server admits only clients whose key is in that directory
(checked by a ZAP handler: no handshake, no reply otherwise); a decode connects only to a prefill
whose key, sent in kv_transfer_params, is in it too. Keys are made with

    python -m connectors.mooncake.curve DIR NAME

which writes DIR/NAME.key (public: copy it to every peer's keys directory) and DIR/NAME.key_secret
(mode 0600: stays on this node).
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from connectors.mooncake.messages import MessageError

SECRET_KEY = "curve_secret_key_file"
KEYS_DIR = "curve_public_keys_dir"


class CurveConfigError(ValueError):
    """A CURVE setting that cannot be used; the message names the key and the fix."""


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    """This node's public key (Z85), sent to decodes in kv_transfer_params."""
    secret: bytes
    trusted: frozenset[bytes]
    """Public keys (Z85) of the peers this node talks to."""

    def client(self, server_key: bytes) -> Callable[[zmq.Socket], None]:
        """Sets a client socket up to reach the server with `server_key` (before connect)."""

        def setup(sock: zmq.Socket) -> None:
            sock.curve_secretkey = self.secret
            sock.curve_publickey = self.public
            sock.curve_serverkey = server_key

        return setup

    def serve(self, ctx: zmq.Context, sock: zmq.Socket, on_denied: Callable[[], None]) -> ThreadAuthenticator:
        """Make `sock` a CURVE server that admits only trusted client keys (call before bind)."""
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback("*", _Trusted(self.trusted, on_denied))
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        return auth


class _Trusted:
    """ZAP credentials provider: a client key is admitted iff it is in the trusted set."""

    def __init__(self, trusted: frozenset[bytes], on_denied: Callable[[], None]) -> None:
        self.trusted = trusted
        self.on_denied = on_denied

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.trusted:
            return True
        self.on_denied()
        return False


def load_curve(secret_key_file: str, public_keys_dir: str) -> CurveKeys | None:
    """The node's CURVE keys from kv_connector_extra_config, or None when CURVE is off."""
    if not secret_key_file and not public_keys_dir:
        return None
    problems = []
    if not (secret_key_file and public_keys_dir):
        missing = KEYS_DIR if secret_key_file else SECRET_KEY
        problems.append(f"{missing} is missing: CURVE needs both {SECRET_KEY} and {KEYS_DIR}")
    if not zmq.has("curve"):
        problems.append(f"this pyzmq's libzmq {zmq.zmq_version()} has no CURVE (built without libsodium)")
    public = secret = None
    if secret_key_file:
        public, secret = _read_secret(Path(secret_key_file), problems)
    trusted = _read_trusted(Path(public_keys_dir), problems) if public_keys_dir else frozenset()
    if problems:
        raise CurveConfigError(
            "MooncakeConnectorV2 kv_connector_extra_config: " + "; ".join(problems)
            + ". Make keys with `python -m connectors.mooncake.curve DIR NAME`."
        )
    return CurveKeys(public=public, secret=secret, trusted=trusted)


def _read_secret(path: Path, problems: list[str]) -> tuple[bytes | None, bytes | None]:
    try:
        mode = path.stat().st_mode
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        problems.append(f"{SECRET_KEY} {str(path)!r} cannot be read as a ZeroMQ certificate ({exc})")
        return None, None
    if secret is None:
        problems.append(f"{SECRET_KEY} {str(path)!r} holds no secret key (the .key_secret file, not .key)")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        problems.append(f"{SECRET_KEY} {str(path)!r} is readable by others (mode {stat.S_IMODE(mode):o}); "
                        f"run chmod 600 {path}")
    return public, secret


def _read_trusted(path: Path, problems: list[str]) -> frozenset[bytes]:
    if not path.is_dir():
        problems.append(f"{KEYS_DIR} {str(path)!r} is not a directory")
        return frozenset()
    try:
        keys = frozenset(zmq.auth.load_certificates(path))
    except (OSError, ValueError) as exc:
        problems.append(f"{KEYS_DIR} {str(path)!r} holds an unreadable certificate ({exc})")
        return frozenset()
    if not keys:
        problems.append(f"{KEYS_DIR} {str(path)!r} holds no public certificates (*.key)")
    return keys


def server_key(keys: CurveKeys | None, advertised: str | None) -> bytes | None:
    """The key to expect from a prefill that advertised `advertised` in kv_transfer_params; both
    sides must agree on CURVE, and the prefill's key must be trusted here."""
    if keys is None:
        if advertised is not None:
            raise MessageError(f"the prefill's side channel requires CURVE; set {SECRET_KEY} and {KEYS_DIR} "
                               "on this decode too")
        return None
    if advertised is None:
        raise MessageError(f"this decode requires CURVE ({SECRET_KEY} is set) but the prefill's side channel "
                           "is unencrypted; configure CURVE on the prefill too")
    key = advertised.encode()
    if key not in keys.trusted:
        raise MessageError(f"the prefill's CURVE key {advertised} is not among the trusted keys in {KEYS_DIR}")
    return key


def client_setup(keys: CurveKeys | None, advertised: str | None) -> Callable[[zmq.Socket], None] | None:
    """Socket setup to reach a prefill that advertised `advertised` (None: plain ZeroMQ)."""
    key = server_key(keys, advertised)
    return None if key is None else keys.client(key)


def create_keys(directory: str, name: str) -> tuple[Path, Path]:
    """Write NAME.key (public) and NAME.key_secret (owner-only) into `directory`."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if (out / f"{name}{suffix}").exists():
            raise FileExistsError(f"{out / (name + suffix)} exists; pick another NAME or directory")
    old = os.umask(0o077)
    try:
        public, secret = zmq.auth.create_certificates(out, name)
    finally:
        os.umask(old)
    os.chmod(public, 0o644)
    return Path(public), Path(secret)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m connectors.mooncake.curve DIR NAME", file=sys.stderr)
        return 2
    try:
        public, secret = create_keys(*argv)
    except OSError as exc:
        print(f"curve: error: {exc}", file=sys.stderr)
        return 1
    print(f"public key {public} (copy into every peer's {KEYS_DIR}); secret key {secret} ({SECRET_KEY})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
