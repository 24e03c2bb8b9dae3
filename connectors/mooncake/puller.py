"""Decode-side pull of one prefilled request, independent of vLLM's process state.

Fetches (and caches) the prefill workers' metadata over the side channel, proving with the
request's token that it may, checks compatibility, plans each layer's source, reads with the
transfer engine and sends done-notices. The first prefill worker's answer must advertise the
parallel sizes the handle claims before any other worker is contacted. The worker and
bench/pd_transfer.py drive the same object, so the benchmark measures the connector's real path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from connectors.mooncake.channel import ChannelError, NoAnswer, call
from connectors.mooncake.curve import CurveKeys, server_key
from connectors.mooncake.messages import (
    PROTOCOL_VERSION,
    DoneNotice,
    MessageError,
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


class Puller:
    def __init__(self, transfer: MooncakeTransfer, local: WorkerMeta, mla: bool, timeout_s: float,
                 consumer_id: str, num_consumers: int, curve: CurveKeys | None = None) -> None:
        self.transfer = transfer
        self.local = local
        self.local_layers = {layer.name: layer for layer in local.layers}
        self.mla = mla
        self.timeout_s = timeout_s
        self.consumer_id = consumer_id
        self.num_consumers = num_consumers
        self.curve = curve
        self._peers: dict[tuple[str, str, int], list[WorkerMeta]] = {}

    @staticmethod
    def _key(handle: PrefillHandle) -> tuple[str, str, int]:
        return handle.remote_engine_id, handle.remote_host, handle.remote_kv_port

    def peer_metas(self, handle: PrefillHandle) -> list[WorkerMeta]:
        cached = self._peers.get(self._key(handle))
        if cached is not None:
            return cached
        request = MetaRequest(version=PROTOCOL_VERSION, request_id=handle.remote_request_id, token=handle.remote_token)
        metas = []
        for pp_rank, tp_rank, port in prefill_ports(handle):
            meta = self._call(handle, port, request, WorkerMeta)
            if (meta.tp_size, meta.pp_size) != (handle.remote_tp_size, handle.remote_pp_size):
                raise ChannelError(
                    f"{handle.remote_host}:{port} runs tp_size {meta.tp_size} x pp_size {meta.pp_size}, but "
                    f"kv_transfer_params claim {handle.remote_tp_size} x {handle.remote_pp_size}"
                )
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

    def _call(self, handle: PrefillHandle, port: int, message, expected: type):
        key = server_key(self.curve, handle.remote_curve_key)
        secure = None if key is None else self.curve.client(key)
        return call(handle.remote_host, port, message, self.timeout_s, expected, secure=secure)

    def forget(self, handle: PrefillHandle) -> None:
        """Drop cached metadata after a failure, so a restarted prefill is asked afresh."""
        self._peers.pop(self._key(handle), None)

    def read(self, handle: PrefillHandle, local_blocks: Sequence[int], remote_blocks: Sequence[int]) -> tuple[int, int, float]:
        """Pull the blocks of every local layer; returns (bytes, batch entries, seconds in the TE)."""
        sources = choose_sources(self.local, self.peer_metas(handle), self.mla)
        per_peer = build_descs(self.local_layers, sources, local_blocks, remote_blocks)
        start = time.perf_counter()
        nbytes = entries = 0
        for session, descs in per_peer.items():
            b, e = self.transfer.read(session, descs)
            nbytes += b
            entries += e
        return nbytes, entries, time.perf_counter() - start

    def notify(self, handle: PrefillHandle, ok: bool) -> tuple[bool | None, list[str]]:
        """Tell every prefill worker to free the request's blocks.

        Returns (held, errors): held is False if any worker had already freed them (timeout), True
        if every worker confirmed it still held them, None if some did not answer; errors name the
        workers that did not answer (they free after their hold timeout). The first worker that does
        not answer ends the round: a handle naming many unreachable workers costs one timeout.
        """
        notice = DoneNotice(version=PROTOCOL_VERSION, request_id=handle.remote_request_id, token=handle.remote_token,
                            consumer=self.consumer_id, num_consumers=self.num_consumers, success=ok)
        answers, errors = [], []
        ports = [port for _, _, port in prefill_ports(handle)]
        for i, port in enumerate(ports):
            try:
                answers.append(self._call(handle, port, notice, Released).held)
            except NoAnswer as exc:
                errors.append(f"{handle.remote_host}:{port}: {exc}"
                              + (f"; {len(ports) - i - 1} more workers not notified" if i + 1 < len(ports) else ""))
                break
            except (ChannelError, MessageError) as exc:
                errors.append(f"{handle.remote_host}:{port}: {exc}")
        if not all(answers):
            return False, errors
        return (None if errors else True), errors
