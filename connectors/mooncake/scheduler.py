"""Scheduler side of MooncakeConnectorV2: decides what to hold (prefill) and what to pull (decode).

Role-agnostic on purpose: a request carrying `do_remote_decode` is prefilled here and held for a
decode; one carrying `do_remote_prefill` has its prompt KV pulled from the prefill named in its
kv_transfer_params. vLLM's kv_role only decides which of the two ever happens.

A held request's kv_transfer_params carry a fresh unguessable token: the prefill's workers answer
side-channel requests about it only to the holder of that token. Tokens are issued under this
engine's key (tokens.py), which every step's metadata carries to the workers, so a worker knows a
genuine token even before it hears of the hold. The decode checks a handle's
bounds (and CURVE agreement) before it connects anywhere; a bad one is computed locally.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from connectors.common.hosts import local_host
from connectors.mooncake import tokens
from connectors.mooncake.curve import load_curve, server_key
from connectors.mooncake.leases import LeaseKeeper
from connectors.mooncake.messages import PROTOCOL_VERSION, MessageError, PrefillHandle, is_ident, parse_handle
from connectors.mooncake.metadata import LoadSpec, MooncakeV2Metadata
from connectors.mooncake.puller import prefill_ports
from connectors.mooncake.settings import MooncakeV2Settings
from connectors.mooncake.stats import MooncakeV2Stats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's handlers print it

_HOLDABLE = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class MooncakeV2Scheduler:
    def __init__(self, vllm_config: VllmConfig, engine_id: str, settings: MooncakeV2Settings) -> None:
        parallel = vllm_config.parallel_config
        transfer = vllm_config.kv_transfer_config
        self.engine_id = engine_id
        self.settings = settings
        self.block_size = vllm_config.cache_config.block_size
        self.max_tokens = vllm_config.model_config.max_model_len
        self.curve = load_curve(settings.curve_secret_key_file, settings.curve_public_keys_dir)
        self._handle_fields = {
            "remote_engine_id": engine_id,
            "remote_host": local_host(),
            "remote_kv_port": transfer.kv_port,
            "remote_tp_size": parallel.tensor_parallel_size,
            "remote_pp_size": parallel.pipeline_parallel_size,
            "remote_pcp_size": parallel.prefill_context_parallel_size,
            "remote_dp_size": parallel.data_parallel_size,
            "remote_dp_rank": parallel.data_parallel_rank,
            "protocol_version": PROTOCOL_VERSION,
            "remote_lease_s": settings.lease_s,
            "remote_curve_key": self.curve.public.decode() if self.curve else None,
        }
        self._new_loads: list[LoadSpec] = []
        self._new_holds: dict[str, float] = {}
        self._new_tokens: dict[str, str] = {}
        self._held: set[str] = set()
        self._token_key = tokens.new_key()
        self.stats = MooncakeV2Stats()
        self.leases = LeaseKeeper(settings.handshake_timeout_s, self.curve)
        self._handles: dict[str, PrefillHandle] = {}  # decode: request id -> its handle, until pulled or ended
        self._arrived: dict[str, float] = {}  # decode: request id -> arrival (perf_counter)
        self._pulled: dict[str, float] = {}  # decode: request id -> when its finished pull was seen

    # ---- decode side -------------------------------------------------------------------------

    def _handle(self, request: Request) -> PrefillHandle | None:
        """The request's handle while it still has a pull to make, parsed the first time a hook sees it
        (get_num_new_matched_tokens runs on every scheduling attempt)."""
        handle = self._handles.get(request.request_id)
        if handle is None:
            handle = self._parse_handle(request)
            if handle is not None:
                self._handles[request.request_id] = handle
        return handle

    def _parse_handle(self, request: Request) -> PrefillHandle | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            handle = parse_handle(params)
            handle.check_blocks(self.block_size, self.max_tokens)
            prefill_ports(handle)  # a handle this decode cannot pull from (PCP) never reaches the leases
            server_key(self.curve, handle.remote_curve_key)
            return handle
        except (MessageError, ValueError) as exc:
            # Computing the prompt locally still gives the right tokens; say why it happened.
            logger.error("request %s: %s; computing its prompt locally", request.request_id, exc)
            params["do_remote_prefill"] = False
            return None

    def on_new_request(self, request: Request) -> None:
        handle = self._handle(request)
        if handle is not None:
            self._arrived[request.request_id] = time.perf_counter()
            self.leases.add(request.request_id, handle)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        handle = self._handle(request)
        if handle is None:
            return 0, False
        count = min(handle.remote_num_tokens, request.num_prompt_tokens) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        handle = self._handle(request)
        if handle is None:
            return
        request.kv_transfer_params["do_remote_prefill"] = False  # one pull per request
        del self._handles[request.request_id]
        local: tuple[int, ...] = ()
        remote: tuple[int, ...] = ()
        if num_external_tokens > 0:
            group = blocks.blocks[0]
            first = sum(1 for block in group if block.block_hash is not None)  # local prefix hit
            end = min(
                _cdiv(first * self.block_size + num_external_tokens, self.block_size),
                len(group),
                len(handle.remote_block_ids),
            )
            local = tuple(block.block_id for block in group[first:end])
            remote = tuple(handle.remote_block_ids[first:end])
        arrived = self._arrived.pop(request.request_id, None)
        if arrived is not None and local:
            self.stats.record_phase("admit", time.perf_counter() - arrived)
        if not local:
            self.leases.drop(request.request_id)  # nothing to read: the worker only frees the hold
        self._new_loads.append(LoadSpec(request.request_id, handle, local, remote, scheduled_at=time.time()))

    # ---- prefill side ------------------------------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._arrived.pop(request.request_id, None)
        self._pulled.pop(request.request_id, None)
        self.leases.drop(request.request_id)
        handle = self._handles.pop(request.request_id, None)
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Finished before it was scheduled (abort): the prefill still holds its blocks.
            handle = handle or self._parse_handle(request)
            if handle is not None:
                self._new_loads.append(LoadSpec(request.request_id, handle, (), ()))
                params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode") or request.status not in _HOLDABLE or not block_ids:
            return False, None  # aborted or errored prefill: free now, nobody will pull
        if not is_ident(request.request_id):
            logger.error("request id %r cannot travel in kv_transfer_params (1-256 visible ASCII characters, "
                         "check X-Request-Id); its KV is not kept for a decode", request.request_id)
            return False, None
        self._new_holds[request.request_id] = self.settings.hold_timeout_s
        self._new_tokens[request.request_id] = token = tokens.issue(self._token_key, request.request_id)
        self._held.add(request.request_id)
        handle = PrefillHandle(
            remote_hold_expires_at=time.time() + self.settings.hold_timeout_s,
            remote_request_id=request.request_id,
            remote_token=token,
            remote_block_ids=list(block_ids),
            remote_num_tokens=request.num_computed_tokens,
            **self._handle_fields,
        )
        return True, handle.to_params() | {"do_remote_decode": False}

    def has_pending_block_frees(self) -> bool:
        return bool(self._held)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._held.difference_update(output.finished_sending or ())
        now = time.perf_counter()
        for request_id in output.finished_recving or ():
            self._pulled[request_id] = now
            self.leases.drop(request_id)

    def get_stats(self) -> MooncakeV2Stats | None:
        return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        self.leases.close()

    # ---- both --------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MooncakeV2Metadata:
        if self._pulled:
            now = time.perf_counter()
            for request_id in self._pulled.keys() & scheduler_output.num_scheduled_tokens.keys():
                self.stats.record_phase("resume", now - self._pulled.pop(request_id))
        meta = MooncakeV2Metadata(loads=self._new_loads, holds=self._new_holds, tokens=self._new_tokens,
                                  token_key=self._token_key, idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._new_loads, self._new_holds, self._new_tokens = [], {}, {}
        return meta
