"""Reading files a user names (specs, model configs, state files) without trusting what they are.

A FIFO or a character device would block or stream forever, and a multi-gigabyte file would be read
whole before its first syntax error; these are refused with the reason instead.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DEFAULT_LIMIT = 16 << 20


def read_small_file(path: str | os.PathLike, limit: int = DEFAULT_LIMIT) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; OSError (with the path) otherwise."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path}: not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path}: larger than {limit >> 20} MiB; not a file this command reads")
    return data
