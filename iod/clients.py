"""The daemon's view of one connected client: its leases, pending requests and counters.

Fairness: a client's *claims* are its leases plus its requests in progress (queued, reading or
joined). Past its quota (`IodConfig.lease_quota`) further requests are *parked* here, in
arrival order (`now` ones before `ahead` ones), until the client's own releases make room.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .scheduler import Waiter
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
    held: int = 0  # sum of `leases`
    parked: dict[str, deque[Waiter]] = field(default_factory=lambda: {"now": deque(), "ahead": deque()})
    unsorted: int = 0  # keys of the fetch being handled not yet admitted or parked
    n: ClientCounters = field(default_factory=ClientCounters)

    def describe(self) -> dict:
        return {"name": self.name, "pid": self.pid, "idle_s": round(time.monotonic() - self.last_seen, 3),
                "leases": self.held, "pending_requests": len(self.pending),
                "outstanding": self.outstanding, "parked": self.n_parked(), **vars(self.n)}

    def n_parked(self) -> int:
        return len(self.parked["now"]) + len(self.parked["ahead"])

    def claims(self) -> int:
        """Leases held plus requests admitted and not yet answered (what the quota bounds)."""
        return self.held + self.outstanding - self.n_parked() - self.unsorted

    def must_park(self, priority: str, quota: float) -> bool:
        """Whether a new request waits here: over quota, or behind earlier parked ones (a `now`
        only behind `now` ones: demand goes first)."""
        behind = self.parked["now"] or (priority != "now" and self.parked["ahead"])
        return bool(behind) or self.claims() >= quota

    def unpark(self, quota: float) -> Waiter | None:
        """The next parked request, if the client has room for it now (`now` first)."""
        if self.claims() >= quota:
            return None
        for q in (self.parked["now"], self.parked["ahead"]):
            if q:
                return q.popleft()
        return None

    def expire_parked(self, priority: str, cutoff: float) -> list[Waiter]:
        """Parked requests of `priority` parked before `cutoff` (taken out)."""
        q, out = self.parked[priority], []
        while q and q[0].since < cutoff:
            out.append(q.popleft())
        return out

    def remove_parked(self, match: Callable[[Waiter], bool]) -> int:
        n = 0
        for prio, q in self.parked.items():
            keep = deque(w for w in q if not match(w))
            n += len(q) - len(keep)
            self.parked[prio] = keep
        return n

    def add_lease(self, slot: int, generation: int) -> None:
        self.leases[(slot, generation)] += 1
        self.held += 1

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
        self.held -= 1
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
