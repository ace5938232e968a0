"""The slot cache policy shared by the daemon's host tier and the decoder's device slot cache.

Pure Python, no I/O: the caller owns the slots' bytes, this module only decides which key
lives in which slot and which key to give up when a new one needs room.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

__all__ = ["CacheFull", "SlotPolicy"]


class CacheFull(RuntimeError):
    """Every resident entry is pinned, so no slot can be freed for a new key."""


class _Entry:
    __slots__ = ("slot", "stored", "last", "pins", "token")

    def __init__(self, slot: int, stored: float, last: int, token: int) -> None:
        self.slot = slot
        self.stored = stored  # score * scale at the time of reading (see SlotPolicy)
        self.last = last  # access clock of the last access: the LRU tiebreak
        self.pins = 0
        self.token = token  # matches the one valid heap item of an unpinned entry


class _Duel:
    """Which of two shadow caches of the same capacity, pure LRU and the decayed LFU, has hit more
    of the recent accesses (keys only, no slots): an `adaptive` policy evicts as the leader would.
    Neither wins everywhere: with room for about one token's experts, LRU keeps the last token's
    picks for the next (consecutive tokens share experts), and on a Qwen3.5-397B-curve trace hits
    0.58 against the LFU's 0.49; with room for less than a token, LRU cycles everything out (hit
    rate 0) while the LFU keeps the hot experts (0.15-0.27). Set dueling, as CPU caches choose an
    insertion policy: the advantage forgets with a horizon of two cache turnovers, so the policy
    follows a workload that changes. The real cache's pins hold in both shadows too (a shadow that
    could evict what the real one cannot would judge another game)."""

    def __init__(self, capacity: int, decay: float) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[Hashable, None] = OrderedDict()
        self.lfu = SlotPolicy(capacity, decay)
        self.pinned: set[Hashable] = set()  # keys the real cache has pinned
        self.lead = 0.0  # > 0: LRU has hit more lately
        self.keep = 1.0 - 1.0 / (2 * capacity)

    def access(self, key: Hashable, count: int) -> None:
        lru_hit = key in self.lru
        if lru_hit:
            self.lru.move_to_end(key)
        else:
            self.lru[key] = None
            if len(self.lru) > self.capacity:
                victim = next((k for k in self.lru if k not in self.pinned), None)
                if victim is not None:
                    del self.lru[victim]
        lfu_hit = self.lfu.slot_of(key) is not None
        if lfu_hit:
            self.lfu.touch(key, count)
        elif self.lfu.try_insert(key, pin=key in self.pinned) is not None and count > 1:
            self.lfu.touch(key, count - 1)
        self.lead = self.lead * self.keep + (lru_hit - lfu_hit)

    def pin(self, key: Hashable) -> None:
        """The real cache pinned `key` (its first pin)."""
        self.pinned.add(key)
        if key in self.lfu and not self.lfu.pin_count(key):
            self.lfu.pin(key)

    def unpin(self, key: Hashable) -> None:
        """The real cache's last pin of `key` went (unpinned, or the key removed)."""
        self.pinned.discard(key)
        if key in self.lfu and self.lfu.pin_count(key):
            self.lfu.unpin(key)

    @property
    def follows(self) -> str:
        return "lru" if self.lead > 0 else "lfu"


class SlotPolicy:
    """Fixed-capacity `key -> slot` map with hotness-decayed LFU eviction.

    Policy:
    - Each access (`lookup` hit, `insert`, `touch`) adds 1 to the key's score; each `step()`
      multiplies every score by `decay` (0 < decay <= 1; 1 is plain LFU, a tiny decay is
      close to LRU). Scores belong to keys, not slots: an evicted or removed key keeps its
      score and resumes it when inserted again (else a hot key, once evicted, would lose to
      every newcomer). Forgotten scores are dropped once they decay below `FORGET_BELOW`,
      so memory is bounded by the keys seen recently (with decay 1: all keys ever seen).
    - The eviction victim is the unpinned entry with the lowest current score; ties go to
      the least recently accessed entry.
    - Pins are counted (pin twice, unpin twice). A pinned entry (in flight, or selected for
      the current step) is never evicted. When a new key needs a slot and every resident
      entry is pinned, `insert` raises `CacheFull` and `try_insert` returns None: the cache
      never overcommits.

    - `adaptive=True` evicts the least recently used unpinned entry instead while a shadow LRU
      has been hitting more than a shadow of this LFU (`_Duel`): the daemon's arena, whose size
      relative to a token's experts decides which of the two wins.

    Cost: decay is lazy, so `step()` is O(1) amortized. Scores are stored multiplied by
    `scale = decay ** -t` (t = steps since the last renormalization), so an access adds
    `scale` and the current score is `stored / scale`. Decay multiplies every score by the
    same factor, so the order of stored scores is the eviction order and a heap keyed by
    `(stored, last access)` finds the victim. Heap items go stale when an entry changes
    (lazy invalidation through a token); the heap is rebuilt when stale items outnumber
    live ones, and stored scores are renormalized (and faded history dropped) when `scale`
    exceeds `RENORM_AT`: O(n) once every log(RENORM_AT) / log(1/decay) steps (658 steps at
    decay 0.9). Every other operation is O(log n) amortized. Not thread-safe: the owner
    serializes calls.
    """

    RENORM_AT = 2.0**100  # far from float overflow even after ~2**900 accesses
    FORGET_BELOW = 1e-4  # history scores at or below this carry no useful information

    def __init__(self, capacity: int, decay: float = 0.9, *, adaptive: bool = False) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"SlotPolicy capacity must be an int >= 1, got {capacity!r}")
        if not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
            raise ValueError(f"SlotPolicy decay must be in (0, 1], got {decay!r}")
        self.capacity = capacity
        self.decay = float(decay)
        self._entries: dict[Hashable, _Entry] = {}
        self._history: dict[Hashable, float] = {}  # stored scores of keys not resident
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first
        self._heap: list[tuple[float, int, int, Hashable]] = []
        self._t = 0  # steps since the last renormalization
        self._scale = 1.0
        self._clock = 0  # access counter, for LRU
        self._seq = 0  # token counter, unique over the policy's life
        self._pinned = 0  # entries with pins > 0
        self.hits = self.misses = self.evictions = self.inserts = self.removes = 0
        self.steps = 0
        self._duel = _Duel(capacity, decay) if adaptive else None
        self._recent: OrderedDict[Hashable, None] = OrderedDict()  # resident keys, least recent first (adaptive)

    # -- queries without side effects ------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    @property
    def pinned(self) -> int:
        """Entries holding at least one pin."""
        return self._pinned

    def __len__(self) -> int:
        return len(self._entries)

    def slot_of(self, key: Hashable) -> int | None:
        """The key's slot, or None; unlike `lookup` this is not an access and counts nothing."""
        entry = self._entries.get(key)
        return None if entry is None else entry.slot

    def keys(self) -> list[Hashable]:
        """The resident keys (a copy)."""
        return list(self._entries)

    def score(self, key: Hashable) -> float:
        """The key's current decayed score, resident or not (0.0 for a key never seen)."""
        entry = self._entries.get(key)
        stored = self._history.get(key, 0.0) if entry is None else entry.stored
        return stored / self._scale

    def pin_count(self, key: Hashable) -> int:
        """How many pins the key holds; raises KeyError when it is not resident."""
        return self._get(key).pins

    def victim(self) -> Hashable | None:
        """The key an eviction would take now, or None when every entry is pinned."""
        if self._duel is not None and self._duel.follows == "lru":
            entries = self._entries
            return next((k for k in self._recent if not entries[k].pins), None)
        heap, entries = self._heap, self._entries
        while heap:
            _, _, token, key = heap[0]
            entry = entries.get(key)
            if entry is not None and entry.token == token:
                return key
            heapq.heappop(heap)  # stale: changed, pinned, or gone since it was pushed
        return None

    def stats(self) -> dict[str, Any]:
        lookups = self.hits + self.misses
        return {
            "capacity": self.capacity,
            "resident": len(self._entries),
            "pinned": self._pinned,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / lookups if lookups else 0.0,
            "inserts": self.inserts,
            "evictions": self.evictions,
            "removes": self.removes,
            "steps": self.steps,
            "history": len(self._history),
            **({"follows": self._duel.follows} if self._duel is not None else {}),
        }

    # -- accesses --------------------------------------------------------------------------
    def lookup(self, key: Hashable) -> int | None:
        """The key's slot (counted as a hit and an access), or None (counted as a miss)."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._access(key, entry)
        return entry.slot

    def touch(self, key: Hashable, count: int = 1) -> None:
        """`count` accesses without hit/miss accounting; raises KeyError when not resident."""
        self._access(key, self._get(key), count)

    def credit(self, key: Hashable, count: int) -> None:
        """`count` more uses of `key`, resident or not, without hit/miss accounting: a step's
        rows beyond the one its lookup or insert counted (a prompt's tokens routed to the expert),
        so the frequency an eviction weighs is tokens, not requests. A key not resident keeps
        them in its history and resumes them when inserted."""
        if count < 1:
            return
        entry = self._entries.get(key)
        if entry is None:
            self._history[key] = self._history.get(key, 0.0) + count * self._scale
        else:  # (recency stays the access's: these uses came with it)
            entry.stored += count * self._scale
            if not entry.pins:
                self._push(key, entry)
        if self._duel is not None:  # the LFU shadow weighs the same uses; neither shadow scores a hit
            self._duel.lfu.credit(key, count)

    def insert(self, key: Hashable, *, pin: bool = False) -> tuple[int, Hashable | None]:
        """Give `key` a slot, evicting the victim when the cache is full.

        Returns `(slot, evicted_key or None)`; the caller must drop the evicted key's bytes
        before writing the slot. The insert counts as one access. Raises `CacheFull` when
        the cache is full of pinned entries, ValueError when `key` is already resident.
        """
        if key in self._entries:
            raise ValueError(f"{key!r} is already resident in slot {self._entries[key].slot}")
        evicted = None
        if not self._free:
            evicted = self.victim()
            if evicted is None:
                raise CacheFull(
                    f"all {self.capacity} slots are pinned; cannot insert {key!r}"
                )
            self._forget_slot(evicted)  # (its heap item, if any, is stale now: dropped lazily)
            self.evictions += 1
        entry = _Entry(self._free.pop(), self._history.pop(key, 0.0), 0, 0)
        self._entries[key] = entry
        self.inserts += 1
        if pin:
            entry.pins = 1
            self._pinned += 1
            if self._duel is not None:
                self._duel.pin(key)  # (before the access, which inserts it into the shadows pinned)
        self._access(key, entry)
        return entry.slot, evicted

    def try_insert(self, key: Hashable, *, pin: bool = False) -> tuple[int, Hashable | None] | None:
        """`insert`, but None instead of raising CacheFull."""
        try:
            return self.insert(key, pin=pin)
        except CacheFull:
            return None

    def remove(self, key: Hashable) -> int:
        """Free the key's slot even if pinned (e.g. an aborted read); returns the slot."""
        self._get(key)  # KeyError when not resident
        slot = self._forget_slot(key)
        self.removes += 1
        return slot

    # -- pins and time ---------------------------------------------------------------------
    def pin(self, key: Hashable) -> None:
        """Protect the key from eviction until a matching `unpin`; not an access."""
        entry = self._get(key)
        entry.pins += 1
        if entry.pins == 1:
            self._pinned += 1
            entry.token = self._next_seq()  # invalidates its heap item
            if self._duel is not None:
                self._duel.pin(key)

    def unpin(self, key: Hashable) -> None:
        entry = self._get(key)
        if entry.pins == 0:
            raise ValueError(f"{key!r} is not pinned")
        entry.pins -= 1
        if entry.pins == 0:
            self._pinned -= 1
            self._push(key, entry)
            if self._duel is not None:
                self._duel.unpin(key)

    def step(self) -> None:
        """One decay tick: every score is multiplied by `decay`."""
        self.steps += 1
        if self._duel is not None:
            self._duel.lfu.step()
        if self.decay == 1.0:
            return
        self._t += 1
        self._scale = self.decay ** -self._t  # pow, not repeated products: exact for 2**-n
        if self._scale > self.RENORM_AT:
            self._renormalize()

    # -- internals -------------------------------------------------------------------------
    def _get(self, key: Hashable) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"{key!r} is not resident")
        return entry

    def _forget_slot(self, key: Hashable) -> int:
        entry = self._entries.pop(key)
        self._recent.pop(key, None)
        if entry.pins:
            self._pinned -= 1
            if self._duel is not None:
                self._duel.unpin(key)
        self._free.append(entry.slot)
        self._history[key] = entry.stored
        return entry.slot

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _access(self, key: Hashable, entry: _Entry, count: int = 1) -> None:
        self._clock += 1
        entry.stored += count * self._scale
        entry.last = self._clock
        if self._duel is not None:
            self._recent[key] = None
            self._recent.move_to_end(key)
            self._duel.access(key, count)
        if entry.pins:
            return  # pinned entries are out of the heap; unpin pushes them back
        self._push(key, entry)

    def _push(self, key: Hashable, entry: _Entry) -> None:
        entry.token = self._next_seq()
        heapq.heappush(self._heap, (entry.stored, entry.last, entry.token, key))
        if len(self._heap) > 2 * len(self._entries) + 32:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [
            (e.stored, e.last, e.token, k) for k, e in self._entries.items() if e.pins == 0
        ]
        heapq.heapify(self._heap)

    def _renormalize(self) -> None:
        # Dividing every stored score by one number keeps their order (and exact ties).
        for entry in self._entries.values():
            entry.stored /= self._scale
        self._history = {k: v / self._scale for k, v in self._history.items()
                         if v / self._scale > self.FORGET_BELOW}
        self._t = 0
        self._scale = 1.0
        self._rebuild_heap()
