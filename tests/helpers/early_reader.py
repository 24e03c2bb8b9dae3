"""The negative control of zero-copy KVPP: readers that skip the owner's written-flag wait and, by
construction, read every foreign layer of every step before its owner has written the step's tokens.

Named as an engine's `worker_extension_cls` (testbed EngineSettings.worker_extension), this module is imported
in every worker process before its model loads; importing it patches that process only:

- `ZeroCopyLayers.before_read` no longer waits for the owner's `written` flag;
- once a foreign layer's attention (`MLAAttention.forward_impl`) has returned, the reader stores the step
  in its own read slot of that layer (`layer_flag(position) + 1`, which zero-copy leaves unused);
- an owner writes a layer's new tokens only after every peer has stored that read.

No peer waits on anything the owner does between its write and the reader's attention (the TP all-reduce
comes after attention), so nothing deadlocks, and no timing decides the order: a decode step's attention on
a reader misses the new token's KV in every foreign layer, and the answers must differ from KVPP off's.
"""

from __future__ import annotations

import functools

from vllm.model_executor.layers.attention.mla_attention import MLAAttention

from kvpp_core import runtime
from kvpp_core.shm_broadcast import layer_flag
from kvpp_core.zero_copy import ZeroCopyLayers


class EarlyReader:
    """The worker extension vLLM mixes into the worker class: no methods; the patches below are the point."""


def _read_slot(layers: ZeroCopyLayers, layer_id: int) -> int:
    return layer_flag(layers._position[layer_id]) + 1


def _before_read_without_waiting(self: ZeroCopyLayers, layer_id: int) -> None:
    if self._in_step and self.layout.owner_of(layer_id) != self.layout.kvpp_rank:
        self._forward_begins()
        self._seen.add(layer_id)
        self.stats.reads += 1
        self.stats.layers += 1


def _write_after_the_peers_read(orig):
    @functools.wraps(orig)
    def write(self: ZeroCopyLayers, layer_id: int, do_write) -> None:
        if self._in_step and self.layout.owner_of(layer_id) == self.layout.kvpp_rank:
            slot = _read_slot(self, layer_id)
            for peer in range(self.layout.group_size):
                if peer != self.layout.kvpp_rank:
                    self._await(layer_id, peer, lambda f=self._shm.flags[peer]: f[slot] >= self._epoch, "early read")
        orig(self, layer_id, do_write)

    return write


def _flag_the_read(orig):
    @functools.wraps(orig)
    def forward_impl(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        rt = runtime.current()
        layer_id = None if rt is None else rt.layout.layer_ids.get(self.layer_name)
        layers = None if rt is None else rt.broadcaster
        if layer_id is not None and isinstance(layers, ZeroCopyLayers) and layers._in_step \
                and layers.layout.owner_of(layer_id) != layers.layout.kvpp_rank:
            layers._own_flags[_read_slot(layers, layer_id)] = layers._epoch
        return out

    return forward_impl


ZeroCopyLayers.before_read = _before_read_without_waiting
ZeroCopyLayers.write = _write_after_the_peers_read(ZeroCopyLayers.write)
MLAAttention.forward_impl = _flag_the_read(MLAAttention.forward_impl)
