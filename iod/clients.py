"""The daemon's view of one connected client: its leases, pending requests and counters."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from .status import ClientCounters


@dataclass
class ClientState:
    ident: bytes
    name: str
    pid: int
    last_seen: float
    leases: Counter = field(default_factory=Counter)  # (slot, generation) -> count
    pending: dict[int, int] = field(default_factory=dict)  # rid -> keys not yet answered
    outstanding: int = 0  # sum of `pending`: experts requested and not yet answered (capped per client)
    n: ClientCounters = field(default_factory=ClientCounters)

    def describe(self) -> dict:
        return {"name": self.name, "pid": self.pid, "idle_s": round(time.monotonic() - self.last_seen, 3),
                "leases": sum(self.leases.values()), "pending_requests": len(self.pending),
                "outstanding": self.outstanding, **vars(self.n)}

    def drop_lease(self, slot: int, generation: int) -> bool:
        """Forget one lease; False if this client does not hold it."""
        key = (slot, generation)
        n = self.leases.get(key, 0)
        if n <= 0:
            return False
        if n == 1:
            del self.leases[key]
        else:
            self.leases[key] = n - 1
        return True

    def add_pending(self, rid: int, n: int) -> None:
        self.pending[rid] = n
        self.outstanding += n

    def answered(self, rid: int, n: int = 1) -> None:
        """`n` keys of request `rid` got their `ready` or `error` (or were cancelled)."""
        have = self.pending.get(rid, 0)
        self.outstanding -= min(n, have)
        left = have - n
        if left > 0:
            self.pending[rid] = left
        else:
            self.pending.pop(rid, None)
