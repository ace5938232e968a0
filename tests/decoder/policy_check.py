"""A SlotPolicy that checks the cache invariants at every insert (used by the slot-cache tests)."""

from moestream.common.policy import SlotPolicy


class CheckedPolicy(SlotPolicy):
    """At every insert: the victim is unpinned, and the cache stays within capacity."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.checked = self.evicted = 0

    def insert(self, key, *, pin=False):
        victim = self.victim() if len(self) == self.capacity else None
        assert victim is None or self.pin_count(victim) == 0, f"would evict pinned {victim}"
        slot, evicted = super().insert(key, pin=pin)
        assert evicted == victim and len(self) <= self.capacity and 0 <= slot < self.capacity
        self.checked += 1
        self.evicted += evicted is not None
        return slot, evicted
