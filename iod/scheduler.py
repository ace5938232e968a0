"""Which expert reads run next: demand (`now`) before prefetch (`ahead`), one read per expert.

A `Load` is one expert's read with the list of requests (`Waiter`s) waiting for it; a
second request for an expert already queued or being read joins that load (single-flight).
Loads queue in two FIFOs by priority; a `now` request joining a queued `ahead` load moves
it to the `now` queue. At most `max_inflight` reads run at once (so the reader's own queue
never holds prefetches ahead of later demand reads), and a read starts only when the host
tier can give it a slot: when the arena is full of leases loads wait in the queue (no
deadlock in the daemon; a release or a finished read pumps the queue again). Queues are
bounded: a full queue drops its oldest `ahead` load, or refuses a new `now` one (`busy`);
`ahead` loads queued longer than `ahead_max_age_s` are dropped as stale.

Runs on the daemon's event loop only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .host_cache import HostCache, Key


@dataclass(eq=False)
class Waiter:
    client: bytes
    rid: int
    key: Key
    t0: float  # when the request arrived (for latency)


@dataclass(eq=False)
class Load:
    key: Key
    priority: str  # "now" | "ahead"
    t_queued: float
    waiters: list[Waiter] = field(default_factory=list)
    slot: int = -1  # set when the read starts
    t_started: float = 0.0
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)


class Scheduler:
    def __init__(self, cache: HostCache, start_read: Callable[[Load], None], *, max_inflight: int,
                 max_queued: int, ahead_max_age_s: float, on_dropped: Callable[[Load, str], None]):
        self.cache = cache
        self.start_read, self.on_dropped = start_read, on_dropped
        self.max_inflight, self.max_queued, self.ahead_max_age_s = max_inflight, max_queued, ahead_max_age_s
        self.queues: dict[str, OrderedDict[Key, Load]] = {"now": OrderedDict(), "ahead": OrderedDict()}
        self.reading: dict[Key, Load] = {}
        self.started = {"now": 0, "ahead": 0}  # reads started, by priority at start
        self.dropped = self.refused = 0

    def find(self, key: Key) -> Load | None:
        return self.reading.get(key) or self.queues["now"].get(key) or self.queues["ahead"].get(key)

    def queued(self) -> int:
        return len(self.queues["now"]) + len(self.queues["ahead"])

    def join(self, load: Load, waiter: Waiter, priority: str) -> None:
        """Add a request to an existing load (queued or reading); `now` promotes a queued `ahead`."""
        load.waiters.append(waiter)
        if priority == "now" and load.priority == "ahead" and load.slot < 0:
            del self.queues["ahead"][load.key]
            load.priority = "now"
            self.queues["now"][load.key] = load

    def enqueue(self, waiter: Waiter, priority: str) -> bool:
        """Queue a new load for `waiter.key`; False if the queue is full of `now` work (busy)."""
        if self.queued() >= self.max_queued:
            if not self.queues["ahead"]:
                self.refused += 1
                return False
            _, victim = self.queues["ahead"].popitem(last=False)  # the newest prefetch is the likeliest useful
            self._drop(victim, "queue full: oldest prefetch dropped")
        load = Load(waiter.key, priority, time.monotonic(), [waiter])
        self.queues[priority][waiter.key] = load
        return True

    def pump(self) -> None:
        """Start queued reads while there is read capacity and a free slot."""
        now = time.monotonic()
        while len(self.reading) < self.max_inflight:
            load = self._next(now)
            if load is None:
                return
            slot = self.cache.begin_load(load.key)
            if slot is None:  # arena full of leases: wait for a release
                return
            self.queues[load.priority].pop(load.key)
            load.slot, load.t_started = slot, now
            self.reading[load.key] = load
            self.started[load.priority] += 1
            self.start_read(load)

    def _next(self, now: float) -> Load | None:
        if self.queues["now"]:
            return next(iter(self.queues["now"].values()))
        self.drop_stale(now)
        return next(iter(self.queues["ahead"].values()), None)

    def drop_stale(self, now: float | None = None) -> None:
        """Drop queued prefetches older than `ahead_max_age_s` (also while no read can start)."""
        now, ahead = time.monotonic() if now is None else now, self.queues["ahead"]
        while ahead:
            load = next(iter(ahead.values()))
            if now - load.t_queued <= self.ahead_max_age_s:
                return
            ahead.popitem(last=False)
            self._drop(load, f"stale prefetch (queued {now - load.t_queued:.1f}s)")

    def finished(self, load: Load) -> None:
        """The read of `load` completed (or failed): it no longer counts against capacity."""
        del self.reading[load.key]

    def remove_waiters(self, match: Callable[[Waiter], bool], keys: Iterable[Key] | None = None) -> int:
        """Forget matching requests (only among `keys`' loads when given, else all); queued loads
        left with no waiter are not read at all, running reads go on and stay cached."""
        loads = [self.find(k) for k in keys] if keys is not None else \
            [*self.queues["now"].values(), *self.queues["ahead"].values(), *self.reading.values()]
        removed = 0
        for load in loads:
            if load is None:
                continue
            removed += _filter(load, match)
            if not load.waiters and load.slot < 0:  # queued, not reading: nobody wants it any more
                self.queues[load.priority].pop(load.key, None)
        return removed

    def take_queued(self) -> list[Load]:
        """Every queued (not yet reading) load, removed from the queues (shutdown)."""
        out = [*self.queues["now"].values(), *self.queues["ahead"].values()]
        for q in self.queues.values():
            q.clear()
        return out

    def _drop(self, load: Load, why: str) -> None:
        self.dropped += 1
        self.on_dropped(load, why)

    def stats(self) -> dict:
        return {
            "queued_now": len(self.queues["now"]),
            "queued_ahead": len(self.queues["ahead"]),
            "reading": len(self.reading),
            "max_inflight": self.max_inflight,
            "reads_started_now": self.started["now"],
            "reads_started_ahead": self.started["ahead"],
            "dropped": self.dropped,
            "refused_busy": self.refused,
        }


def _filter(load: Load, match: Callable[[Waiter], bool]) -> int:
    before = len(load.waiters)
    load.waiters = [w for w in load.waiters if not match(w)]
    return before - len(load.waiters)
