"""Per-layer broadcast through shared memory, for cache-replica groups whose ranks share one CPU host.

gloo moves a layer owner -> receiver through TCP loopback: serialised by the kernel, one copy into the
socket and one out. Here every rank's whole KV backing lives in a POSIX shared-memory segment that its
peers map, so a receiver copies the owner's persistent pages straight into its staging slot: exactly the
blocks the step references, one `copy_` per run of contiguous block ids, or the whole layer in one `copy_`
where that copies fewer bytes (kvpp_core.packing.choose). Only a few flags travel, in a small control
segment per rank that only its rank writes:

- `ready[layer]`: the owner's epoch (broadcast step) whose history of that layer is in place. The owner
  publishes it for all its layers when the step's first one is issued: the previous step's writes,
  this step's loads and block zeroing all happen before the forward, and during the forward a
  layer is written only by its own attention, after its broadcast. A receiver never reads earlier.
- `read[layer]`: the receiver's epoch whose copy of that layer is complete. The owner waits for every
  receiver's flag before its layer writes the step's new tokens (a write-after-read hazard: the copy
  covers the partial last block those tokens land in), so it also never enters the next step while a
  receiver still copies this one (blocks freed now may be reallocated and zeroed then).
- `aborted`: the epoch a rank gave up on, so its peers fail at once instead of waiting out the timeout;
  a peer whose process is gone is noticed the same way.

The flags are plain aligned 8-byte stores and loads, ordered by x86-64's total store order (the copy's
threads join before the flag is stored); other architectures keep the collective transport.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from kvpp_core.allocation import CacheLayer, Placement, place
from kvpp_core.broadcast import BroadcastStats, KvppBroadcastError, LayerBroadcaster
from kvpp_core.config import KvppConfigError
from kvpp_core.layer_settings import TRANSPORT_ENV, transport_choice
from kvpp_core.ownership import RankLayout, rank_layout
from kvpp_core.packing import Move

logger = logging.getLogger("vllm.kvpp.shm_broadcast")  # the logger vLLM's init_logger hands out

SHM_DIR = Path("/dev/shm")

_MAGIC = 0x4B56505053484D31  # "KVPPSHM1"
_HEADER = 8  # int64 slots: magic, token (2), pid, pid namespace, aborted epoch, finished step, forward started
_TOKEN, _PID, _PIDNS, _ABORTED = 1, 3, 4, 5
FINISHED, STARTED = 6, 7
"""Control slots of kvpp_core.zero_copy: the last step this rank finished, and the last whose forward it began
(everything it writes before the forward, such as vLLM's zeroing of new blocks, is done by then)."""


def layer_flag(position: int) -> int:
    """Control slot of the target layer at `position`: its owner's ready (or, zero-copy, written) epoch;
    the slot after it is the rank's read epoch."""
    return _HEADER + 2 * position

_POLL_CHECK_S = 0.05  # how often a waiter looks for a dead or aborted peer


def shm_identity() -> str:
    """Whose `SHM_DIR` this rank maps: the kernel's boot id and the directory's file system. Ranks that report the
    same map each other's segments; another host (another boot id) or another container's /dev/shm (another
    tmpfs) reports another, however the ranks were started (Ray places ranks on hosts that --nnodes never names)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = platform.node()
    try:
        device = os.stat(SHM_DIR).st_dev
    except OSError:
        device = -1
    return f"{boot}:{device}"


def shm_space() -> tuple[int, int]:
    """(free, size) in bytes of `SHM_DIR`: what a segment may still take, and the whole file system ((0, 0) where it is
    missing or unreadable)."""
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return 0, 0
    return stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _process_gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie counts: it will never write a flag again)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


class _Segment:
    """One shared-memory file mapped into this process; the file is unlinked once every rank mapped it."""

    def __init__(self, path: Path, nbytes: int | None = None) -> None:
        """Create a segment of `nbytes`, or open a peer's (`nbytes` None) at the size it was created."""
        fd = os.open(path, os.O_RDWR | (0 if nbytes is None else os.O_CREAT | os.O_EXCL), 0o600)
        try:
            if nbytes is None:
                nbytes = os.fstat(fd).st_size
            else:
                # Reserve the pages now: a full /dev/shm must fail here, not SIGBUS in the middle of a step.
                os.posix_fallocate(fd, 0, nbytes)
            self.map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.path = path

    def tensor(self) -> torch.Tensor:
        return torch.frombuffer(self.map, dtype=torch.uint8)

    def flags(self) -> memoryview:
        return memoryview(self.map).cast("q")


def _reason_not_shared(device: torch.device, group: dist.ProcessGroup | None) -> str | None:
    if device.type != "cpu":
        return f"the KV cache is on {device.type}, not in host memory"
    if group is not None and dist.get_backend(group) != "gloo":
        return f"the group's backend is {dist.get_backend(group)}, not gloo"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"its flags rely on x86-64 store ordering and this host is {platform.machine()}"
    return None


class ShmGroup:
    """This rank's view of the group's segments: its own KV backing, every peer's, and all flags."""

    def __init__(self, name: str, layers: Sequence[CacheLayer], layout: RankLayout, placement: Placement,
                 ctl: list[_Segment], kv: list[_Segment]) -> None:
        self.name = name
        """The segments' common file-name stem in /dev/shm (unlinked once mapped)."""
        self.layers = list(layers)
        self.layout = layout
        self.placement = placement
        self._segments = ctl + kv
        self.flags = [s.flags() for s in ctl]
        self.kv = [s.tensor() for s in kv]
        me = layout.kvpp_rank
        same_ns = [f[_PIDNS] == self.flags[me][_PIDNS] for f in self.flags]
        self.pids = [f[_PID] if same else None for f, same in zip(self.flags, same_ns)]

    @classmethod
    def negotiate(cls, layers: Sequence[CacheLayer], layout: RankLayout, placement: Placement,
                  group: dist.ProcessGroup | None, group_ranks: Sequence[int],
                  device: torch.device, required_by: str | None = None) -> ShmGroup | None:
        """Collective over the group (every rank calls it): the shared-memory transport, or None for
        the collective one. Logs the choice; raises if KVPP_BROADCAST_TRANSPORT=shm cannot be met, or
        if `required_by` (an option and its fix, e.g. zero-copy's) needs the shared segments."""
        choice = transport_choice()
        me = layout.kvpp_rank
        reason = "disabled by KVPP_BROADCAST_TRANSPORT=collective" if choice == "collective" else (
            _reason_not_shared(device, group))
        if reason is None and layout.group_size > 1:
            shm, reason = cls._handshake(layers, layout, placement, group, group_ranks)
            if shm is not None:
                logger.info("KVPP rank %d/%d: layer broadcast through shared memory (%s, %d KV bytes mapped "
                            "by the group)", me, layout.group_size, TRANSPORT_ENV, placement.total_bytes)
                return shm
        reason = reason or "the group has a single rank"
        if required_by is not None:
            raise KvppConfigError(f"{required_by.format(reason=reason)}")
        if choice == "shm":
            raise KvppConfigError(
                f"{TRANSPORT_ENV}=shm, but the shared-memory broadcast cannot run here: {reason}; "
                f"unset {TRANSPORT_ENV} to let KVPP use the group's collective backend"
            )
        logger.info("KVPP rank %d/%d: layer broadcast through the group's collectives (shared memory not "
                    "used: %s)", me, layout.group_size, reason)
        return None

    @classmethod
    def _handshake(cls, layers, layout, placement, group, group_ranks) -> tuple[ShmGroup | None, str | None]:
        """Each rank creates its segments under a name the group agrees on, then maps every peer's;
        the transport is used only if every rank mapped every segment (the ranks share /dev/shm, which
        is what sharing a host means here). Only a token and a verdict cross the group."""
        me, size = layout.kvpp_rank, layout.group_size
        token = torch.frombuffer(bytearray(secrets.token_bytes(16)), dtype=torch.uint8)
        dist.broadcast(token, src=group_ranks[0], group=group)
        stem = f"kvpp-{token.numpy().tobytes().hex()}"
        ctl: list[_Segment | None] = [None] * size
        kv: list[_Segment | None] = [None] * size
        problem = None
        try:
            try:
                ctl[me] = _Segment(SHM_DIR / f"{stem}-{me}.ctl", 8 * (_HEADER + 2 * len(layout.target_layers)))
                kv[me] = _Segment(SHM_DIR / f"{stem}-{me}.kv", placement.total_bytes)
                own = ctl[me].flags()
                own[_TOKEN], own[_TOKEN + 1] = (int.from_bytes(token.numpy().tobytes()[i:i + 8], "little", signed=True)
                                                for i in (0, 8))
                own[_PID], own[_PIDNS] = os.getpid(), _pid_namespace()
                own[0] = _MAGIC  # last: a peer that sees the magic sees the rest
            except OSError as exc:
                problem = f"cannot create a segment in {SHM_DIR} ({exc}); enlarge it (docker run --shm-size)"
            if _all_agree(problem is None, group) and problem is None:
                try:
                    for r in range(size):
                        if r != me:
                            ctl[r] = _Segment(SHM_DIR / f"{stem}-{r}.ctl")
                            kv[r] = _Segment(SHM_DIR / f"{stem}-{r}.kv")
                            theirs = ctl[r].flags()
                            if theirs[0] != _MAGIC or list(theirs[_TOKEN:_TOKEN + 2]) != list(own[_TOKEN:_TOKEN + 2]):
                                raise OSError(f"rank {r}'s control segment holds another group's token")
                            peer = _placement_of(layers, layout, r, placement.num_blocks)
                            persistent = max((sum(peer.region(n)) for n in peer.persistent), default=0)
                            if len(kv[r].map) < persistent:
                                raise OSError(f"rank {r}'s KV segment has {len(kv[r].map)} bytes, its persistent "
                                              f"layers alone take {persistent}")
                except OSError as exc:
                    problem = f"rank {me} cannot map its peers' segments ({exc}): the ranks do not share a host"
            elif problem is None:
                problem = "another rank could not create its segment"
            agreed = _all_agree(problem is None, group)  # every rank has mapped everything it will map
        finally:
            for suffix in ("ctl", "kv"):  # mappings live on; nothing is left behind, even on an error
                (SHM_DIR / f"{stem}-{me}.{suffix}").unlink(missing_ok=True)
        dist.barrier(group=group)  # and every rank's names are gone once negotiate returns
        if not agreed:
            return None, problem or "another rank could not map the group's segments"
        return cls(stem, layers, layout, placement, ctl, kv), None  # type: ignore[arg-type]

    def adopt(self, caches: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """Move the views vLLM just carved from its KV backing onto this rank's shared segment, same
        offsets, sizes and strides, before anything binds or registers them. The engine's own buffer
        is then released."""
        mine = self.kv[self.layout.kvpp_rank]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in caches.values()}
        if len(storages) != 1 or next(iter(storages.values())) != mine.numel():
            raise RuntimeError(
                f"KVPP shared-memory broadcast expects one KV backing of {mine.numel()} bytes, vLLM "
                f"allocated {sorted(storages.values())}; set {TRANSPORT_ENV}=collective"
            )
        storage = mine.untyped_storage()
        for tensor in {id(t): t for t in caches.values()}.values():
            tensor.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
        return caches

    def peer_placement(self, rank: int) -> Placement:
        """Where kvpp rank `rank` keeps its persistent caches in its segment."""
        return _placement_of(self.layers, self.layout, rank, self.placement.num_blocks)

    def broadcaster(self, bound: torch.Tensor, timeout: float) -> ShmLayerBroadcaster:
        """The broadcaster over the adopted backing; `bound` is the backing the engine's caches use."""
        me = self.layout.kvpp_rank
        if bound.untyped_storage().data_ptr() != self.kv[me].data_ptr():
            raise RuntimeError("KVPP: the engine's KV caches are not bound to the shared segment")
        n = self.placement.num_blocks
        by_layer: dict[int, list[CacheLayer]] = {}
        for cache in sorted(self.layers, key=lambda c: c.name):
            if cache.layer_id is not None:
                by_layer.setdefault(cache.layer_id, []).append(cache)
        placements = {r: _placement_of(self.layers, self.layout, r, n) for r in range(self.layout.group_size)}

        def pages(rank: int, layer_id: int) -> list[torch.Tensor]:
            out = []
            for cache in by_layer[layer_id]:
                offset, nbytes = placements[rank].region(cache.name)
                out.append(self.kv[rank][offset:offset + nbytes].view(n, -1))
            return out

        regions = {lid: pages(me, lid) for lid in self.layout.target_layers}
        sources = {lid: pages(self.layout.owner_of(lid), lid) for lid in self.layout.foreign}
        return ShmLayerBroadcaster(self.layout, regions, sources, n, self, timeout)


def _placement_of(layers: Sequence[CacheLayer], layout: RankLayout, rank: int, num_blocks: int) -> Placement:
    """A peer's placement, from the single placement function. Its staging slots (which our slot
    count need not equal) come after its persistent region, so only persistent offsets are used."""
    peer = rank_layout(layout.target_layers, layout.group_size, rank, max(layout.staging_slots, 1))
    return place(layers, peer, num_blocks)


def _all_agree(ok: bool, group: dist.ProcessGroup | None) -> bool:
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class PeerWaits:
    """Waiting on a peer's flag in the group's control segments, bounded: a peer that abandoned the step,
    whose process is gone, or that stays silent past the timeout fails the wait with the layer and both
    ranks named. The host class sets `layout`, `_shm`, `_epoch`, `_timeout_s`."""

    _what = "shared-memory broadcast"
    layout: RankLayout
    _shm: ShmGroup
    _epoch: int
    _timeout_s: float

    @property
    def _own_flags(self) -> memoryview:
        return self._shm.flags[self.layout.kvpp_rank]

    def _await(self, layer_id: int | None, peer: int, done: Callable[[], bool], what: str) -> None:
        """Poll a peer's flag: yield the CPU first (the peer is usually a layer away at most), then
        sleep in growing steps; fail on timeout, on the peer's abort, or when its process is gone."""
        if done():
            return
        started = time.monotonic()
        checked, nap = started, 0.0
        while not done():
            now = time.monotonic()
            if now - checked >= _POLL_CHECK_S:
                checked = now
                self._check_peer(layer_id, peer, what)
                if now - started > self._timeout_s:
                    raise self._peer_failure(layer_id, peer, f"no {what} within {self._timeout_s:g} s")
            time.sleep(nap)
            nap = min(nap * 2 or 1e-5, 2e-4)

    def _check_peer(self, layer_id: int | None, peer: int, what: str) -> None:
        if self._shm.flags[peer][_ABORTED] >= self._epoch:
            raise self._peer_failure(layer_id, peer, f"kvpp rank {peer} abandoned the step")
        pid = self._shm.pids[peer]
        if pid is not None and _process_gone(pid):
            raise self._peer_failure(layer_id, peer, f"kvpp rank {peer} (pid {pid}) has exited")

    def _peer_failure(self, layer_id: int | None, peer: int, why: str) -> KvppBroadcastError:
        """`layer_id` None: the wait was the step barrier, not a layer's."""
        subject = (f"{self._what} of layer {layer_id} (owner kvpp rank {self.layout.owner_of(layer_id)})"
                   if layer_id is not None else f"step barrier before step {self._epoch + 1}")
        return KvppBroadcastError(
            f"KVPP {subject} failed on kvpp rank {self.layout.kvpp_rank} waiting for kvpp rank {peer}: {why}"
        )

    def _abandon(self) -> None:
        """Tell the peers this epoch will not complete here."""
        self._active = False
        self._own_flags[_ABORTED] = self._epoch


@dataclass
class ShmBroadcastStats(BroadcastStats):
    transport: str = "shm"
    """Named in the worker's report, so a benchmark can say which transport it measured."""


class ShmLayerBroadcaster(PeerWaits, LayerBroadcaster):
    """LayerBroadcaster's schedule (issue, prefetch into the other slot, wait) over shared memory.

    A receiver copies a layer when it is issued if its owner has already published it (so a
    prefetched layer is in place before its turn), else when it is waited for. The copies run on
    the forward's own thread: a helper thread would fight the Python-heavy eager forward for the
    GIL, and each hand-over can cost milliseconds that the owner, waiting for the copy, pays too.
    So every copy is waited for by the forward that makes it, wherever it runs; an owner moves
    nothing, its readers do. A layer is in flight only while this rank's forward copies it or waits
    for it (for its owner's publish or, as its owner, for its readers' copies): nothing is hidden
    (`stats.flight_seconds` equals `stats.wait_seconds`), and what prefetch buys is a shorter wait,
    an owner finding its layers already copied. `stats.bytes` counts the bytes copied into this rank.
    """

    def __init__(self, layout: RankLayout, regions: Mapping[int, Sequence[torch.Tensor]],
                 sources: Mapping[int, Sequence[torch.Tensor]], num_blocks: int, shm: ShmGroup,
                 timeout: float) -> None:
        super().__init__(layout, regions, num_blocks, None, list(range(layout.group_size)), timeout)
        self.stats = ShmBroadcastStats()
        self._sources = {lid: list(t) for lid, t in sources.items()}
        self._shm = shm
        self._timeout_s = timeout
        self._epoch = 0
        self._published = 0
        self._ready_slots = [_HEADER + 2 * self._position[lid] for lid in layout.owned]

    def transport(self) -> tuple[str, int]:
        return "shared memory", len(self._shm.kv)

    def _pack_buffers(self, bound: int) -> list[torch.Tensor]:
        return []  # a receiver copies the referenced blocks straight from its owner's pages

    def begin_step(self, active: bool, block_ids=None) -> None:
        super().begin_step(active, block_ids)
        if self._active:
            self._epoch += 1

    def end_step(self) -> None:
        if self._active and len(self._delivered) < len(self.layout.target_layers):
            self._abandon()  # the forward failed here: peers waiting on this rank must not wait it out
        super().end_step()

    # -- the two transport primitives LayerBroadcaster.before_layer schedules ---------------------

    def _issue(self, layer_id: int, started: float) -> None:
        pos = self._position[layer_id]
        owner = self.layout.owner_of(layer_id)
        if owner == self.layout.kvpp_rank:
            if self._published < self._epoch:  # every owned layer's history is in place: see the module doc
                for slot in self._ready_slots:
                    self._own_flags[slot] = self._epoch
                self._published = self._epoch
            self._pending[layer_id] = []
        elif self._shm.flags[owner][2 * pos + _HEADER] >= self._epoch:
            self._guarded(layer_id, lambda: self._copy(layer_id, pos, owner))  # by this forward: waited for
            self._pending[layer_id] = []
        else:
            self._pending[layer_id] = [owner]  # copied, and so in flight, only once waited for

    def _wait(self, layer_id: int) -> None:
        due = self._pending.pop(layer_id)
        pos = self._position[layer_id]
        started = time.perf_counter()
        self._issued[layer_id] = started  # in flight only while this forward copies it or waits for it
        try:
            if due:
                self._guarded(layer_id, lambda: self._copy(layer_id, pos, due[0]))
            elif self.layout.owner_of(layer_id) == self.layout.kvpp_rank:
                read = 2 * pos + _HEADER + 1
                for r in range(self.layout.group_size):
                    if r != self.layout.kvpp_rank:
                        self._guarded(layer_id, lambda r=r: self._await(
                            layer_id, r, lambda f=self._shm.flags[r]: f[read] >= self._epoch, "copy"))
        finally:
            self._landed(layer_id, started)
        self._delivered.add(layer_id)
        self.stats.layers += 1

    # -- helpers -----------------------------------------------------------------------------------

    def _guarded(self, layer_id: int, work: Callable[[], None]) -> None:
        try:
            work()
        except KvppBroadcastError:
            self._abandon()
            raise

    def _copy(self, layer_id: int, pos: int, owner: int) -> None:
        """Copy the layer's referenced blocks from its owner's pages, one copy per run of contiguous block ids,
        or the whole layer where that copies fewer bytes (kvpp_core.packing.choose)."""
        ready = 2 * pos + _HEADER
        self._await(layer_id, owner, lambda f=self._shm.flags[owner]: f[ready] >= self._epoch, "publish")
        exact = self._move(layer_id, collective=False) is Move.RUNS
        runs = self._step.runs if exact else (range(0, self.num_blocks),)
        for dst, src in zip(self._blocks[layer_id], self._sources[layer_id]):
            for r in runs:
                dst[r.start:r.stop].copy_(src[r.start:r.stop])
        self._count_received(layer_id, len(self._step) if exact else None)
        self._own_flags[ready + 1] = self._epoch
