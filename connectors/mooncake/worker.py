"""Worker side of MooncakeConnectorV2: publishes this worker's caches and pulls remote ones.

Prefill workers answer metadata requests and done-notices on their handshake port and keep a
finished request's blocks until every decode worker said done, or the hold timeout passes. Decode
workers pull in a background thread (the engine keeps stepping), then notify the prefill; any
failure becomes failed block ids so vLLM's kv_load_failure_policy decides (fail or recompute).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch
from vllm.distributed.parallel_state import get_pp_group, get_tp_group
from vllm.logger import init_logger

from connectors.mooncake.affinity import unpin_current_thread
from connectors.mooncake.channel import PortInUseError, SideChannelServer
from connectors.mooncake.curve import load_curve
from connectors.mooncake.holds import HoldTable
from connectors.mooncake.messages import PROTOCOL_VERSION, LayerDesc, PrefillHandle, WorkerMeta
from connectors.mooncake.puller import Puller
from connectors.mooncake.responder import PrefillResponder
from connectors.mooncake.settings import Settings, local_host
from connectors.mooncake.stats import MooncakeV2Stats
from connectors.mooncake.step_meta import LoadSpec, MooncakeV2Metadata
from connectors.mooncake.transfer import MooncakeTransfer, TransferError
from kvpp_core.ports import PortLayout
from kvpp_core.runtime import active_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's handlers print it
IDLE_POLL_S = 0.02

HOLD_MARGIN_S = 1.0  # clock skew between nodes we tolerate when trusting remote_hold_expires_at


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


def _read_was_held(handle: PrefillHandle, held: bool | None, finished_at: float) -> bool:
    """Whether the blocks read were still the request's: every prefill worker confirmed, or (some
    did not answer) the read ended a safe margin before the prefill's hold could expire."""
    if held is not None:
        return held
    return handle.remote_hold_expires_at is not None and finished_at < handle.remote_hold_expires_at - HOLD_MARGIN_S


class MooncakeV2Worker:
    def __init__(self, vllm_config: VllmConfig, engine_id: str, settings: Settings) -> None:
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
                                         timeout_s=settings.transfer_timeout_s,
                                         max_batch_entries=settings.max_batch_entries,
                                         max_entry_bytes=settings.max_entry_bytes)
        self.stats = MooncakeV2Stats()
        self.holds = HoldTable(settings.hold_timeout_s)
        self.curve = load_curve(settings.curve_secret_key_file, settings.curve_public_keys_dir)
        self._responder = PrefillResponder(self.holds)
        self._meta: WorkerMeta | None = None
        self._puller: Puller | None = None
        # Unpinned: the pull thread (and the ZeroMQ I/O thread it starts) must not queue behind this
        # rank's compute threads on one core.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpp-mooncake-pull",
                                        initializer=unpin_current_thread)
        self._pulls: dict[str, tuple[Future[bool], LoadSpec]] = {}
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
            owners = {n: layout.layer_owner(n) for n in kv_caches}
        else:
            owners = {}
        layers, regions = describe_layers(kv_caches, owners)
        self.transfer.register(sorted(regions.items()))
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in kv_caches.values()})
        self._meta = WorkerMeta(
            version=PROTOCOL_VERSION, engine_id=self.engine_id, tp_rank=self.tp_rank, tp_size=self.tp_size,
            pp_rank=self.pp_rank, pp_size=self.vllm_config.parallel_config.pipeline_parallel_size,
            te_host=self.host, te_rpc_port=self.transfer.rpc_port,
            model=model_key(self.vllm_config), dtype=",".join(dtypes),
            block_size=self.vllm_config.cache_config.block_size, kvpp=layout is not None, layers=layers,
        )
        self._responder.meta = self._meta
        parallel = self.vllm_config.parallel_config
        self._puller = Puller(
            self.transfer, self._meta, mla=bool(self.vllm_config.model_config.use_mla),
            timeout_s=self.settings.handshake_timeout_s,
            consumer_id=f"{self.engine_id}/pp{self.pp_rank}/tp{self.tp_rank}",
            num_consumers=self.tp_size * parallel.pipeline_parallel_size, curve=self.curve,
        )
        logger.info("MooncakeConnectorV2 tp_rank %d: %d layers published on %s:%d (KVPP %s), TE %s",
                    self.tp_rank, len(layers), self.host, self.port, "on" if layout else "off",
                    self.transfer.session)

    # ---- decode role -------------------------------------------------------------------------

    def start_load_kv(self, meta: MooncakeV2Metadata) -> None:
        self._idle_step = meta.idle
        for request_id, seconds in meta.holds.items():
            for _ in range(self.holds.hold(request_id, seconds, meta.tokens[request_id])):
                self.stats.record_refusal("unauthorized")  # an early done-notice with a wrong token
        for spec in meta.loads:
            future = self._pool.submit(self._pull, spec)
            if spec.local_block_ids:
                self._pulls[spec.request_id] = (future, spec)

    def _pull(self, spec: LoadSpec) -> bool:
        """Background thread: read one request's blocks, release them on the prefill, and keep the
        result only if the prefill confirms it still held them (or the read ended well before the
        hold could expire)."""
        handle, ok, done = spec.handle, True, None
        if spec.local_block_ids:
            try:
                done = self._puller.read(handle, spec.local_block_ids, spec.remote_block_ids)
            except Exception as exc:  # any failure is a load error for vLLM's policy, never a crash
                ok = False
                self._puller.forget(handle)
                logger.error("request %s: pulling KV from prefill %s failed: %s", spec.request_id,
                             handle.remote_engine_id, exc)
                if isinstance(exc, TransferError):
                    # A timed-out read may still have pieces in flight into these blocks; keep them
                    # out of vLLM's hands (the request stays waiting) until such pieces have landed,
                    # so they cannot overwrite what a recompute writes there.
                    time.sleep(self.settings.transfer_timeout_s)
        finished_at = time.time()
        held, errors = self._puller.notify(handle, ok)
        for error in errors:
            logger.warning("request %s: done-notice failed (%s); the prefill frees after its hold timeout",
                           spec.request_id, error)
        if ok and done is not None and not _read_was_held(handle, held, finished_at):
            ok = False
            logger.error("request %s: prefill %s may have freed the blocks before the pull finished "
                         "(hold_timeout_s too short for this load?); discarding what was read",
                         spec.request_id, handle.remote_engine_id)
        if done is not None and ok:
            nbytes, entries, seconds = done
            self.stats.record_transfer(nbytes, seconds, entries)
        elif spec.local_block_ids:
            self.stats.record_failure()
        return ok

    # ---- per-step reporting ------------------------------------------------------------------

    def get_finished(self) -> tuple[set[str], set[str]]:
        if self._idle_step:
            # An engine that only waits for transfers (decode: pulls; prefill: done-notices) steps
            # empty in a busy loop, which on a small host starves the transfer threads it waits
            # for. Block briefly on what it waits for instead; a step with tokens never waits.
            if self._pulls:
                wait([future for future, _ in self._pulls.values()], timeout=IDLE_POLL_S,
                     return_when=FIRST_COMPLETED)
            elif len(self.holds):
                self.holds.wait_for_notice(IDLE_POLL_S)
        released, expired = self.holds.pop_finished()
        if expired:
            logger.warning("no decode pulled %s within hold_timeout_s=%.1f; freeing their blocks",
                           sorted(expired), self.settings.hold_timeout_s)
        recved = set()
        for request_id, (future, spec) in list(self._pulls.items()):
            if future.done():
                del self._pulls[request_id]
                recved.add(request_id)
                if not future.result():
                    self._failed_blocks.update(spec.local_block_ids)
        return released | expired, recved

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_stats(self) -> MooncakeV2Stats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._server.close()
        self.transfer.close()
