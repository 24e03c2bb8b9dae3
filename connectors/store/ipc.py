"""Where the pool's local IPC sockets live, and who may own one.

Sockets go in a directory only this user can enter (mode 0700, owned by the user, never a symlink),
so no other user can connect to, replace or pre-create them. Within the user, one socket path belongs
to one engine: its owner holds an exclusive lock next to it for as long as it serves, so a second
engine asking for the same name fails at startup instead of silently taking the socket over, and
only the owner ever removes the socket. A killed owner releases the lock with its process, so its
stale socket is reclaimed by the next engine.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile

MAX_PATH = 100
"""sun_path holds 108 bytes on Linux; stay below with room for the terminator."""


class IpcPathError(RuntimeError):
    """The socket directory or name cannot be used safely; the message says why and what to change."""


class SocketInUse(IpcPathError):
    """Another live process owns the socket name."""


def private_dir() -> str:
    """This user's private socket directory: $XDG_RUNTIME_DIR/kvpp, else <tmp>/kvpp-<uid>; created if
    missing and refused unless it is a real directory owned by this user with mode 0700."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(runtime, "kvpp") if runtime else os.path.join(tempfile.gettempdir(), f"kvpp-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise IpcPathError(f"cannot create the private socket directory {path}: {exc}; set XDG_RUNTIME_DIR to a "
                           "writable directory of this user") from exc
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "a file"
        raise IpcPathError(
            f"{path} must be a directory owned by uid {os.getuid()} with mode 0700 so that no other user can reach "
            f"its sockets, but it is {kind} owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}; "
            "remove it (it is recreated safely) or set XDG_RUNTIME_DIR to a private directory")
    return path


def socket_path(name: str) -> str:
    path = os.path.join(private_dir(), name)
    if len(path) > MAX_PATH:
        raise IpcPathError(f"socket path {path} is longer than {MAX_PATH} characters (the limit of a Unix socket "
                           "address); set XDG_RUNTIME_DIR to a shorter directory")
    return path


class SocketOwnership:
    """Exclusive ownership of one socket name, held until `release`; `option` and `value` name the
    setting the name comes from, for the error a clash gives."""

    def __init__(self, path: str, option: str, value: object) -> None:
        self.path = path
        self._lock_path = f"{path}.lock"
        self._fd = self._acquire(option, value)

    def _acquire(self, option: str, value: object) -> int:
        while True:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise SocketInUse(
                    f"{option} {value} is already in use on this host: its socket {self.path} belongs to another "
                    f"live engine (pid {holder}); give each engine on a host its own {option}") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self._lock_path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:  # not a lock file its previous owner unlinked while we waited to open it
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
            os.close(fd)

    def release(self, remove_socket: bool = True) -> None:
        """Remove our socket (never another's: we still hold the name) and our lock file, then unlock."""
        if self._fd < 0:
            return
        for path in ((self.path,) if remove_socket else ()) + (self._lock_path,):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        os.close(self._fd)
        self._fd = -1
