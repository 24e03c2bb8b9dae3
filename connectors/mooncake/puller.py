"""Decode-side pull of one prefilled request, independent of vLLM's process state.

Fetches (and caches) the prefill workers' metadata over the side channel, proving with the
request's token that it may, checks compatibility, plans each layer's source, reads with the
transfer engine and sends done-notices. The first prefill worker's answer must advertise the
parallel sizes the handle claims before any other worker is contacted. The worker and
bench/pd_transfer.py drive the same object, so the benchmark measures the connector's real path.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from connectors.mooncake.channel import Calls, ChannelError
from connectors.mooncake.curve import CurveKeys, client_setup
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
from connectors.mooncake.stall import PrefillProgress, StallWatch
from connectors.mooncake.transfer import MooncakeTransfer, Stalled
from connectors.common.hosts import join_host_port


MAX_PEERS = 64
"""Prefill engines whose metadata and progress a puller keeps (least recently used dropped first):
engine ids change with every restart, so an unbounded cache would grow for the decode's whole life."""


def prefill_ports(handle: PrefillHandle) -> list[tuple[int, int, int]]:
    """(pp_rank, tp_rank, handshake port) of every worker of the prefill's DP rank."""
    if handle.remote_pcp_size != 1:
        raise ValueError(
            f"prefill {handle.remote_engine_id} runs PCP {handle.remote_pcp_size}; MooncakeConnectorV2 "
            "pulls only from prefills with --prefill-context-parallel-size 1"
        )
    return [
        (pp, tp, handle.port_layout.handshake_port(dp_rank=handle.remote_dp_rank, pp_rank=pp, tp_rank=tp))
        for pp in range(handle.remote_pp_size)
        for tp in range(handle.remote_tp_size)
    ]


class ReadResult(NamedTuple):
    nbytes: int
    entries: int
    """Reads issued after coalescing and cutting."""
    seconds: float
    """In the transfer engine."""
    handshake_s: float
    """Fetching the prefill workers' metadata (0 when cached)."""
    retried: int
    """Reads that failed at once and were issued again."""


class Puller:
    def __init__(self, transfer: MooncakeTransfer, local: WorkerMeta, timeout_s: float,
                 consumer_id: str, num_consumers: int, curve: CurveKeys | None = None) -> None:
        self.transfer = transfer
        self.local = local
        self.local_layers = {layer.name: layer for layer in local.layers}
        self.timeout_s = timeout_s
        self.consumer_id = consumer_id
        self.num_consumers = num_consumers
        self.curve = curve
        self._peers: OrderedDict[tuple[str, str, int], list[WorkerMeta]] = OrderedDict()
        self._progress: OrderedDict[tuple[str, str, int], PrefillProgress] = OrderedDict()

    @staticmethod
    def _key(handle: PrefillHandle) -> tuple[str, str, int]:
        return handle.remote_engine_id, handle.remote_host, handle.remote_kv_port

    def peer_metas(self, handle: PrefillHandle, watch: StallWatch | None = None) -> list[WorkerMeta]:
        """The prefill workers' metadata, cached per prefill. Fetching it is bounded by the handshake timeout
        and, with `watch`, by the pull's stall deadline: a pull queued behind a failed one from a prefill
        that stopped answering must not wait the handshake timeout on top of the stall bound. An answer
        counts as the prefill's progress."""
        cached = self._peers.get(self._key(handle))
        if cached is not None:
            self._peers.move_to_end(self._key(handle))
            return cached
        timeout_s = self.timeout_s
        if watch is not None:
            timeout_s = min(timeout_s, watch.deadline() - time.monotonic())
            if timeout_s <= 0:
                raise Stalled(f"prefill {handle.remote_engine_id} made no progress for {watch.bound_s:g} s before "
                              "this pull asked its metadata")
        request = MetaRequest(version=PROTOCOL_VERSION, request_id=handle.remote_request_id, token=handle.remote_token)
        answers = self._ask(handle, request, WorkerMeta, check_first=lambda meta: self._check_sizes(handle, meta),
                            timeout_s=timeout_s)
        metas = []
        for (pp_rank, tp_rank, port), meta in zip(prefill_ports(handle), answers):
            if isinstance(meta, ChannelError):
                if watch is not None and watch.expired(time.monotonic()):
                    raise Stalled(f"prefill {handle.remote_engine_id} did not answer this pull's metadata request "
                                  f"within its stall bound ({watch.bound_s:g} s): {meta}") from meta
                raise meta
            if meta.engine_id != handle.remote_engine_id or (meta.pp_rank, meta.tp_rank) != (pp_rank, tp_rank):
                raise ChannelError(
                    f"{join_host_port(handle.remote_host, port)} is engine {meta.engine_id} "
                    f"pp{meta.pp_rank}/tp{meta.tp_rank}, "
                    f"expected {handle.remote_engine_id} pp{pp_rank}/tp{tp_rank} (prefill restarted, or "
                    "another instance's kv_port range overlaps)"
                )
            metas.append(meta)
        check_compatible(self.local, metas)
        if watch is not None:
            watch.progressed(time.monotonic())
        self._peers[self._key(handle)] = metas
        while len(self._peers) > MAX_PEERS:
            self._peers.popitem(last=False)
        return metas

    @staticmethod
    def _check_sizes(handle: PrefillHandle, meta: WorkerMeta) -> None:
        if (meta.tp_size, meta.pp_size) != (handle.remote_tp_size, handle.remote_pp_size):
            raise ChannelError(
                f"{join_host_port(handle.remote_host, handle.remote_kv_port)} runs tp_size {meta.tp_size} x "
                f"pp_size {meta.pp_size}, "
                f"but kv_transfer_params claim {handle.remote_tp_size} x {handle.remote_pp_size}"
            )

    def _calls(self, handle: PrefillHandle, ports: list[tuple[int, int, int]], message, expected: type,
               timeout_s: float | None = None) -> Calls:
        return Calls([(handle.remote_host, port) for _, _, port in ports], message,
                     self.timeout_s if timeout_s is None else timeout_s, expected,
                     client_setup(self.curve, handle.remote_curve_key))

    def _ask(self, handle: PrefillHandle, message, expected: type,
             check_first: Callable[[WorkerMeta], None] | None = None, timeout_s: float | None = None) -> list:
        """Every prefill worker's answer (or ChannelError), asked in parallel. Until peer_metas verified
        the handle, the first worker is asked alone and the others (None: not asked) only once it
        answered, so a forged handle cannot make a decode contact many ports."""
        ports = prefill_ports(handle)
        if self._key(handle) in self._peers:
            return self._calls(handle, ports, message, expected, timeout_s).results()
        (first,) = self._calls(handle, ports[:1], message, expected, timeout_s).results()
        if isinstance(first, ChannelError):
            return [first] + [None] * (len(ports) - 1)
        if check_first is not None:
            check_first(first)
        return [first] + (self._calls(handle, ports[1:], message, expected, timeout_s).results()
                          if len(ports) > 1 else [])

    def forget(self, handle: PrefillHandle) -> None:
        """Drop cached metadata after a failure, so a restarted prefill is asked afresh."""
        self._peers.pop(self._key(handle), None)

    def progress(self, handle: PrefillHandle) -> PrefillProgress:
        """When the handle's prefill last showed progress, shared by every pull from it."""
        key = self._key(handle)
        progress = self._progress.get(key)
        if progress is None:
            progress = self._progress[key] = PrefillProgress()
            while len(self._progress) > MAX_PEERS:
                self._progress.popitem(last=False)
        else:
            self._progress.move_to_end(key)
        return progress

    def read(self, handle: PrefillHandle, local_blocks: Sequence[int], remote_blocks: Sequence[int],
             watch: StallWatch | None = None, claim: Calls | None = None) -> ReadResult:
        """Pull the blocks of every local layer; with `watch`, give up once it finds the pull stalled
        (Stalled: before any side-channel call if it is stalled already, queued behind a stalled pull;
        before any read if a pull from this prefill was given up since its last read landed and it has
        not answered `claim`, this pull's lease renewal, by the deadline)."""
        if watch is not None and watch.expired(time.monotonic()):
            raise Stalled(f"prefill {handle.remote_engine_id} made no progress for {watch.bound_s:g} s before "
                          "this pull's turn")
        if watch is not None and claim is not None and watch.progress.stalled:
            if any(isinstance(answer, ChannelError) for answer in claim.results(until=watch.deadline())):
                raise Stalled(f"prefill {handle.remote_engine_id} has not answered since a pull from it was given up")
            watch.progressed(time.monotonic())  # it answers again: read
        try:
            return self._read(handle, local_blocks, remote_blocks, watch)
        except Stalled:
            watch.progress.gave_up()  # only a watch finds a pull stalled
            raise

    def _read(self, handle: PrefillHandle, local_blocks: Sequence[int], remote_blocks: Sequence[int],
              watch: StallWatch | None) -> ReadResult:
        start = time.perf_counter()
        metas = self.peer_metas(handle, watch)
        handshake_s = time.perf_counter() - start
        sources = choose_sources(self.local, metas)
        per_peer = build_descs(self.local_layers, sources, local_blocks, remote_blocks)
        start = time.perf_counter()
        nbytes = entries = retried = 0
        for session, descs in per_peer.items():
            moved = self.transfer.read(session, descs, watch)
            nbytes += moved.nbytes
            entries += moved.entries
            retried += moved.retried
        return ReadResult(nbytes, entries, time.perf_counter() - start, handshake_s, retried)

    def claim(self, handle: PrefillHandle) -> Calls:
        """Renew the request's lease on every prefill worker; collect the grants with `lease_end`
        after the read (the renewals travel while it runs)."""
        renewal = LeaseRenewal(version=PROTOCOL_VERSION,
                               claims=[LeaseClaim(request_id=handle.remote_request_id, token=handle.remote_token)])
        return self._calls(handle, prefill_ports(handle), renewal, LeaseGrant)

    @staticmethod
    def lease_end(claim: Calls, until: float | None = None) -> float | None:
        """Monotonic time until which every prefill worker keeps the blocks, or None if one did
        not answer (by `until`, if given) or had freed them already. A worker that granted the lease
        held the blocks when it read the renewal (after `claim.sent_at`), and a hold never restarts
        once ended, so the blocks stayed the request's from before the read until at least this time."""
        grants = claim.results(until)
        if any(isinstance(grant, ChannelError) or grant.seconds[0] <= 0 for grant in grants):
            return None
        return claim.sent_at + min(grant.seconds[0] for grant in grants)

    def notify(self, handle: PrefillHandle, ok: bool, timeout_s: float | None = None) -> tuple[bool | None, list[str]]:
        """Tell every prefill worker (in parallel) to free the request's blocks.

        Returns (held, errors): held is False if any worker had already freed them (lease lapsed),
        True if every worker confirmed it still held them, None if some did not answer within
        `timeout_s` (default: the handshake timeout); errors name the workers that did not answer
        (they free when the lease lapses). However many workers a handle names, a round costs at
        most two timeouts.
        """
        notice = DoneNotice(version=PROTOCOL_VERSION, request_id=handle.remote_request_id, token=handle.remote_token,
                            consumer=self.consumer_id, num_consumers=self.num_consumers, success=ok)
        answers = self._ask(handle, notice, Released, timeout_s=timeout_s)
        errors = [str(a) for a in answers if isinstance(a, ChannelError)]
        if None in answers:
            errors[-1] += f"; {answers.count(None)} more workers not notified"
        if not all(a.held for a in answers if isinstance(a, Released)):
            return False, errors
        return (None if errors else True), errors

