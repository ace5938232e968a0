"""The daemon's view of one connected client: its leases, pending requests and counters.

Fairness: a client's *claims* are its leases plus its requests in progress (queued, reading or
joined); a share's claims (peers.py: the clients of one user or process) are its clients'. Past
the share's quota (`IodConfig.lease_quota`) further requests are *parked* here, in arrival order
(`now` ones before `ahead` ones), until the share's own releases make room. Leases the daemon
recalled (fairness.py) are kept with the time they were recalled, until released or revoked.
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
    pid: int  # as the client says (for people); `peer_pid` is the kernel's
    last_seen: float
    share: tuple = ()  # peers.share_key: whose share of the arena this client uses
    peer_pid: int = 0  # SO_PEERCRED pid (0: unknown, e.g. tcp)
    leases: Counter = field(default_factory=Counter)  # (slot, generation) -> count
    leased_at: dict[tuple[int, int], float] = field(default_factory=dict)  # first grant: oldest recalled first
    recalled: dict[tuple[int, int], float] = field(default_factory=dict)  # lease -> when it was recalled
    pending: dict[int, int] = field(default_factory=dict)  # rid -> keys not yet answered
    outstanding: int = 0  # sum of `pending`: experts requested and not yet answered (capped per client)
    held: int = 0  # sum of `leases`
    parked: dict[str, deque[Waiter]] = field(default_factory=lambda: {"now": deque(), "ahead": deque()})
    unsorted: int = 0  # keys of the fetch being handled not yet admitted or parked
    n: ClientCounters = field(default_factory=ClientCounters)

    def describe(self) -> dict:
        return {"name": self.name, "pid": self.pid, "idle_s": round(time.monotonic() - self.last_seen, 3),
                "peer_pid": self.peer_pid, "share": self.share_text(),
                "leases": self.held, "recalled": len(self.recalled), "pending_requests": len(self.pending),
                "outstanding": self.outstanding, "parked": self.n_parked(), **vars(self.n)}

    def share_text(self) -> str:
        """'uid 1000', 'pid 4242' or 'connection' (a share of its own)."""
        return f"{self.share[0]} {self.share[1]}" if self.share and self.share[0] != "connection" else "connection"

    def n_parked(self) -> int:
        return len(self.parked["now"]) + len(self.parked["ahead"])

    def claims(self) -> int:
        """Leases held plus requests admitted and not yet answered (what the quota bounds)."""
        return self.held + self.outstanding - self.n_parked() - self.unsorted

    def must_park(self, priority: str, quota: float, claims: int) -> bool:
        """Whether a new request waits here: its share's `claims` at the quota, or behind earlier
        parked ones (a `now` only behind `now` ones: demand goes first)."""
        behind = self.parked["now"] or (priority != "now" and self.parked["ahead"])
        return bool(behind) or claims >= quota

    def unpark(self, quota: float, claims: int) -> Waiter | None:
        """The next parked request, if the share has room for it now (`now` first)."""
        if claims >= quota:
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
        key = (slot, generation)
        self.leases[key] += 1
        self.leased_at.setdefault(key, time.monotonic())
        self.held += 1

    def oldest_unrecalled(self, n: int) -> list[tuple[int, int]]:
        """Up to `n` leases not recalled yet, the longest held first (a decoder's idle prefetches)."""
        keys = sorted((t, k) for k, t in self.leased_at.items() if k not in self.recalled)
        return [k for _, k in keys[:n]]

    def take_back(self, key: tuple[int, int]) -> int:
        """Forget every lease of `key` (revoked); returns how many there were."""
        n = self.leases.pop(key, 0)
        self.leased_at.pop(key, None)
        self.recalled.pop(key, None)
        self.held -= n
        return n

    def drop_lease(self, slot: int, generation: int) -> bool:
        """Forget one lease; False if this client does not hold it."""
        key = (slot, generation)
        n = self.leases.get(key, 0)
        if n <= 0:
            return False
        if n == 1:
            del self.leases[key]
            self.leased_at.pop(key, None)
            self.recalled.pop(key, None)
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
