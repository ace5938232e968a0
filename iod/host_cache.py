"""The host cache tier: which expert lives in which arena slot, and who leases it.

Slots are chosen by `common.policy.SlotPolicy` (hotness-decayed LFU, or LRU while a shadow LRU
hits more: `adaptive`; pins). A slot is pinned
in the policy while it is being read (one pin) and once per outstanding lease, so a leased
or loading slot is never chosen for eviction and its bytes never change under a reader.
Each (re)load of a slot bumps its generation: a lease names (slot, generation), so a stale
release can never unpin someone else's data.

It also keeps the arena's `Directory` (when the arena has one) in step: a slot is marked as being
written before a load may overwrite it and published once its bytes are complete, so decoders
can compute an expert that is already here without a lease (`common.arena.Directory`).

Runs on the daemon's event loop only (no locks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from moestream.common.arena import Arena
from moestream.common.policy import CacheFull, SlotPolicy

Key = tuple[int, int]  # (layer, expert)
PartNames = Callable[[int, int], list[str]]  # (layer, expert) -> its part names, in the layout's order


@dataclass
class SlotInfo:
    key: Key | None = None
    generation: int = 0
    ready: bool = False  # bytes complete for `key` at `generation`
    parts: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (offset in slot, nbytes)
    nbytes: int = 0  # blob bytes (sum of parts)
    leases: int = 0


class HostCache:
    def __init__(self, arena: Arena, decay: float = 0.9, n_expert: int = 0, part_names: PartNames | None = None):
        """`n_expert` and `part_names` (a key's part names, in the layout's order) are what the
        arena's directory needs to publish a slot; without a directory they are unused."""
        self.arena = arena
        self.policy = SlotPolicy(arena.n_slots, decay, adaptive=True)
        self.slots = [SlotInfo() for _ in range(arena.n_slots)]
        self.directory = getattr(arena, "directory", None)
        self.n_expert, self.part_names = n_expert, part_names
        if self.directory is not None and (n_expert < 1 or part_names is None):
            raise ValueError("an arena with a directory needs the model's n_expert and part names")

    def _index(self, key: Key) -> int:
        return key[0] * self.n_expert + key[1]

    def lookup_ready(self, key: Key) -> int | None:
        """The slot holding `key` complete (counted as a policy access), else None."""
        slot = self.policy.slot_of(key)
        if slot is None or not self.slots[slot].ready:
            return None
        self.policy.touch(key)
        return slot

    def begin_load(self, key: Key) -> int | None:
        """A pinned slot to read `key` into (evicting an unleased one), or None if all are pinned."""
        try:
            slot, _evicted = self.policy.insert(key, pin=True)
        except CacheFull:
            return None
        info = self.slots[slot]
        assert info.leases == 0, "policy evicted a leased slot"
        evicted = info.key
        info.key, info.ready, info.parts, info.nbytes = key, False, {}, 0
        info.generation += 1
        if self.directory is not None:
            self.directory.loading(slot, info.generation, None if evicted is None else self._index(evicted))
        return slot

    def finish_load(self, slot: int, parts: dict[str, tuple[int, int]]) -> None:
        """The read landed: the slot serves `parts`; the caller leases it, then calls `unpin_load`."""
        info = self.slots[slot]
        info.ready, info.parts = True, parts
        info.nbytes = sum(n for _, n in parts.values())
        if self.directory is not None:
            offsets = [parts[name][0] for name in self.part_names(*info.key)]
            self.directory.ready(slot, info.generation, self._index(info.key), offsets)

    def unpin_load(self, slot: int) -> None:
        key = self.slots[slot].key
        self.policy.unpin(key)

    def abort_load(self, slot: int) -> None:
        """The read failed: forget the key so the next request tries again."""
        info = self.slots[slot]
        self.policy.remove(info.key)
        info.key, info.ready, info.parts, info.nbytes = None, False, {}, 0

    def touch(self, key: Key, count: int = 1) -> bool:
        """A decoder computed `key` straight from the arena `count` times (lease-free hits): count
        them as accesses, as leased hits are. False when the key is not here (evicted since)."""
        slot = self.policy.slot_of(key)
        if slot is None or not self.slots[slot].ready:
            return False
        self.policy.touch(key, count)
        return True

    def credit(self, key: Key, count: int) -> None:
        """`count` more uses of `key` for the policy's frequency, resident or not (a step's rows
        beyond its one request: `SlotPolicy.credit`)."""
        self.policy.credit(key, count)

    def lease(self, slot: int) -> int:
        """Pin a ready slot for one client lease; returns its generation."""
        info = self.slots[slot]
        assert info.ready and info.key is not None
        self.policy.pin(info.key)
        info.leases += 1
        return info.generation

    def release(self, slot: int, generation: int) -> None:
        """Undo one `lease` (the caller checked the client held it)."""
        info = self.slots[slot]
        assert info.leases > 0 and info.generation == generation
        info.leases -= 1
        self.policy.unpin(info.key)

    def free_slots(self) -> int:
        """Slots a load could take now: empty or holding an unleased, ready expert (not pinned)."""
        return self.arena.n_slots - self.policy.pinned

    def step(self) -> None:
        self.policy.step()

    def stats(self) -> dict:
        ready = sum(1 for s in self.slots if s.ready)
        return {
            "n_slots": self.arena.n_slots,
            "slot_bytes": self.arena.slot_bytes,
            "arena_bytes": self.arena.n_slots * self.arena.slot_bytes,
            "resident": ready,
            "loading": len(self.policy) - ready,
            "leased_slots": sum(1 for s in self.slots if s.leases),
            "leases": sum(s.leases for s in self.slots),
            "free_slots": self.free_slots(),
            "evicts_as": self.policy.stats()["follows"],  # "lfu" | "lru": which shadow hits more now
        }
