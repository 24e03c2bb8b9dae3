"""Keep the connector's service threads off the rank's pinned cores.

vLLM's CPU workers pin their threads to the rank's cores (VLLM_CPU_OMP_THREADS_BIND), and threads
started later inherit that mask. The side channel and the transfer engine's I/O threads then queue
behind the rank's compute threads on one core and answer peers late; letting them run on every
core keeps handshakes and reads prompt while the rank computes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def unpin_current_thread() -> None:
    """Allow the calling thread (Linux: sched_setaffinity(0) is per thread) on every CPU."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


def run_unpinned(fn: Callable[[], T]) -> T:
    """Run `fn` in a thread allowed on every CPU, so threads it starts inherit that mask."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            unpin_current_thread()
            result.append(fn())
        except BaseException as exc:  # re-raised in the caller
            error.append(exc)

    thread = threading.Thread(target=target, name="kvpp-unpinned-init")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
