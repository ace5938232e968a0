"""The slot cache's bookkeeping: which key holds which slot, in which state, pinned by whom.

Pure: no torch, no locks, no bytes (as nano-vllm's block manager is to its model runner). The
device slot cache (`slot_cache.DeviceSlotCache`) owns the slot memory and the threading and
calls in under its lock; the daemon's host tier has the same shape. Which entry an insert
evicts is `common.policy.SlotPolicy`'s choice (decayed LFU, LRU tiebreak, never a pinned one).

An entry is FILLING (`claim`: its bytes are on their way), then READY (`ready`) or FAILED
(`fail`, even after READY: dropped with every pin). Its pins are counted per named owner, in
one place: the filler of a prefetch (`fill`, until its bytes are in), the prefetch bookkeeping's
hold (`hold`, until its layer runs), a layer computing with it (`layer`, until it is released).
An owner drops only the pins it took.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from enum import Enum
from typing import Any

from ...common.policy import SlotPolicy

OWNERS = ("fill", "hold", "layer")


class SlotState(Enum):
    FILLING = "filling"  # claimed, its bytes on their way: pinned, not readable
    READY = "ready"  # bytes in: readable
    FAILED = "failed"  # the fill failed or the entry was dropped: gone from the book with its pins


class BookEntry:
    """One slot's occupant. `data`: what the storage keeps per entry (the cache's wait event)."""

    __slots__ = ("data", "pins", "slot", "state")

    def __init__(self, slot: int, data: Any = None) -> None:
        self.slot = slot
        self.state = SlotState.FILLING
        self.pins: Counter[str] = Counter()
        self.data = data

    @property
    def ready(self) -> bool:
        return self.state is SlotState.READY


class SlotBook:
    """`key -> BookEntry` over a fixed number of slots (see the module docstring)."""

    def __init__(self, policy: SlotPolicy) -> None:
        self.policy = policy
        self._entries: dict[Hashable, BookEntry] = {}

    # -- queries ---------------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> BookEntry | None:
        return self._entries.get(key)

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    @property
    def pinned(self) -> int:
        """Entries holding at least one pin."""
        return self.policy.pinned

    # -- lifecycle -------------------------------------------------------------------------
    def lookup(self, key: Hashable, owner: str = "layer") -> BookEntry | None:
        """An access: a present key counts a hit and is pinned for `owner`; an absent one a miss."""
        entry = self._entries.get(key)
        if entry is not None:
            self.pin(key, owner)  # pin first: the access then skips a heap push unpin redoes anyway
        self.policy.lookup(key)
        return entry

    def claim(self, key: Hashable, owner: str, data: Any = None) -> BookEntry | None:
        """A slot for `key`, FILLING and pinned for `owner` (the evicted entry, if any, is gone);
        None when every slot is pinned (the caller waits or bypasses: never an overcommit)."""
        if key in self._entries:
            raise ValueError(f"{key!r} already has slot {self._entries[key].slot}")
        _check_owner(owner)
        got = self.policy.try_insert(key, pin=True)
        if got is None:
            return None
        slot, evicted = got
        if evicted is not None:
            del self._entries[evicted]
        entry = self._entries[key] = BookEntry(slot, data)
        entry.pins[owner] += 1
        return entry

    def ready(self, key: Hashable, entry: BookEntry | None = None) -> BookEntry | None:
        """The fill of `key` is done: READY. None when it failed meanwhile (or, given the `entry`
        that was filled, when the key has been claimed again since)."""
        got = self._entries.get(key)
        if entry is not None and got is not entry:
            return None
        entry = got
        if entry is None or entry.state is not SlotState.FILLING:
            return None
        entry.state = SlotState.READY
        return entry

    def fail(self, key: Hashable) -> BookEntry | None:
        """Drop `key` whatever its pins (its fill failed, or it must go): the entry, now FAILED."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.policy.remove(key)
        entry.state = SlotState.FAILED
        entry.pins.clear()
        return entry

    # -- pins ------------------------------------------------------------------------------
    def pin(self, key: Hashable, owner: str) -> None:
        _check_owner(owner)
        entry = self._entries[key]
        self.policy.pin(key)
        entry.pins[owner] += 1

    def unpin(self, key: Hashable, owner: str) -> None:
        """Drop one of `owner`'s pins; a key already dropped (`fail`) is ignored."""
        entry = self._entries.get(key)
        if entry is None:
            return
        if entry.pins[owner] <= 0:
            raise ValueError(f"{key!r} holds no {owner!r} pin (pins: {dict(+entry.pins)})")
        entry.pins[owner] -= 1
        self.policy.unpin(key)

    def check(self) -> None:
        """Assert the invariants (tests call it after every operation)."""
        slots = [e.slot for e in self._entries.values()]
        assert len(slots) <= self.policy.capacity, f"{len(slots)} entries > {self.policy.capacity} slots"
        assert len(set(slots)) == len(slots), "two entries share a slot"
        assert set(self.policy.keys()) == set(self._entries), "policy and book disagree"
        for key, e in self._entries.items():
            assert self.policy.slot_of(key) == e.slot
            assert self.policy.pin_count(key) == sum(e.pins.values()), f"{key!r}: pins {dict(e.pins)}"


def _check_owner(owner: str) -> None:
    if owner not in OWNERS:
        raise ValueError(f"pin owner must be one of {OWNERS}, got {owner!r}")
