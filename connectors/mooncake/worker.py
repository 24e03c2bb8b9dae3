"""Worker side of MooncakeConnectorV2: publishes this worker's caches and pulls remote ones.

Prefill workers answer metadata requests and done-notices on their handshake port and keep a
finished request's blocks until every decode worker said done, or the hold timeout passes. Decode
workers pull in a background thread (the engine keeps stepping), then notify the prefill; any
failure becomes failed block ids so vLLM's kv_load_failure_policy decides (fail or recompute).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.logger import init_logger

from connectors.mooncake.channel import ChannelError, PortInUseError, SideChannelServer, call
from connectors.mooncake.messages import (
    PROTOCOL_VERSION,
    Ack,
    DoneNotice,
    LayerDesc,
    Message,
    MessageError,
    MetaRequest,
    PrefillHandle,
    WorkerMeta,
)
from connectors.mooncake.plan import build_descs, check_compatible, choose_sources
from connectors.mooncake.settings import Settings, local_host
from connectors.mooncake.stats import MooncakeV2Stats
from connectors.mooncake.step_meta import LoadSpec, MooncakeV2Metadata
from connectors.mooncake.transfer import MooncakeTransfer
from kvpp_core.ports import PortLayout
from kvpp_core.runtime import active_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's handlers print it


@dataclass
class _Hold:
    """Producer bookkeeping of one request's blocks kept for decode workers."""

    deadline: float | None = None  # set once the scheduler announced the hold
    consumers: set[str] = field(default_factory=set)
    needed: int = 1
    first_seen: float = field(default_factory=time.monotonic)


def _model_key(vllm_config: VllmConfig) -> str:
    """Identity of the model's KV geometry, independent of the path each node loads it from."""
    hf = vllm_config.model_config.hf_config
    arch = ",".join(getattr(hf, "architectures", None) or [type(hf).__name__])
    return f"{arch}/layers={getattr(hf, 'num_hidden_layers', '?')}"


class MooncakeV2Worker:
    def __init__(self, vllm_config: VllmConfig, engine_id: str, settings: Settings) -> None:
        parallel = vllm_config.parallel_config
        transfer_config = vllm_config.kv_transfer_config
        self.vllm_config = vllm_config
        self.engine_id = engine_id
        self.settings = settings
        self.mla = bool(vllm_config.model_config.use_mla)
        self.tp_rank = get_tp_group().rank_in_group
        self.tp_size = parallel.tensor_parallel_size
        self.pp_rank = get_pp_group().rank_in_group
        self.num_consumers = self.tp_size * parallel.pipeline_parallel_size
        self.consumer_id = f"{engine_id}/pp{self.pp_rank}/tp{self.tp_rank}"
        self.host = local_host()
        ports = PortLayout(
            transfer_config.kv_port,
            tp=self.tp_size,
            pp=parallel.pipeline_parallel_size,
            pcp=parallel.prefill_context_parallel_size,
            dp=parallel.data_parallel_size,
        )
        self.port = ports.handshake_port(dp_rank=parallel.data_parallel_rank, pp_rank=self.pp_rank, tp_rank=self.tp_rank)
        self.transfer = MooncakeTransfer(
            self.host,
            protocol=settings.protocol,
            device_name=settings.device_name,
            timeout_s=settings.transfer_timeout_s,
            max_batch_entries=settings.max_batch_entries,
        )
        self.stats = MooncakeV2Stats()
        self._lock = threading.Lock()
        self._meta: WorkerMeta | None = None
        self._local_layers: dict[str, LayerDesc] = {}
        self._holds: dict[str, _Hold] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpp-mooncake-pull")
        self._pulls: dict[str, tuple[Future[bool], LoadSpec]] = {}
        self._failed_blocks: set[int] = set()
        self._peers: dict[tuple[str, str, int], list[WorkerMeta]] = {}
        try:
            self._server = SideChannelServer(
                self.host, self.port, self._on_message, what=f"MooncakeConnectorV2 worker tp_rank {self.tp_rank}"
            )
        except PortInUseError as exc:
            raise PortInUseError(
                f"{exc}. The port comes from kv_port={transfer_config.kv_port} (this instance uses "
                f"{ports.ports.start}-{ports.ports.stop - 1}); another instance on this host uses it. "
                "Pick a kv_port whose range is free (`kvpp ports` shows ranges and overlaps)."
            ) from exc

    # ---- registration ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = active_layout()  # None: KVPP off, this worker holds every layer
        names = list(kv_caches)
        if layout is not None:
            keep = set(layout.persistent_layer_names)
            names = [n for n in names if n in keep]  # staging views alias; never publish them
        layers, regions, dtypes = [], {}, set()
        for name in names:
            t = kv_caches[name]
            if not t[0].is_contiguous():
                raise ValueError(f"MooncakeConnectorV2 needs contiguous blocks; layer {name} has strides {t.stride()}")
            storage = t.untyped_storage()
            regions[storage.data_ptr()] = storage.nbytes()
            dtypes.add(str(t.dtype).removeprefix("torch."))
            owner = layout.layer_owner(name) if layout is not None else None
            layers.append(
                LayerDesc(
                    name=name,
                    base_addr=t.data_ptr(),
                    num_blocks=t.shape[0],
                    block_len=t[0].numel() * t.element_size(),
                    block_stride=t.stride(0) * t.element_size(),
                    owner=owner,
                )
            )
        self.transfer.register(sorted(regions.items()))
        self._local_layers = {layer.name: layer for layer in layers}
        self._meta = WorkerMeta(
            version=PROTOCOL_VERSION,
            engine_id=self.engine_id,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            te_host=self.host,
            te_rpc_port=self.transfer.rpc_port,
            model=_model_key(self.vllm_config),
            dtype=",".join(sorted(dtypes)),
            block_size=self.vllm_config.cache_config.block_size,
            kvpp=layout is not None,
            layers=layers,
        )
        logger.info(
            "MooncakeConnectorV2 worker tp_rank %d: %d layers published on %s:%d (KVPP %s), TE %s",
            self.tp_rank, len(layers), self.host, self.port, "on" if layout else "off", self.transfer.session,
        )

    # ---- side channel (prefill role) ---------------------------------------------------------

    def _on_message(self, message: Message) -> Message:
        if isinstance(message, MetaRequest):
            if self._meta is None:
                return Ack(version=PROTOCOL_VERSION, ok=False, error="KV caches not registered yet")
            return self._meta
        if isinstance(message, DoneNotice):
            with self._lock:
                hold = self._holds.setdefault(message.request_id, _Hold())
                hold.consumers.add(message.consumer)
                hold.needed = message.num_consumers
            return Ack(version=PROTOCOL_VERSION, ok=True)
        raise MessageError(f"unexpected {type(message).__name__} on a handshake port")

    def _finished_holds(self) -> set[str]:
        """Holds every decode worker released, or whose timeout passed; stale early notices too."""
        now = time.monotonic()
        done = set()
        with self._lock:
            for req_id, hold in list(self._holds.items()):
                if hold.deadline is None:
                    # A notice that arrived before the hold: keep it for a while, then forget it.
                    if now - hold.first_seen > self.settings.hold_timeout_s:
                        del self._holds[req_id]
                    continue
                if len(hold.consumers) >= hold.needed:
                    done.add(req_id)
                elif now >= hold.deadline:
                    logger.warning(
                        "request %s: no decode pulled its KV within hold_timeout_s=%.1f; freeing its blocks",
                        req_id, self.settings.hold_timeout_s,
                    )
                    done.add(req_id)
            for req_id in done:
                del self._holds[req_id]
        return done

    # ---- pulling (decode role) ---------------------------------------------------------------

    def start_load_kv(self, meta: MooncakeV2Metadata) -> None:
        now = time.monotonic()
        with self._lock:
            for req_id, seconds in meta.holds.items():
                self._holds.setdefault(req_id, _Hold()).deadline = now + seconds
        for spec in meta.loads:
            future = self._pool.submit(self._pull, spec)
            if spec.local_block_ids:
                self._pulls[spec.request_id] = (future, spec)

    def _peer_metas(self, handle: PrefillHandle) -> list[WorkerMeta]:
        key = (handle.remote_engine_id, handle.remote_host, handle.remote_kv_port)
        cached = self._peers.get(key)
        if cached is not None:
            return cached
        if handle.remote_pcp_size != 1:
            raise ValueError("MooncakeConnectorV2 cannot pull from a prefill with PCP > 1")
        ports = PortLayout(
            handle.remote_kv_port,
            tp=handle.remote_tp_size,
            pp=handle.remote_pp_size,
            pcp=handle.remote_pcp_size,
            dp=handle.remote_dp_size,
        )
        metas = []
        for pp_rank in range(handle.remote_pp_size):
            for tp_rank in range(handle.remote_tp_size):
                port = ports.handshake_port(dp_rank=handle.remote_dp_rank, pp_rank=pp_rank, tp_rank=tp_rank)
                meta = call(handle.remote_host, port, MetaRequest(version=PROTOCOL_VERSION),
                            self.settings.handshake_timeout_s, WorkerMeta)
                if meta.engine_id != handle.remote_engine_id or (meta.tp_rank, meta.pp_rank) != (tp_rank, pp_rank):
                    raise ChannelError(
                        f"{handle.remote_host}:{port} is engine {meta.engine_id} pp{meta.pp_rank}/tp{meta.tp_rank}, "
                        f"expected {handle.remote_engine_id} pp{pp_rank}/tp{tp_rank} (restarted prefill or port clash)"
                    )
                metas.append(meta)
        check_compatible(self._meta, metas, self.mla)
        self._peers[key] = metas
        return metas

    def _pull(self, spec: LoadSpec) -> bool:
        handle = spec.handle
        ok = True
        try:
            if spec.local_block_ids:
                metas = self._peer_metas(handle)
                sources = choose_sources(self._meta, metas, self.mla)
                per_peer = build_descs(self._local_layers, sources, spec.local_block_ids, spec.remote_block_ids)
                start = time.perf_counter()
                nbytes = entries = 0
                for session, descs in per_peer.items():
                    b, e = self.transfer.read(session, descs)
                    nbytes += b
                    entries += e
                self.stats.record_transfer(nbytes, time.perf_counter() - start, entries)
        except Exception as exc:
            ok = False
            self.stats.record_failure()
            self._peers.pop((handle.remote_engine_id, handle.remote_host, handle.remote_kv_port), None)
            logger.error("request %s: pulling KV from prefill %s failed: %s", spec.request_id, handle.remote_engine_id, exc)
        self._notify(spec, ok)
        return ok

    def _notify(self, spec: LoadSpec, ok: bool) -> None:
        """Tell every prefill worker it may free the request's blocks (best effort, bounded)."""
        handle = spec.handle
        ports = PortLayout(handle.remote_kv_port, tp=handle.remote_tp_size, pp=handle.remote_pp_size,
                           pcp=handle.remote_pcp_size, dp=handle.remote_dp_size)
        notice = DoneNotice(version=PROTOCOL_VERSION, request_id=handle.remote_request_id,
                            consumer=self.consumer_id, num_consumers=self.num_consumers, success=ok)
        for pp_rank in range(handle.remote_pp_size):
            for tp_rank in range(handle.remote_tp_size):
                port = ports.handshake_port(dp_rank=handle.remote_dp_rank, pp_rank=pp_rank, tp_rank=tp_rank)
                try:
                    call(handle.remote_host, port, notice, self.settings.handshake_timeout_s, Ack)
                except (ChannelError, MessageError) as exc:
                    logger.warning("request %s: done-notice to prefill %s:%d failed (%s); it frees "
                                   "after its hold timeout", spec.request_id, handle.remote_host, port, exc)

    def _finished_pulls(self) -> set[str]:
        done = set()
        for req_id, (future, spec) in list(self._pulls.items()):
            if future.done():
                del self._pulls[req_id]
                done.add(req_id)
                if not future.result():
                    self._failed_blocks.update(spec.local_block_ids)
        return done

    # ---- per-step reporting ------------------------------------------------------------------

    def get_finished(self) -> tuple[set[str], set[str]]:
        return self._finished_holds(), self._finished_pulls()

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_stats(self) -> MooncakeV2Stats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._server.close()
        self.transfer.close()
