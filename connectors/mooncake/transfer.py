"""Thin wrapper over the Mooncake TransferEngine for pulling KV blocks.

Measured transport facts shape it (bench/pd_transfer.py measures them): every batch entry
costs ~75 us, so contiguous block runs are coalesced; one huge entry is moved by too few engine
threads (a 300 MB read took 0.26 s as one entry, 0.13 s as 256 entries of ~1.2 MB), so merged
runs are cut into pieces of at most `max_entry_bytes`; and a batch over ~1024 entries can fail
half-written on tcp, so batches are split. A hung peer is bounded by MC_TRANSFER_TIMEOUT.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from connectors.common.hosts import join_host_port, mooncake_family

from connectors.mooncake.affinity import run_unpinned

DEFAULT_MAX_BATCH_ENTRIES = 1024
DEFAULT_MAX_ENTRY_BYTES = 1 << 20
MIN_TRANSFER_TIMEOUT_S = 5  # Mooncake ignores smaller MC_TRANSFER_TIMEOUT values


class TransferError(RuntimeError):
    """A transfer-engine call failed; the caller turns it into a load failure, never a crash."""


class Desc(NamedTuple):
    """One contiguous copy: `length` bytes from the peer's `remote` address to local `local`."""

    local: int
    remote: int
    length: int


def coalesce(descs: Iterable[Desc]) -> list[Desc]:
    """Merge runs of copies adjacent on both sides into single copies, keeping order."""
    merged: list[Desc] = []
    for d in descs:
        if d.length <= 0:
            raise ValueError(f"transfer length must be positive, got {d.length}")
        if merged:
            last = merged[-1]
            if last.local + last.length == d.local and last.remote + last.length == d.remote:
                merged[-1] = Desc(last.local, last.remote, last.length + d.length)
                continue
        merged.append(d)
    return merged


def cut_entries(descs: Iterable[Desc], max_bytes: int) -> list[Desc]:
    """Cut copies longer than `max_bytes` into consecutive pieces (the engine parallelises over
    entries, not within one)."""
    if max_bytes < 1:
        raise ValueError(f"entry limit must be >= 1 byte, got {max_bytes}")
    out = []
    for d in descs:
        for offset in range(0, d.length, max_bytes):
            out.append(Desc(d.local + offset, d.remote + offset, min(max_bytes, d.length - offset)))
    return out


def split_batches(descs: Sequence[Desc], limit: int) -> list[Sequence[Desc]]:
    """Cut a copy list into batches of at most `limit` entries (the transport's queue bound)."""
    if limit < 1:
        raise ValueError(f"batch limit must be >= 1, got {limit}")
    return [descs[i : i + limit] for i in range(0, len(descs), limit)]


def _import_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ImportError(
            "MooncakeConnectorV2 needs the Mooncake transfer engine: pip install "
            "mooncake-transfer-engine-non-cuda (CPU/tcp hosts) or mooncake-transfer-engine (CUDA); "
            f"import failed: {exc}"
        ) from exc
    return TransferEngine


class MooncakeTransfer:
    """One TransferEngine in P2P-handshake mode, with registered regions and batched reads."""

    def __init__(
        self,
        host: str,
        protocol: str = "tcp",
        device_name: str = "",
        timeout_s: int | None = None,
        max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
    ) -> None:
        if timeout_s is not None:
            if timeout_s < MIN_TRANSFER_TIMEOUT_S:
                raise ValueError(
                    f"transfer timeout {timeout_s}s is below Mooncake's minimum of "
                    f"{MIN_TRANSFER_TIMEOUT_S}s; raise kv_connector_extra_config.transfer_timeout_s"
                )
            # Read by the engine at init; an explicit user setting wins.
            os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(int(timeout_s)))
        try:
            mooncake_family(host, os.environ)
        except ValueError as exc:
            raise TransferError(str(exc)) from None
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        self.host = host
        self.protocol = protocol
        self.max_batch_entries = max_batch_entries
        self.max_entry_bytes = max_entry_bytes
        self._engine = _import_engine()()
        # The engine starts its I/O threads here; they inherit this thread's CPU mask.
        rc = run_unpinned(lambda: self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name))
        if rc != 0:
            raise TransferError(
                f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}, "
                f"{device_name!r}) returned {rc}; check kv_connector_extra_config.protocol "
                "('tcp' works everywhere, 'rdma' needs an RDMA device) and VLLM_HOST_IP"
            )
        self._registered: list[tuple[int, int]] = []

    @property
    def rpc_port(self) -> int:
        return int(self._engine.get_rpc_port())

    @property
    def session(self) -> str:
        return join_host_port(self.host, self.rpc_port)

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """Register (address, length) regions so peers may read them."""
        if not regions:
            return
        addrs = [a for a, _ in regions]
        lens = [n for _, n in regions]
        rc = self._engine.batch_register_memory(addrs, lens)
        if rc != 0:
            raise TransferError(f"Mooncake batch_register_memory of {len(regions)} regions returned {rc}")
        self._registered.extend(regions)

    def read(self, peer_session: str, descs: Iterable[Desc]) -> tuple[int, int]:
        """Pull every copy from the peer; returns (bytes, batch entries). Raises TransferError."""
        merged = cut_entries(coalesce(descs), self.max_entry_bytes)
        total = 0
        for batch in split_batches(merged, self.max_batch_entries):
            rc = self._engine.batch_transfer_sync_read(
                peer_session,
                [d.local for d in batch],
                [d.remote for d in batch],
                [d.length for d in batch],
            )
            if rc != 0:
                raise TransferError(
                    f"batch_transfer_sync_read from {peer_session} of {len(batch)} entries "
                    f"returned {rc}"
                )
            total += sum(d.length for d in batch)
        return total, len(merged)

    def close(self) -> None:
        if self._registered:
            self._engine.batch_unregister_memory([a for a, _ in self._registered])
            self._registered = []
