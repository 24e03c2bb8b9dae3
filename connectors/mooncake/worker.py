"""Worker side of MooncakeConnectorV2: publishes this worker's caches and pulls remote ones.

Prefill workers answer metadata requests, done-notices and lease renewals on their handshake port
and keep a finished request's blocks until every decode worker said done, or the lease lapses.
Decode workers pull on a few background threads (the engine keeps stepping), report the request
as soon as its read is known good, then notify the prefill; any failure becomes failed block ids
so vLLM's kv_load_failure_policy decides (fail or recompute). A pull whose prefill makes no progress
is given up at its stall bound (connectors/mooncake/stall.py). However a pull fails, its blocks are
reported only once the transfer engine can no longer write into them (transfer.Drain): until then the
request stays waiting for them, so vLLM gives them to no other request and recomputes nothing into them.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, NamedTuple

import torch
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.logger import init_logger

from kvpp_core.runtime import active_layout

from connectors.common.hosts import local_host
from connectors.common.kv_caches import block_pages_problem, rank_kv_heads
from connectors.common.mooncake_env import PROGRESS_TIMEOUT_ENV, progress_timeout_s
from connectors.mooncake.affinity import unpin_current_thread
from connectors.mooncake.channel import PortInUseError, SideChannelServer
from connectors.mooncake.curve import load_curve
from connectors.mooncake.holds import HoldTable
from connectors.mooncake.messages import PROTOCOL_VERSION, LayerDesc, WorkerMeta
from connectors.mooncake.metadata import LoadSpec, MooncakeV2Metadata
from connectors.mooncake.ports import PortLayout
from connectors.mooncake.puller import Puller
from connectors.mooncake.pulls import PullPool
from connectors.mooncake.responder import PrefillResponder
from connectors.mooncake.settings import MooncakeV2Settings
from connectors.mooncake.stall import LinkRate, StallWatch
from connectors.mooncake.stats import MooncakeV2Stats
from connectors.mooncake.transfer import Drain, MooncakeTransfer, Stalled, TransferError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's handlers print it
IDLE_POLL_S = 0.02

LEASE_MARGIN_S = 0.5  # a read must end this long before the lease a prefill granted for it


def model_key(vllm_config: VllmConfig) -> str:
    """Identity of the model's KV geometry, independent of the path each node loads it from."""
    hf = vllm_config.model_config.hf_config
    arch = ",".join(getattr(hf, "architectures", None) or [type(hf).__name__])
    return f"{arch}/layers={getattr(hf, 'num_hidden_layers', '?')}"


def describe_layers(kv_caches: dict[str, torch.Tensor], owners: dict[str, int | None]) -> tuple[list[LayerDesc], dict[int, int]]:
    """Layer records of the given caches plus the (storage address -> bytes) regions backing them."""
    layers, regions = [], {}
    for name, t in kv_caches.items():
        if not t[0].is_contiguous():
            raise ValueError(f"MooncakeConnectorV2 needs contiguous blocks; layer {name} has strides {t.stride()}")
        storage = t.untyped_storage()
        regions[storage.data_ptr()] = storage.nbytes()
        layers.append(LayerDesc(
            name=name,
            base_addr=t.data_ptr(),
            num_blocks=t.shape[0],
            block_len=t[0].numel() * t.element_size(),
            block_stride=t.stride(0) * t.element_size(),
            owner=owners.get(name),
        ))
    return layers, regions


class _Pulled(NamedTuple):
    ok: bool
    finished: float
    """perf_counter() when the pull ended."""
    drain: Drain | None = None
    """Reads of a failed pull still in flight: the request is reported once they ended."""


class MooncakeV2Worker:
    def __init__(self, vllm_config: VllmConfig, engine_id: str, settings: MooncakeV2Settings) -> None:
        parallel = vllm_config.parallel_config
        transfer_config = vllm_config.kv_transfer_config
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.settings = settings
        self.tp_rank = get_tp_group().rank_in_group
        self.tp_size = parallel.tensor_parallel_size
        self.pp_rank = get_pp_group().rank_in_group
        self.host = local_host()
        ports = PortLayout(transfer_config.kv_port, tp=self.tp_size, pp=parallel.pipeline_parallel_size,
                           pcp=parallel.prefill_context_parallel_size, dp=parallel.data_parallel_size)
        self.port = ports.handshake_port(dp_rank=parallel.data_parallel_rank, pp_rank=self.pp_rank, tp_rank=self.tp_rank)
        self.transfer = MooncakeTransfer(self.host, protocol=settings.protocol, device_name=settings.device_name,
                                         progress_timeout_s=settings.stall_timeout_s,
                                         max_entry_bytes=settings.max_entry_bytes,
                                         other_bound_s=settings.transfer_timeout_s)
        if progress_timeout_s() > settings.stall_timeout_s + 1:
            logger.warning("%s=%d is set: a given-up pull's reads may keep its blocks that long after its stall "
                           "bound (stall_timeout_s=%g); unset it to let the connector set it", PROGRESS_TIMEOUT_ENV,
                           progress_timeout_s(), settings.stall_timeout_s)
        self._rate = LinkRate()
        self.stats = MooncakeV2Stats()
        self.holds = HoldTable(settings.hold_timeout_s, settings.lease_s)
        self.curve = load_curve(settings.curve_secret_key_file, settings.curve_public_keys_dir)
        self._responder = PrefillResponder(self.holds, on_renewed=lambda n: self.stats.record_leases(renewed=n))
        self._meta: WorkerMeta | None = None
        self._puller: Puller | None = None
        # Unpinned: the pull threads (and the ZeroMQ I/O thread they start) must not queue behind
        # this rank's compute threads on one core.
        self._pool = PullPool(settings.max_parallel_pulls, settings.max_pulls_per_prefill,
                              initializer=unpin_current_thread)
        self._notices = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpp-mooncake-notice",
                                           initializer=unpin_current_thread)
        self._pulls: dict[str, tuple[Future[_Pulled], LoadSpec]] = {}
        self._idle_step = False
        self._failed_blocks: set[int] = set()
        try:
            # A decode may ask before this worker learns of the hold: answer within half its timeout.
            self._server = SideChannelServer(self.host, self.port, self._responder,
                                             what=f"MooncakeConnectorV2 worker tp_rank {self.tp_rank}",
                                             on_refused=self.stats.record_refusal,
                                             defer_s=settings.handshake_timeout_s / 2, curve=self.curve)
        except PortInUseError as exc:
            raise PortInUseError(
                f"{exc}. The port comes from kv_port={transfer_config.kv_port} (this instance uses "
                f"{ports.ports.start}-{ports.ports.stop - 1}); another instance on this host uses it. "
                "Pick a kv_port whose range is free (`kvpp ports` shows ranges and overlaps)."
            ) from exc

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = active_layout()  # None: KVPP off, this worker holds every layer
        if layout is not None:
            # Staging views alias each other and hold other ranks' layers: never publish them.
            keep = set(layout.persistent_layer_names)
            kv_caches = {n: t for n, t in kv_caches.items() if n in keep}
            # A persistent target layer is this rank's own: its owner in its cache-replica group.
            owners = {n: self.tp_rank if layout.layer_owner(n) is not None else None for n in kv_caches}
        else:
            owners = {}
        problem = block_pages_problem(self.vllm_config, kv_caches, "MooncakeConnectorV2")
        if problem is not None:
            raise ValueError(problem)
        layers, regions = describe_layers(kv_caches, owners)
        self.transfer.register(sorted(regions.items()))
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in kv_caches.values()})
        heads = rank_kv_heads(self.vllm_config, self.tp_rank)
        self._meta = WorkerMeta(
            version=PROTOCOL_VERSION, engine_id=self.engine_id, tp_rank=self.tp_rank, tp_size=self.tp_size,
            pp_rank=self.pp_rank, pp_size=self.vllm_config.parallel_config.pipeline_parallel_size,
            te_host=self.host, te_rpc_port=self.transfer.rpc_port,
            model=model_key(self.vllm_config), dtype=",".join(dtypes),
            block_size=self.vllm_config.cache_config.block_size, kvpp=layout is not None,
            kv_heads=None if heads is None else list(heads), layers=layers,
        )
        self._responder.meta = self._meta
        parallel = self.vllm_config.parallel_config
        self._puller = Puller(
            self.transfer, self._meta, timeout_s=self.settings.handshake_timeout_s,
            consumer_id=f"{self.engine_id}/pp{self.pp_rank}/tp{self.tp_rank}",
            num_consumers=self.tp_size * parallel.pipeline_parallel_size, curve=self.curve,
        )
        logger.info("MooncakeConnectorV2 tp_rank %d: %d layers%s published on %s:%d (KVPP %s), TE %s",
                    self.tp_rank, len(layers), "" if heads is None else f" of KV heads {list(heads)}", self.host,
                    self.port, "on" if layout else "off", self.transfer.session)

    # ---- decode role -------------------------------------------------------------------------

    def start_load_kv(self, meta: MooncakeV2Metadata) -> None:
        self._idle_step = meta.idle
        if meta.token_key is not None:
            self.holds.key = meta.token_key
        for request_id, seconds in meta.holds.items():
            for _ in range(self.holds.hold(request_id, seconds, meta.tokens[request_id])):
                self.stats.record_refusal("unauthorized")  # an early notice or renewal with a wrong token
        for spec in meta.loads:
            if not spec.local_block_ids:  # nothing to read (aborted before scheduled): only free
                self._notices.submit(self._notify, spec, False)
                continue
            prefill = (spec.handle.remote_engine_id, spec.handle.remote_host, spec.handle.remote_kv_port)
            self._pulls[spec.request_id] = (self._pool.submit(prefill, self._pull, spec, time.monotonic()), spec)

    def _pull(self, spec: LoadSpec, submitted: float) -> _Pulled:
        """Pull thread: read one request's blocks while renewing its lease, and keep the result only
        if the lease covered the whole read (else only if the prefill confirms it still held them).
        The done-notice that frees the blocks on the prefill goes out after the request is reported,
        off its path to the first token. A stalled prefill costs the pull its stall bound, and its
        side channel the bound again for each answer the read needs: the lease grant, then (if that did not
        come) the confirmation. Each gets a whole bound: a busy prefill's side channel answers late, and a
        confirmation cut short discards a good read (measured: a crowd's pull failed at 0.05 s)."""
        handle, bound = spec.handle, self.settings.stall_timeout_s
        self.stats.record_phase("dispatch", time.time() - spec.scheduled_at)
        watch = StallWatch(bound, self._rate, self._puller.progress(handle), since=submitted)
        claim = None
        try:
            claim = self._puller.claim(handle)
            done = self._puller.read(handle, spec.local_block_ids, spec.remote_block_ids, watch, claim)
            lease_end = self._puller.lease_end(claim, until=time.monotonic() + bound)
        except Exception as exc:  # any failure is a load error for vLLM's policy, never a crash
            if claim is not None:
                claim.close()
            if not isinstance(exc, Stalled):  # a stalled prefill keeps its metadata: asking it again would wait
                self._puller.forget(handle)
            logger.error("request %s: pulling KV from prefill %s failed: %s", spec.request_id,
                         handle.remote_engine_id, exc)
            self.stats.record_failure(stalled=isinstance(exc, Stalled))
            self._notices.submit(self._notify, spec, False)
            # Reads still in flight may yet write into these blocks; keep them out of vLLM's hands (the
            # request stays waiting) until the engine says each ended, so nothing lands after a
            # recompute wrote there. Only the report waits, no thread does.
            drain = exc.drain if isinstance(exc, TransferError) else None
            return _Pulled(False, time.perf_counter(), drain)
        if lease_end is not None and time.monotonic() < lease_end - LEASE_MARGIN_S:
            ok = True
            self._notices.submit(self._notify, spec, True)
        else:
            # Renewal unanswered or the read outlived the lease: trust the read only if every
            # prefill worker confirms it still held the blocks.
            start = time.perf_counter()
            ok = self._notify(spec, True, timeout_s=bound) is True
            self.stats.record_phase("notify", time.perf_counter() - start)
            if not ok:
                logger.error("request %s: prefill %s may have freed the blocks before the pull finished; "
                             "discarding what was read", spec.request_id, handle.remote_engine_id)
        if ok:
            self._rate.record(done.nbytes, done.seconds)
            self.stats.record_transfer(done.nbytes, done.seconds, done.entries, done.retried)
            self.stats.record_phase("handshake", done.handshake_s)
        else:
            self.stats.record_failure()
        return _Pulled(ok, time.perf_counter())

    def _notify(self, spec: LoadSpec, ok: bool, timeout_s: float | None = None) -> bool | None:
        """Tell the prefill to free the request's blocks. Never raises: whatever the prefill (or a peer
        posing as one) answers, or a socket error, becomes "not confirmed" (None), so nothing a peer
        sends reaches the engine step through a pull's result."""
        try:
            held, errors = self._puller.notify(spec.handle, ok, timeout_s)
        except Exception as exc:
            logger.warning("request %s: done-notice failed (%s); the prefill frees when the lease lapses",
                           spec.request_id, exc)
            return None
        for error in errors:
            logger.warning("request %s: done-notice failed (%s); the prefill frees when the lease lapses",
                           spec.request_id, error)
        return held

    # ---- per-step reporting ------------------------------------------------------------------

    def get_finished(self) -> tuple[set[str], set[str]]:
        if self._idle_step:
            # An engine that only waits for transfers (decode: pulls; prefill: done-notices) steps
            # empty in a busy loop, which on a small host starves the transfer threads it waits
            # for. Block briefly on what it waits for instead; a step with tokens never waits.
            running = [future for future, _ in self._pulls.values() if not future.done()]
            if running:
                wait(running, timeout=IDLE_POLL_S, return_when=FIRST_COMPLETED)
            elif self._pulls:
                time.sleep(IDLE_POLL_S)  # only drains left
            elif len(self.holds):
                self.holds.wait_for_notice(IDLE_POLL_S)
        released, lapsed = self.holds.pop_finished()
        if lapsed:
            self.stats.record_leases(lapsed=len(lapsed))
            logger.warning("the leases of %s lapsed (no decode claimed them within hold_timeout_s=%.1f, or "
                           "it stopped renewing for lease_s=%.1f); freeing their blocks", sorted(lapsed),
                           self.settings.hold_timeout_s, self.settings.lease_s)
        recved = set()
        now = time.perf_counter()
        for request_id, (future, spec) in list(self._pulls.items()):
            if not future.done():
                continue
            pulled = self._result(request_id, future)
            if pulled.drain is not None and not self._drained(request_id, pulled.drain):
                continue
            del self._pulls[request_id]
            recved.add(request_id)
            if pulled.ok:
                self.stats.record_phase("report", now - pulled.finished)
            else:
                self._failed_blocks.update(spec.local_block_ids)
        return released | lapsed, recved

    def _result(self, request_id: str, future: Future[_Pulled]) -> _Pulled:
        """The pull's outcome; a pull thread that raised (past the read, which turns its own errors into
        failures with their drain) failed with no read in flight: never an exception in the engine's step."""
        error = future.exception()
        if error is None:
            return future.result()
        logger.error("request %s: its pull failed outside the read: %r", request_id, error)
        self.stats.record_failure()
        return _Pulled(False, time.perf_counter())

    def _drained(self, request_id: str, drain: Drain) -> bool:
        """Whether no read of a failed pull can still write into its blocks: each ended, or Mooncake's own bound on
        them expired (transfer.Drain)."""
        if not drain.ended():
            return False
        if drain.outlived:
            logger.error("request %s: %d reads of its failed pull were still in flight for Mooncake %.0f s after the "
                         "pull ended, past its own bound (%s=%d); reporting the blocks failed, their lanes stay taken "
                         "until Mooncake ends the reads", request_id, drain.outlived, self.transfer.engine_bound_s,
                         PROGRESS_TIMEOUT_ENV, progress_timeout_s())
        return True

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_stats(self) -> MooncakeV2Stats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        self._pool.shutdown()
        self._notices.shutdown(wait=False, cancel_futures=True)
        self._server.close()
        self.transfer.close()
