"""A setting set on one rank only: named as an engine's `worker_extension_cls` (testbed EngineSettings.worker_extension),
this module is imported in every worker process before its model loads, and makes the worker of rank 1 set
KVPP_BROADCAST_WHOLE_CACHE=1 in its own environment right before KVPP builds its worker context, where the ranks
read their settings (as a node whose environment differs does, under Ray). Rank 0 keeps it unset."""

from __future__ import annotations

import functools
import os

import torch.distributed as dist

from kvpp_core import vllm_adapter


class OneRankWholeCache:
    """The worker extension vLLM mixes into the worker class: no methods; the patch below is the point."""


def _on_rank_one(orig):
    @functools.wraps(orig)
    def build_context(worker, *args):
        if dist.get_rank() == 1:
            os.environ["KVPP_BROADCAST_WHOLE_CACHE"] = "1"
        return orig(worker, *args)

    return build_context


vllm_adapter._build_context = _on_rank_one(vllm_adapter._build_context)
