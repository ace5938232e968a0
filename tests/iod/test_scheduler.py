"""The scheduler's rules, driven directly (plain Python: no daemon, no arena memory).

Reads "complete" only when a test says so, so what `pump` starts in one go is exact.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from moestream.iod.host_cache import HostCache
from moestream.iod.scheduler import Load, Scheduler, Waiter


class Rig:
    """A scheduler over a host cache of `slots` slots whose reads wait for `finish`."""

    def __init__(self, slots: int, *, max_inflight: int = 32, reserve_reads: int = 0, reserve_slots: int = 0,
                 ahead_max_age_s: float = 5.0, max_queued: int = 1000):
        self.cache = HostCache(SimpleNamespace(n_slots=slots, slot_bytes=4096))
        self.started: list[Load] = []
        self.dropped: list[tuple[Load, str]] = []
        self.promoted: list[Load] = []
        self.sched = Scheduler(self.cache, self.started.append, max_inflight=max_inflight, max_queued=max_queued,
                               ahead_max_age_s=ahead_max_age_s, on_dropped=lambda ld, why: self.dropped.append((ld, why)),
                               reserve_reads=reserve_reads, reserve_slots=reserve_slots,
                               promote_read=self.promoted.append)

    def fetch(self, keys: list[tuple[int, int]], priority: str = "now", client: bytes = b"c") -> None:
        """What the server does for a `fetch`: join a load of the same key, else queue one; then pump."""
        for key in keys:
            w = Waiter(client, 1, key, 0.0)
            load = self.sched.find(key)
            if load is not None:
                self.sched.join(load, w, priority)
            else:
                assert self.sched.enqueue(w, priority)
        self.sched.pump()

    def finish(self, load: Load, *, lease: bool = False) -> None:
        """The read landed; the waiters lease the slot (held) or not (it stays cached, unpinned)."""
        self.sched.finished(load)
        self.cache.finish_load(load.slot, {"gate": (0, 1)})
        if lease:
            self.cache.lease(load.slot)
        self.cache.unpin_load(load.slot)
        self.sched.pump()

    def reading(self, priority: str | None = None) -> int:
        return sum(1 for ld in self.sched.reading.values() if priority in (None, ld.started_as))


def keys(n: int, layer: int = 0) -> list[tuple[int, int]]:
    return [(layer, e) for e in range(n)]


@pytest.mark.parametrize("slots,expect", [(64, 32), (20, 20)])
def test_a_batch_starts_min_of_depth_and_free_slots_at_once(slots, expect):
    rig = Rig(slots)
    rig.fetch(keys(40))
    assert len(rig.started) == rig.reading() == expect  # one pump, no waves
    assert rig.sched.stats()["in_flight"]["peak"] == expect
    rig.finish(rig.started[0])
    assert rig.reading() == expect  # each completion starts the next queued load right away
    assert len(rig.started) == expect + 1


def test_ahead_keeps_reserved_read_places_free_for_now():
    rig = Rig(64, max_inflight=32, reserve_reads=8)
    rig.fetch(keys(40), "ahead")
    assert rig.reading("ahead") == 24 == rig.sched.ahead_max_inflight
    rig.fetch(keys(10, layer=1), "now")
    assert rig.reading("now") == 8 and rig.reading() == 32  # demand starts at once, in the reserve
    assert rig.sched.stats()["now_waited_place"] == 1  # the 9th waits, behind `now` reads only
    rig.finish(next(ld for ld in rig.started if ld.started_as == "ahead"))
    assert rig.started[-1].key == (1, 8)  # a freed place goes to the queued `now`, not to the next prefetch
    assert rig.sched.peak_ahead == 24


def test_ahead_gets_at_least_one_place():
    rig = Rig(8, max_inflight=1, reserve_reads=1)
    rig.fetch(keys(2), "ahead")
    assert rig.reading("ahead") == 1


def test_ahead_leaves_reserved_slots_free():
    rig = Rig(8, reserve_slots=2)
    rig.fetch(keys(8), "ahead")
    assert rig.reading("ahead") == 6 and rig.cache.free_slots() == 2  # 2 prefetches wait
    for ld in list(rig.started):
        rig.finish(ld, lease=True)  # the prefetching client holds its leases
    assert rig.reading() == 0 and rig.cache.free_slots() == 2
    rig.fetch(keys(2, layer=1), "now")
    assert rig.reading("now") == 2  # demand gets the reserved slots at once
    assert rig.sched.stats()["now_waited_slot"] == 0
    assert rig.sched.stats()["queued_ahead"] == 2


def test_cached_unleased_slots_count_as_free_for_ahead():
    rig = Rig(4, reserve_slots=1)
    rig.fetch(keys(3), "ahead")
    for ld in list(rig.started):
        rig.finish(ld)  # nobody leases them: cached, evictable
    rig.fetch(keys(3, layer=1), "ahead")
    assert rig.reading("ahead") == 3  # evicting cached prefetches is fine; only pins count


def test_now_joining_queued_ahead_promotes_it_and_stale_drop_spares_it():
    rig = Rig(1, ahead_max_age_s=1.0)
    rig.fetch([(0, 0)], "now")  # takes the only slot
    rig.fetch([(0, 1), (0, 2)], "ahead")
    rig.fetch([(0, 1)], "now")  # joins the queued prefetch
    load = rig.sched.find((0, 1))
    assert load.priority == "now" and (0, 1) in rig.sched.queues["now"]
    rig.sched.drop_stale(time.monotonic() + 2)  # every prefetch queued is now stale
    assert [ld.key for ld, _ in rig.dropped] == [(0, 2)]  # the plain prefetch goes, the joined one stays
    assert rig.sched.find((0, 1)) is load and len(load.waiters) == 2
    rig.finish(rig.started[0])
    assert rig.started[-1].key == (0, 1) and rig.started[-1].started_as == "now"


def test_queue_full_drops_a_plain_prefetch_not_a_joined_one():
    rig = Rig(1, max_queued=2)
    rig.fetch([(0, 0)], "now")
    rig.fetch([(0, 1), (0, 2)], "ahead")
    rig.fetch([(0, 1)], "now")
    rig.fetch([(0, 3)], "now")  # queue full: the victim is the oldest plain prefetch
    assert [ld.key for ld, _ in rig.dropped] == [(0, 2)]


def test_now_joining_a_running_prefetch_promotes_its_read():
    rig = Rig(8)
    rig.fetch([(0, 0)], "ahead")
    load = rig.started[0]
    rig.fetch([(0, 0)], "now")
    assert rig.promoted == [load] and load.priority == "now"
    assert rig.reading("ahead") == 1  # it still holds the prefetch place it started under
    rig.finish(load)
    assert rig.reading() == 0 and rig.sched.reading_as == {"now": 0, "ahead": 0}


def test_ahead_never_jumps_queued_now_while_slots_are_short():
    rig = Rig(2, reserve_slots=0)
    rig.fetch(keys(2), "now")
    for ld in list(rig.started):
        rig.finish(ld, lease=True)  # arena full of leases
    rig.fetch([(1, 0)], "ahead")
    rig.fetch([(1, 1)], "now")
    assert rig.reading() == 0 and rig.sched.stats()["now_waited_slot"] == 1
    rig.cache.release(rig.started[0].slot, rig.cache.slots[rig.started[0].slot].generation)
    rig.sched.pump()
    assert rig.started[-1].key == (1, 1)


def test_starved_now_loads_expire_after_the_deadline_counted_from_the_starvation():
    """`now` loads that found every slot leased expire once they waited the deadline with no slot
    free; the clock starts when the starvation starts (not when the load was queued), and a slot
    that frees up resets it."""
    rig = Rig(1)
    rig.fetch([(0, 0)])
    rig.finish(rig.started[0], lease=True)  # the only slot is leased
    rig.fetch([(0, 1), (0, 2)])
    t0 = rig.sched.starved_since
    assert t0 is not None and rig.sched.expire_starved(1.0, t0 + 0.5) == []
    expired = rig.sched.expire_starved(1.0, t0 + 1.0)
    assert [(ld.key, round(w, 3)) for ld, w in expired] == [((0, 1), 1.0), ((0, 2), 1.0)]
    assert rig.sched.queued() == 0 and rig.sched.stats()["expired_deadline"] == 2
    rig.fetch([(0, 3)])  # queued after: its own wait counts from its queueing
    assert rig.sched.expire_starved(1.0, time.monotonic() + 0.5) == []
    rig.cache.release(rig.started[0].slot, rig.cache.slots[rig.started[0].slot].generation)
    rig.sched.pump()  # the slot is free again: (0, 3) starts and the starvation is over
    assert rig.started[-1].key == (0, 3) and rig.sched.starved_since is None
