"""Side-channel port derivation for MooncakeConnectorV2, shared by the connector, `kvpp ports`
and `kvpp check` so that the overlap check uses exactly the ports the workers will bind."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class PortLayout:
    """Parallel sizes of one serving instance, as they shape its port range."""

    kv_port: int
    tp: int = 1
    pp: int = 1
    pcp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "pcp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.kv_port <= 65535 or self.last_port > 65535:
            raise ValueError(
                f"kv_port {self.kv_port} with {self.num_workers} workers needs ports up to "
                f"{self.last_port}, beyond 65535; choose a lower kv_port"
            )

    @property
    def workers_per_dp(self) -> int:
        return self.tp * self.pp * self.pcp

    @property
    def num_workers(self) -> int:
        return self.workers_per_dp * self.dp

    def handshake_port(self, dp_rank: int = 0, pp_rank: int = 0, pcp_rank: int = 0, tp_rank: int = 0) -> int:
        """Port of one worker's handshake listener."""
        self._check_rank("dp_rank", dp_rank, self.dp)
        self._check_rank("pp_rank", pp_rank, self.pp)
        self._check_rank("pcp_rank", pcp_rank, self.pcp)
        self._check_rank("tp_rank", tp_rank, self.tp)
        return (
            self.kv_port
            + dp_rank * self.workers_per_dp
            + (pp_rank * self.pcp + pcp_rank) * self.tp
            + tp_rank
        )

    def control_port(self, dp_rank: int = 0) -> int:
        """Port of the scheduler-side listener of one DP rank, right after the worker range."""
        self._check_rank("dp_rank", dp_rank, self.dp)
        return self.kv_port + self.num_workers + dp_rank

    @property
    def last_port(self) -> int:
        return self.kv_port + self.num_workers + self.dp - 1

    @property
    def ports(self) -> range:
        return range(self.kv_port, self.last_port + 1)

    @staticmethod
    def _check_rank(name: str, value: int, size: int) -> None:
        if not 0 <= value < size:
            raise ValueError(f"{name} {value} outside 0..{size - 1}")


def overlaps(layouts: Iterable[tuple[str, PortLayout]]) -> list[tuple[str, str, range]]:
    """Pairs of named instances on one host whose port ranges intersect, with the shared range."""
    items = list(layouts)
    found = []
    for i, (name_a, a) in enumerate(items):
        for name_b, b in items[i + 1 :]:
            lo, hi = max(a.ports.start, b.ports.start), min(a.ports.stop, b.ports.stop)
            if lo < hi:
                found.append((name_a, name_b, range(lo, hi)))
    return found
