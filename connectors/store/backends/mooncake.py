"""Mooncake store backend: zero-copy batch put/get of multi-piece objects into registered buffers.

Engines contribute no memory by default (`global_segment_size` 0): the pool's memory belongs to the
pool's own holder process (`kvpp pool up`), so pooled prefixes outlive any engine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Iterator, Sequence

import msgspec

from kvpp_core.config import parse_struct

from connectors.common.hosts import local_host, mooncake_family
from connectors.common.mooncake_env import PROGRESS_TIMEOUT_ENV, bound_progress
from connectors.store.backends.base import BackendError, BoundedClient, Status
from connectors.store.backends.bounds import CallPolicy
from connectors.store.backends.settings import MooncakeSettings

logger = logging.getLogger(f"vllm.{__name__}")  # plain logging under "vllm.": see backends.backoff

# Mooncake store error codes (mooncake-store/include/types.h) the pool reacts to.
_OBJECT_NOT_FOUND = -704
_BUFFER_OVERFLOW = -600

CONFIG_ENV = "MOONCAKE_CONFIG_PATH"
DEFAULTS = MooncakeSettings(metadata_server="P2PHANDSHAKE", protocol="tcp", rdma_devices="", global_segment_size=0,
                            local_buffer_size=16 << 20)


def resolve_settings(settings: MooncakeSettings) -> MooncakeSettings:
    """Every field set: explicit settings win over the JSON file named by `config_path` or
    $MOONCAKE_CONFIG_PATH (read as the same struct), which wins over the defaults."""
    # Peers reach this client's buffers at local_hostname: on a multi-host deployment that is the
    # node's address (VLLM_HOST_IP, as the P/D connector publishes), never loopback.
    merged = msgspec.structs.replace(DEFAULTS, local_hostname=local_host())
    path = settings.config_path or os.environ.get(CONFIG_ENV)
    if path:
        merged = msgspec.structs.replace(merged, **_read_file(path).explicit())
    merged = msgspec.structs.replace(merged, **{**settings.explicit(), "config_path": None})
    if merged.master_server_address is None:
        raise BackendError(
            "the mooncake backend needs kv_connector_extra_config.mooncake.master_server_address "
            '(e.g. "127.0.0.1:50051"; `kvpp pool up --backend mooncake --json` prints a ready config)'
        )
    return merged


def _read_file(path: str) -> MooncakeSettings:
    where = f"{CONFIG_ENV} or kv_connector_extra_config.mooncake.config_path"
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise BackendError(f"cannot read the Mooncake store config {path!r} ({where}): {exc}") from exc
    if not isinstance(data, dict):
        raise BackendError(f"the Mooncake store config {path!r} ({where}) must hold a JSON object")
    parsed = parse_struct(data, MooncakeSettings, "kv_connector_extra_config.mooncake")  # the same settings
    if parsed.value is None:
        raise BackendError("\n".join(f"{path} ({where}): {option}: {message}" for option, message in parsed.problems))
    return parsed.value


RPC_TIMEOUT_ENV = "MC_RPC_TIMEOUT_MS"
"""Mooncake's bound on one master RPC (default 30 s), read when a client is set up."""


@contextlib.contextmanager
def native_bounds(ceiling_s: float) -> Iterator[dict[str, str]]:
    """Mooncake's own bounds, within which the client setup runs: a native call outlived by the connector keeps
    its staging slot until it returns (connectors.store.staging), so it should end near the connector's ceiling
    rather than Mooncake's 30 s (a call in flight when the pool stops can still outlive both). Values set in the
    environment win. The RPC bound is read at setup and put back after it; the progress bound is read at every
    transfer connection, so it stays set for the process, the shortest any connector of it asks for
    (connectors.common.mooncake_env). Yields the values in force."""
    given = os.environ.get(RPC_TIMEOUT_ENV)
    os.environ.setdefault(RPC_TIMEOUT_ENV, str(math.ceil(ceiling_s * 1000)))
    try:
        yield {RPC_TIMEOUT_ENV: os.environ[RPC_TIMEOUT_ENV], PROGRESS_TIMEOUT_ENV: bound_progress(ceiling_s)}
    finally:
        if given is None:
            os.environ.pop(RPC_TIMEOUT_ENV, None)


def _get_status(code: int, expected: int) -> Status:
    if code == expected:
        return Status.OK
    if code == _OBJECT_NOT_FOUND:
        return Status.MISSING
    if code > 0 or code == _BUFFER_OVERFLOW:
        return Status.WRONG_SIZE
    return Status.FAILED


class MooncakeBackend(BoundedClient):
    name = "mooncake"

    def __init__(self, settings: MooncakeSettings, *, policy: CallPolicy) -> None:
        cfg = resolve_settings(settings)
        try:  # before the client library loads: it reads the family once
            mooncake_family(cfg.local_hostname, os.environ)
        except ValueError as exc:
            raise BackendError(f"{exc} (kv_connector_extra_config.mooncake.local_hostname)") from None
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise BackendError(
                "backend 'mooncake' needs the Mooncake store client: pip install "
                "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine"
            ) from exc
        self._store = MooncakeDistributedStore()
        with native_bounds(policy.ceiling_s) as native:
            rc = self._store.setup(cfg.local_hostname, cfg.metadata_server, cfg.global_segment_size,
                                   cfg.local_buffer_size, cfg.protocol, cfg.rdma_devices, cfg.master_server_address)
        if rc != 0:
            raise BackendError(
                f"cannot connect to mooncake_master at {cfg.master_server_address} (setup returned "
                f"{rc}); start the pool (`kvpp pool up --backend mooncake`) or fix "
                "kv_connector_extra_config.mooncake.master_server_address"
            )
        self._guard(policy)
        logger.info("Mooncake store client: calls bounded at %.1f-%.1f s; native bounds %s",
                    policy.floor_s, policy.ceiling_s, ", ".join(f"{k}={v}" for k, v in native.items()))

    def register(self, ptr: int, size: int) -> None:
        rc = self._store.register_buffer(ptr, size)
        if rc != 0:
            raise BackendError(f"Mooncake register_buffer({size} bytes) failed with {rc}")

    def put(self, keys, ptrs, sizes, settled=None) -> list[Status]:
        def call() -> list[Status]:
            codes = self._store.batch_put_from_multi_buffers(list(keys), [list(p) for p in ptrs],
                                                             [list(s) for s in sizes])
            return [Status.OK if c == 0 else Status.FAILED for c in codes]

        return self._bounded(call, keys, sum(map(sum, sizes)), settled)

    def get(self, keys, ptrs, sizes, settled=None) -> list[Status]:
        def call() -> list[Status]:
            codes = self._store.batch_get_into_multi_buffers(list(keys), [list(p) for p in ptrs],
                                                             [list(s) for s in sizes])
            status = [_get_status(c, sum(s)) for c, s in zip(codes, sizes)]
            # A too-small object fails the transfer with a generic code; name it by its size.
            for i, st in enumerate(status):
                if st is Status.FAILED and 0 < self._store.get_size(keys[i]) != sum(sizes[i]):
                    status[i] = Status.WRONG_SIZE
            return status

        return self._bounded(call, keys, sum(map(sum, sizes)), settled)

    def remove(self, keys: Sequence[str]) -> list[Status]:
        def call() -> list[Status]:
            codes = self._store.batch_remove(list(keys), True)
            return [Status.OK if c == 0 else Status.MISSING if c == _OBJECT_NOT_FOUND else Status.FAILED
                    for c in codes]

        return self._bounded(call, keys)

    def raw(self):
        """The underlying client, for benchmarks comparing the connector with raw batch calls."""
        return self._store
