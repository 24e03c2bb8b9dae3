"""A long simulation's progress on stderr: a bar redrawn in place on a terminal (tqdm), a plain line every few
seconds elsewhere (a log, a pipe), so that neither floods the other's reader."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

BAR_EVERY_S = 0.5
LINE_EVERY_S = 5.0


class Progress:
    """Requests answered of `total` (None: unknown), the simulated time and the hit rate so far."""

    def __init__(self, label: str, total: int | None, stream: TextIO | None = None):
        self.label, self.total = label, total
        self.stream = sys.stderr if stream is None else stream
        self._bar = tqdm(total=total, desc=label, unit="req", unit_scale=True, file=self.stream, mininterval=0,
                         dynamic_ncols=True) if self.stream.isatty() else None
        self._every = BAR_EVERY_S if self._bar is not None else LINE_EVERY_S
        self._next = time.perf_counter() + self._every

    def due(self) -> bool:
        return time.perf_counter() >= self._next

    def show(self, answered: int, simulated_s: float, hit_rate: float, host_s: float) -> None:
        if self._bar is not None:
            self._bar.n = answered
            self._bar.set_postfix_str(f"{simulated_s:,.0f} s simulated, hit rate {hit_rate:.3f}")  # redraws
        else:
            total = f"/{self.total:,}" if self.total else ""
            print(f"[simulate] {self.label}: {answered:,}{total} answered, {simulated_s:,.0f} s simulated, hit rate "
                  f"{hit_rate:.3f}, {host_s:.0f} s", file=self.stream, flush=True)
        self._next = time.perf_counter() + self._every

    def close(self, answered: int, simulated_s: float, hit_rate: float, host_s: float) -> None:
        """The final state; a bar ends its line."""
        self.show(answered, simulated_s, hit_rate, host_s)
        if self._bar is not None:
            self._bar.close()
