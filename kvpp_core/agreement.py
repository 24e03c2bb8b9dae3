"""What an engine's ranks agree on at start, before the KV cache is sized.

One exchange over the engine's ranks (a gloo group: vLLM's world CPU group in an engine), then every rank decides
from the same gathered reports, so all reach the same decision, or all refuse with the same message:

- the settings that change how a layer moves (kvpp_core.layer_settings) are the same on every rank, or the launch
  is refused naming the rank and its value;
- the mode (kvpp_core.modes.resolve, from `StartFacts`): a launch that names none runs zero-copy only where every
  rank's setup allows it, each cache-replica group's ranks share one /dev/shm and each host's /dev/shm holds its
  ranks' KV backing, staging otherwise; decided here, before the budget becomes blocks, the block count is the
  mode's. A launch that names zero-copy where the facts rule it out is refused (kvpp_core.validation), naming
  /dev/shm, the size it needs and the fix.

Reports travel as msgspec JSON, each checked against its type and its sender's rank.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Sequence

import msgspec
import torch
import torch.distributed as dist

from kvpp_core import layer_settings
from kvpp_core.allocation import CacheLayer, bytes_per_block
from kvpp_core.config import ZERO_COPY
from kvpp_core.modes import Mode, RankStart, StartFacts, resolve, setup_obstacles
from kvpp_core.ownership import rank_layout
from kvpp_core.setup import KvppSetup
from kvpp_core.shm_broadcast import shm_identity, shm_space
from kvpp_core.validation import raise_for_errors, zero_copy_problems

logger = logging.getLogger("vllm.kvpp.agreement")  # the logger vLLM's init_logger hands out

MAX_REPORT_BYTES = 1 << 16
"""A rank's report is a few hundred bytes; anything past this is not one."""


class Report(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    start: RankStart
    settings: dict[str, str]
    """kvpp_core.layer_settings.read() of the rank."""


def report(setup: KvppSetup, layers: Sequence[CacheLayer], kvpp_rank: int, memory_bytes: int | None,
           rank: int) -> Report:
    """This rank's report: its setup's own obstacles, its /dev/shm, and the blocks its budget would hold under
    zero-copy (only where nothing else rules it out and the budget is known)."""
    obstacles = tuple(o.reason for o in setup_obstacles(setup))
    blocks, per_block = None, 0
    if memory_bytes is not None and not obstacles:
        layout = rank_layout({c.layer_id for c in layers if c.layer_id is not None}, setup.topology.group_size,
                             kvpp_rank, ZERO_COPY)
        per_block = bytes_per_block(layers, layout)
        blocks = memory_bytes // per_block
    free, size = shm_space()
    start = RankStart(rank=rank, hostname=platform.node(), shm=shm_identity(), shm_free=free, shm_size=size,
                      zero_copy_blocks=blocks, zero_copy_block_bytes=per_block, obstacles=obstacles)
    return Report(start, layer_settings.read())


def exchange(mine: Report, group: dist.ProcessGroup | None) -> list[Report]:
    """Every rank's report, in rank order (a collective over `group`, a gloo group)."""
    data = msgspec.json.encode(mine)
    if len(data) > MAX_REPORT_BYTES:
        raise ValueError(f"KVPP start-up report of {len(data)} bytes exceeds {MAX_REPORT_BYTES}")
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(int(s.item()) for s in sizes)
    if longest > MAX_REPORT_BYTES:
        raise ValueError(f"a KVPP start-up report of {longest} bytes exceeds {MAX_REPORT_BYTES}")
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    reports = [msgspec.json.decode(g[:int(n.item())].numpy().tobytes(), type=Report)
               for g, n in zip(gathered, sizes)]
    for position, got in enumerate(reports):
        if got.start.rank != position:
            raise ValueError(f"KVPP start-up: rank {position} reported itself as rank {got.start.rank}")
    return reports


def agree(setup: KvppSetup, layers: Sequence[CacheLayer], kvpp_rank: int, memory_bytes: int | None,
          group: dist.ProcessGroup | None) -> Mode:
    """The mode every rank of `group` runs (a collective: every rank calls it, before the KV cache is sized), or
    KvppConfigError, the same on every rank: settings that differ between ranks, or a named zero-copy the facts
    rule out. `memory_bytes`: this rank's KV budget (None: not known, so /dev/shm's room is not checked)."""
    rank = dist.get_rank(group)
    reports = exchange(report(setup, layers, kvpp_rank, memory_bytes, rank), group)
    layer_settings.refuse_differences({r.start.rank: r.settings for r in reports})
    facts = StartFacts(tuple(r.start for r in reports), setup.topology.group_size)
    raise_for_errors(zero_copy_problems(setup, facts))
    mode = resolve(setup, facts)
    if rank == 0:
        logger.info("KVPP mode: %s", mode)
    return mode
