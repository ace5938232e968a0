"""How many reads are in flight over time: the current level, the peak, and where time went.

A device only reaches its rated throughput at depth, so "how deep did we really go" is the
number that explains a slow run. The gauge keeps, per level bucket (1, 2-3, 4-7, ... in
powers of two), the seconds spent there while at least one read was in flight, and the
time-weighted mean over that busy time. Not thread-safe: the owner serializes calls (the
scheduler runs on the event loop, the reader's queue calls it under its lock).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def bucket(level: int) -> str:
    """The histogram bucket of `level` >= 1: '1', '2-3', '4-7', '8-15', ..."""
    lo = 1 << (level.bit_length() - 1)
    return "1" if lo == 1 else f"{lo}-{2 * lo - 1}"


class DepthGauge:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:  # a clock tests can drive
        self.clock = clock
        self.level = self.peak = 0
        self.issued = 0  # reads ever started
        self._since = clock()
        self._busy_s = self._area = 0.0  # seconds with level >= 1; integral of level over them
        self._time_at: dict[int, float] = {}  # bucket (the level's bit length) -> seconds

    def add(self, n: int = 1) -> None:
        self._advance()
        self.level += n
        self.issued += n
        self.peak = max(self.peak, self.level)

    def remove(self, n: int = 1) -> None:
        self._advance()
        assert self.level >= n, "more reads finished than started"
        self.level -= n

    def _advance(self) -> None:
        now = self.clock()
        dt, self._since = now - self._since, now
        if self.level:
            self._busy_s += dt
            self._area += dt * self.level
            b = self.level.bit_length()  # (named only in `stats`: this runs twice a read)
            self._time_at[b] = self._time_at.get(b, 0.0) + dt

    def stats(self) -> dict:
        """`in_flight` now, `peak`, `mean` (time-weighted, while busy), `busy_s`, and `hist`:
        share of the busy time spent at each level bucket."""
        self._advance()
        busy = self._busy_s
        hist = {bucket(1 << (b - 1)): round(t / busy, 4) for b, t in sorted(self._time_at.items())} if busy > 0 else {}
        return {"in_flight": self.level, "peak": self.peak, "mean": round(self._area / busy, 3) if busy > 0 else 0.0,
                "busy_s": round(busy, 6), "issued": self.issued, "hist": hist}
