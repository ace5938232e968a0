"""Which expert reads run next: demand (`now`) before prefetch (`ahead`), one read per expert.

A `Load` is one expert's read with the list of requests (`Waiter`s) waiting for it; a
second request for an expert already queued or being read joins that load (single-flight).
Loads queue in two FIFOs by priority. A `now` request joining a queued `ahead` load moves it
to the `now` queue (so it is never dropped as a stale prefetch); joining one already being
read promotes its read inside the reader (`promote_read`), ahead of queued prefetch chunks.

Rules for starting a read (each `pump` starts as many as they allow, at once):
- reads: at most `max_inflight` loads read at once (the reader keeps its own `depth` device
  reads busy from them, demand chunks first). `ahead` loads may hold at most
  `max_inflight - reserve_reads` of those places (at least 1), so a `now` load always finds a
  free place at once or after a `now` read ends, never behind prefetches;
- arena: a read starts only when the host tier can give it a slot (when the arena is full of
  leases loads wait in the queue; no deadlock: a release or a finished read pumps again). An
  `ahead` load starts only while more than `reserve_slots` slots are free (not leased, not
  loading; cached experts count as free), so prefetches, and the leases they turn into,
  never take the last `reserve_slots` slots from demand loads.
Queues are bounded: a full queue drops its oldest `ahead` load, or refuses a new `now` one
(`busy`); `ahead` loads queued longer than `ahead_max_age_s` are dropped as stale, and `now`
loads that could get no arena slot for a whole deadline are handed back (`expire_starved`):
waiting for reads always ends, waiting for other clients to release leases might not.

Runs on the daemon's event loop only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .depth_gauge import DepthGauge
from .host_cache import HostCache, Key


@dataclass(eq=False)
class Waiter:
    client: bytes
    rid: int
    key: Key
    t0: float  # when the request arrived (for latency)
    priority: str = "now"  # as asked (kept while parked over its client's quota)
    since: float = 0.0  # when it was parked


@dataclass(eq=False)
class Load:
    key: Key
    priority: str  # "now" | "ahead"
    t_queued: float
    waiters: list[Waiter] = field(default_factory=list)
    slot: int = -1  # set when the read starts
    t_started: float = 0.0
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)
    started_as: str = ""  # the priority it held a read place under
    waited: bool = False  # a `now` load found no read place or no slot free at least once
    handle: object = None  # the reader's handle of the read, for `promote_read`


class Scheduler:
    def __init__(self, cache: HostCache, start_read: Callable[[Load], None], *, max_inflight: int,
                 max_queued: int, ahead_max_age_s: float, on_dropped: Callable[[Load, str], None],
                 reserve_reads: int = 0, reserve_slots: int = 0,
                 promote_read: Callable[[Load], None] = lambda load: None):
        self.cache = cache
        self.start_read, self.on_dropped, self.promote_read = start_read, on_dropped, promote_read
        self.max_inflight, self.max_queued, self.ahead_max_age_s = max_inflight, max_queued, ahead_max_age_s
        self.ahead_max_inflight = max(1, min(max_inflight, max_inflight - reserve_reads))
        self.reserve_slots = reserve_slots
        self.queues: dict[str, OrderedDict[Key, Load]] = {"now": OrderedDict(), "ahead": OrderedDict()}
        self.reading: dict[Key, Load] = {}
        self.reading_as = {"now": 0, "ahead": 0}  # loads reading, by `started_as`
        self.started = {"now": 0, "ahead": 0}  # reads started, by priority at start
        self.gauge = DepthGauge()  # expert loads reading
        self.peak_ahead = 0  # most `ahead` loads reading at once
        self.now_waited = {"place": 0, "slot": 0}  # `now` loads that had to wait for capacity, by what
        self.dropped = self.refused = self.expired = 0
        self.starved_since: float | None = None  # since when no load could get an arena slot

    def find(self, key: Key) -> Load | None:
        return self.reading.get(key) or self.queues["now"].get(key) or self.queues["ahead"].get(key)

    def queued(self) -> int:
        return len(self.queues["now"]) + len(self.queues["ahead"])

    def join(self, load: Load, waiter: Waiter, priority: str) -> None:
        """Add a request to an existing load (queued or reading); `now` promotes a queued `ahead`."""
        load.waiters.append(waiter)
        if priority != "now" or load.priority == "now":
            return
        load.priority = "now"
        if load.slot < 0:  # queued: out of reach of stale and queue-full drops
            del self.queues["ahead"][load.key]
            self.queues["now"][load.key] = load
        else:  # reading: its chunks not yet at the device go before prefetch chunks
            self.promote_read(load)

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
        """Start every queued read the rules allow now (see the module docstring), in one go."""
        now = time.monotonic()
        while (load := self._next(now)) is not None:
            slot = self.cache.begin_load(load.key)
            if slot is None:  # arena full of leases: wait for a release
                self._note_wait(load, "slot")
                if self.starved_since is None:
                    self.starved_since = now
                return
            self.starved_since = None
            self._start(load, slot, now)
        if not self.queued():  # nothing waits for a slot any more
            self.starved_since = None

    def _next(self, now: float) -> Load | None:
        """The load to start next, or None if no place is free for it."""
        if len(self.reading) >= self.max_inflight:
            if self.queues["now"]:
                self._note_wait(next(iter(self.queues["now"].values())), "place")
            return None
        if self.queues["now"]:
            return next(iter(self.queues["now"].values()))
        self.drop_stale(now)
        if not self.ahead_may_start():
            return None
        return next(iter(self.queues["ahead"].values()), None)

    def ahead_may_start(self) -> bool:
        """Whether one more prefetch fits in its share of read places and leaves the reserved slots free."""
        return self.reading_as["ahead"] < self.ahead_max_inflight and self.cache.free_slots() > self.reserve_slots

    def _note_wait(self, load: Load, what: str) -> None:
        if load.priority == "now" and not load.waited:
            load.waited = True
            self.now_waited[what] += 1

    def _start(self, load: Load, slot: int, now: float) -> None:
        self.queues[load.priority].pop(load.key)
        load.slot, load.t_started, load.started_as = slot, now, load.priority
        self.reading[load.key] = load
        self.reading_as[load.priority] += 1
        self.started[load.priority] += 1
        self.peak_ahead = max(self.peak_ahead, self.reading_as["ahead"])
        self.gauge.add()
        self.start_read(load)

    def drop_stale(self, now: float | None = None) -> None:
        """Drop queued prefetches older than `ahead_max_age_s` (also while no read can start)."""
        now, ahead = time.monotonic() if now is None else now, self.queues["ahead"]
        while ahead:
            load = next(iter(ahead.values()))
            if now - load.t_queued <= self.ahead_max_age_s:
                return
            ahead.popitem(last=False)
            self._drop(load, f"stale prefetch (queued {now - load.t_queued:.1f}s)")

    def expire_starved(self, deadline_s: float, now: float | None = None) -> list[tuple[Load, float]]:
        """Take the queued `now` loads that have waited `deadline_s` while no arena slot could be
        had (every slot leased or loading the whole time), with how long each waited."""
        now = time.monotonic() if now is None else now
        if self.starved_since is None:
            return []
        out = []
        for load in list(self.queues["now"].values()):
            waited = now - max(load.t_queued, self.starved_since)
            if waited >= deadline_s:
                del self.queues["now"][load.key]
                out.append((load, waited))
        self.expired += len(out)
        return out

    def finished(self, load: Load) -> None:
        """The read of `load` completed (or failed): it no longer counts against capacity."""
        del self.reading[load.key]
        self.reading_as[load.started_as] -= 1
        self.gauge.remove()

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
            "reading_ahead": self.reading_as["ahead"],
            "peak_ahead": self.peak_ahead,
            "max_inflight": self.max_inflight,
            "ahead_max_inflight": self.ahead_max_inflight,
            "reserve_slots": self.reserve_slots,
            "in_flight": self.gauge.stats(),  # expert loads reading: peak, mean, histogram
            "reads_started_now": self.started["now"],
            "reads_started_ahead": self.started["ahead"],
            "now_waited_place": self.now_waited["place"],  # all read places taken (by `now` reads, given the reserve)
            "now_waited_slot": self.now_waited["slot"],  # every arena slot leased or loading
            "dropped": self.dropped,
            "refused_busy": self.refused,
            "expired_deadline": self.expired,  # `now` loads that got no slot within the deadline
            "starved_s": round(time.monotonic() - self.starved_since, 3) if self.starved_since is not None else 0.0,
        }


def _filter(load: Load, match: Callable[[Waiter], bool]) -> int:
    before = len(load.waiters)
    load.waiters = [w for w in load.waiters if not match(w)]
    return before - len(load.waiters)
