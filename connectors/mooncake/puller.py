"""Decode-side pull of one prefilled request, independent of vLLM's process state.

Fetches (and caches) the prefill workers' metadata over the side channel, checks compatibility,
plans each layer's source, reads with the transfer engine and sends done-notices. The worker and
bench/pd_transfer.py drive the same object, so the benchmark measures the connector's real path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

from connectors.mooncake.channel import Calls, ChannelError
from connectors.mooncake.messages import (
    PROTOCOL_VERSION,
    DoneNotice,
    LeaseClaim,
    LeaseGrant,
    LeaseRenewal,
    MetaRequest,
    PrefillHandle,
    Released,
    WorkerMeta,
)
from connectors.mooncake.plan import build_descs, check_compatible, choose_sources
from connectors.mooncake.transfer import MooncakeTransfer
from kvpp_core.ports import PortLayout


def prefill_ports(handle: PrefillHandle) -> list[tuple[int, int, int]]:
    """(pp_rank, tp_rank, handshake port) of every worker of the prefill's DP rank."""
    if handle.remote_pcp_size != 1:
        raise ValueError(
            f"prefill {handle.remote_engine_id} runs PCP {handle.remote_pcp_size}; MooncakeConnectorV2 "
            "pulls only from prefills with --prefill-context-parallel-size 1"
        )
    layout = PortLayout(handle.remote_kv_port, tp=handle.remote_tp_size, pp=handle.remote_pp_size,
                        pcp=handle.remote_pcp_size, dp=handle.remote_dp_size)
    return [
        (pp, tp, layout.handshake_port(dp_rank=handle.remote_dp_rank, pp_rank=pp, tp_rank=tp))
        for pp in range(handle.remote_pp_size)
        for tp in range(handle.remote_tp_size)
    ]


class ReadResult(NamedTuple):
    nbytes: int
    entries: int
    """Batch entries issued after coalescing."""
    seconds: float
    """In the transfer engine."""
    handshake_s: float
    """Fetching the prefill workers' metadata (0 when cached)."""


class Puller:
    def __init__(self, transfer: MooncakeTransfer, local: WorkerMeta, mla: bool, timeout_s: float,
                 consumer_id: str, num_consumers: int) -> None:
        self.transfer = transfer
        self.local = local
        self.local_layers = {layer.name: layer for layer in local.layers}
        self.mla = mla
        self.timeout_s = timeout_s
        self.consumer_id = consumer_id
        self.num_consumers = num_consumers
        self._peers: dict[tuple[str, str, int], list[WorkerMeta]] = {}

    @staticmethod
    def _key(handle: PrefillHandle) -> tuple[str, str, int]:
        return handle.remote_engine_id, handle.remote_host, handle.remote_kv_port

    def peer_metas(self, handle: PrefillHandle) -> list[WorkerMeta]:
        cached = self._peers.get(self._key(handle))
        if cached is not None:
            return cached
        ports = prefill_ports(handle)
        answers = Calls([(handle.remote_host, port) for _, _, port in ports], MetaRequest(version=PROTOCOL_VERSION),
                        self.timeout_s, WorkerMeta).results()
        metas = []
        for (pp_rank, tp_rank, port), meta in zip(ports, answers):
            if isinstance(meta, ChannelError):
                raise meta
            if meta.engine_id != handle.remote_engine_id or (meta.pp_rank, meta.tp_rank) != (pp_rank, tp_rank):
                raise ChannelError(
                    f"{handle.remote_host}:{port} is engine {meta.engine_id} pp{meta.pp_rank}/tp{meta.tp_rank}, "
                    f"expected {handle.remote_engine_id} pp{pp_rank}/tp{tp_rank} (prefill restarted, or "
                    "another instance's kv_port range overlaps)"
                )
            metas.append(meta)
        check_compatible(self.local, metas, self.mla)
        self._peers[self._key(handle)] = metas
        return metas

    def forget(self, handle: PrefillHandle) -> None:
        """Drop cached metadata after a failure, so a restarted prefill is asked afresh."""
        self._peers.pop(self._key(handle), None)

    def read(self, handle: PrefillHandle, local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> ReadResult:
        """Pull the blocks of every local layer."""
        start = time.perf_counter()
        metas = self.peer_metas(handle)
        handshake_s = time.perf_counter() - start
        sources = choose_sources(self.local, metas, self.mla)
        per_peer = build_descs(self.local_layers, sources, local_blocks, remote_blocks)
        start = time.perf_counter()
        nbytes = entries = 0
        for session, descs in per_peer.items():
            b, e = self.transfer.read(session, descs)
            nbytes += b
            entries += e
        return ReadResult(nbytes, entries, time.perf_counter() - start, handshake_s)

    def claim(self, handle: PrefillHandle) -> Calls:
        """Renew the request's lease on every prefill worker; collect the grants with `lease_end`
        after the read (the renewals travel while it runs)."""
        renewal = LeaseRenewal(version=PROTOCOL_VERSION, claims=[LeaseClaim(request_id=handle.remote_request_id)])
        return Calls(_targets(handle), renewal, self.timeout_s, LeaseGrant)

    @staticmethod
    def lease_end(claim: Calls) -> float | None:
        """Monotonic time until which every prefill worker keeps the blocks, or None if one did
        not answer or had freed them already. A worker that granted the lease held the blocks when
        it read the renewal (after `claim.sent_at`), and a hold never restarts once ended, so the
        blocks stayed the request's from before the read until at least this time."""
        grants = claim.results()
        if any(isinstance(grant, ChannelError) or grant.seconds[0] <= 0 for grant in grants):
            return None
        return claim.sent_at + min(grant.seconds[0] for grant in grants)

    def notify(self, handle: PrefillHandle, ok: bool) -> tuple[bool | None, list[str]]:
        """Tell every prefill worker (in parallel) to free the request's blocks.

        Returns (held, errors): held is False if any worker had already freed them (lease lapsed),
        True if every worker confirmed it still held them, None if some did not answer; errors name
        the workers that did not answer (they free when the lease lapses).
        """
        notice = DoneNotice(version=PROTOCOL_VERSION, request_id=handle.remote_request_id,
                            consumer=self.consumer_id, num_consumers=self.num_consumers, success=ok)
        answers = Calls(_targets(handle), notice, self.timeout_s, Released).results()
        errors = [str(a) for a in answers if isinstance(a, ChannelError)]
        if not all(a.held for a in answers if not isinstance(a, ChannelError)):
            return False, errors
        return (None if errors else True), errors


def _targets(handle: PrefillHandle) -> list[tuple[str, int]]:
    return [(handle.remote_host, port) for _, _, port in prefill_ports(handle)]
