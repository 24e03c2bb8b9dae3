"""A /dev/shm of a chosen size for one process and its children, as a container's `--shm-size` gives it: a private
mount namespace (util-linux unshare, as root) with a tmpfs of that size on /dev/shm."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def small_shm(mib: int) -> list[str]:
    """The command prefix (testbed.engine_run.run_engine's `wrap`): the rest runs with a `mib` MiB /dev/shm."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount -t tmpfs -o size={mib}m kvpp-test-shm /dev/shm && exec "$@"', "sh"]


def skip_without_mount_namespaces() -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux unshare (a mount namespace) to give a process a small /dev/shm")
    probe = subprocess.run([*small_shm(1), "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on /dev/shm in a mount namespace here (root needed): {probe.stderr.strip()}")
