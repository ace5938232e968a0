"""The prefetch book, `AheadPrefetches`: the `fetch ahead` bookkeeping of a streamed backend,
with its own state, counters and methods. Both streamed backends own one: the device slot cache
(`StreamedExperts.ahead`, eager or lazy landing) and the CPU arena (`ArenaExperts.prefetches`,
lazy: a landed prefetch is a lease held until its layer; without `join_late`, one still in flight
when its layer runs is cancelled and fetched `now`, so it cannot queue behind other prefetches).

Flow, per forward pass:
1. `send(predictions)`, or `defer(predictions)` until the next layer's demand fetch is out
   (the source then calls `flush_deferred`): one `fetch ahead` for the predicted experts not
   resident, one future per (layer, expert). Eager landing claims a slot now (and a hold pin)
   and hands the future to the receiver thread; lazy landing claims nothing.
2. `take(layer, present, missing)` when the layer is acquired: judges each of its prefetches
   (hidden, late, wasted or cancelled), drops their hold pins, gives up the unused ones
   (cancel what is in flight, hand back leases that came) and returns the used ones' futures,
   which the source joins instead of fetching them again.
3. `end_step()` gives up the prefetches of layers never acquired; `drop_all()` at close.

`score(layer, wanted)` compares a layer's last prediction with its real routing.

Pins (eager landing): a slot claimed for a prefetch holds an in-flight pin (the receiver drops
it once the bytes are in) and a hold pin owned here (dropped when its layer is taken, or by
`release_holds` when a demand miss finds every slot pinned), so that a later prediction cannot
evict it first.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Collection, Mapping, Sequence

from ...common.client import IodClient
from .prefetch import Receiver
from .slot_book import BookEntry
from .gpu.slot_cache import DeviceSlotCache, Key
from .stats import AheadCounters



class AheadPrefetches:
    """Prefetch requests of one expert source: sending, judging and giving them up."""

    def __init__(self, client: IodClient, cache: DeviceSlotCache | None = None, receiver: Receiver | None = None,
                 landing: str = "lazy", reserve: int = 0, max_in_flight: int | None = None, join_late: bool = True):
        if landing == "eager" and (cache is None or receiver is None):
            raise ValueError("eager landing needs a slot cache and a receiver")
        self.client, self.cache, self.receiver = client, cache, receiver  # (no cache: nothing is resident here)
        self.landing, self.join_late = landing, join_late
        self.reserve = reserve  # slots an eager prefetch leaves free for demand misses
        self.max_in_flight = max_in_flight  # prefetches not yet taken (each may hold a lease): the daemon's quota
        self._futures: dict[int, dict[int, cf.Future]] = {}  # layer -> expert -> prefetch future
        self._deferred: dict[int, set[int]] = {}  # predictions waiting for the next demand fetch
        self._holds: set[Key] = set()  # prefetched keys whose hold pin is still held
        self._predicted: dict[int, set[int]] = {}  # layer -> its last prediction, until scored
        self.counts = AheadCounters()

    @property
    def has_deferred(self) -> bool:
        return bool(self._deferred)

    # -- sending ---------------------------------------------------------------------------
    def send(self, predictions: Mapping[int, Sequence[int]], priority: str = "ahead") -> None:
        """One `fetch ahead` (or `cached`: leased only if the arena holds it, never read) for the
        predicted experts not resident nor requested yet."""
        keys = self._new_keys(predictions, scored=priority == "ahead")
        if keys:
            self._request(keys, priority)

    def defer(self, predictions: Mapping[int, Sequence[int]]) -> None:
        """Keep predictions until `flush_deferred`, so that they neither evict what the next
        layer is about to use nor delay its misses at the daemon."""
        for layer, experts in predictions.items():
            self._deferred.setdefault(layer, set()).update(int(e) for e in experts)

    def flush_deferred(self) -> None:
        if self._deferred:
            deferred, self._deferred = self._deferred, {}
            self.send({layer: sorted(es) for layer, es in deferred.items()})

    def _new_keys(self, predictions: Mapping[int, Sequence[int]], scored: bool = True) -> list[Key]:
        """Remember the predictions (`scored`); the keys to request (eager: each with a claimed slot)."""
        keys: list[Key] = []
        eager = self.landing == "eager"
        room = self.cache.n_slots - self.reserve - self.cache.pinned() if eager else 0
        outstanding = sum(len(mine) for mine in self._futures.values())
        leases = self.max_in_flight - outstanding if self.max_in_flight is not None else None
        for layer, experts in predictions.items():
            guessed = {int(e) for e in experts}
            if scored:
                self._predicted[layer] = guessed
            mine = self._futures.get(layer, {})
            for e in sorted(guessed):
                key = (layer, e)
                if e in mine or (self.cache is not None and key in self.cache):
                    continue
                if leases is not None and len(keys) >= leases:
                    self.counts.prefetch_dropped += 1
                    continue
                if eager:  # lazy: no slot yet, a wrong guess evicts nothing
                    if room <= 0 or not self._claim_held(key):
                        self.counts.prefetch_dropped += 1
                        continue
                    room -= 1
                keys.append(key)
        return keys

    def _claim_held(self, key: Key) -> bool:
        """A slot for an eager prefetch: claim's pin is the in-flight one, plus the hold pin."""
        if self.cache.claim(key, "fill") is None:  # the receiver drops the fill pin once the bytes are in
            return False
        self.cache.pin(key, "hold")
        self._holds.add(key)
        return True

    def _request(self, keys: list[Key], priority: str = "ahead") -> None:
        try:
            futures = self.client.fetch(keys, priority)
        except BaseException:
            for key in keys:
                self._holds.discard(key)
                self.cache.abort(key)
            raise
        for key, fut in zip(keys, futures):
            self._futures.setdefault(key[0], {})[key[1]] = fut
            if self.landing == "eager":
                self.receiver.submit(key, fut)
        if priority == "ahead":
            self.counts.prefetch_sent += len(keys)
        else:
            self.counts.sent_if_cached += len(keys)

    # -- judging ---------------------------------------------------------------------------
    def score(self, layer: int, wanted: Collection[int]) -> None:
        """Count how much of `layer`'s last prediction its real routing `wanted` confirms."""
        predicted = self._predicted.pop(layer, None)
        if predicted is not None:
            self.counts.predicted += len(predicted)
            self.counts.predicted_right += len(predicted.intersection(wanted))
            self.counts.routed += len(wanted)

    def take(self, layer: int, present: Mapping[int, BookEntry], missing: Collection[int]) -> dict[int, cf.Future]:
        """`layer` is acquired: its prefetches of `present` experts (landed eagerly, READY in
        time or late) and, with lazy landing, of `missing` ones (to be joined) are used; the
        rest are given up. Drops their hold pins; returns the used ones' futures."""
        futures = self._futures.pop(layer, None)
        if not futures:
            return {}
        joinable = self.landing == "lazy"
        used, unused, late = {}, [], []
        for e, fut in futures.items():
            if not self.join_late and e in missing and (not fut.done() or fut.cancelled()):
                late.append(fut)  # cancelled: fetched `now`, it cannot queue behind other prefetches
                self.counts.useful += 1
                self.counts.late += 1
                continue
            if not self.join_late and e in missing and fut.exception() is not None:
                self.counts.not_cached += 1  # refused or dropped: fetched `now`
                continue
            in_time = _in_time(present.get(e), fut, joinable and e in missing)
            if in_time is None:
                unused.append(fut)
            else:
                self.counts.useful += 1
                if in_time:
                    self.counts.hidden += 1
                else:
                    self.counts.late += 1
                used[e] = fut
            self._drop_hold((layer, e))
        if unused or late:
            self._give_up(unused)
            self._give_up(late, count=False)
        return used

    def _drop_hold(self, key: Key) -> None:
        if self.cache is not None and key in self._holds:
            self._holds.discard(key)
            self.cache.unpin(key, "hold")

    def end_step(self) -> None:
        """A new forward pass: give up the prefetches of layers never acquired (and their
        hold pins), forget the deferred predictions."""
        for layer in list(self._futures):
            self.take(layer, {}, ())
        self._deferred.clear()

    # -- giving up -------------------------------------------------------------------------
    def hand_back_recalled(self) -> None:
        """Lazy landing keeps landed prefetches' leases until their layer: give back those the
        daemon recalled (another peer needs the room); they are fetched `now` if used."""
        recalled = self.client.take_recalled()
        if not recalled or self.landing != "lazy":
            return
        for mine in self._futures.values():
            back = [e for e, f in mine.items() if f.done() and not f.cancelled() and f.exception() is None
                    and (f.result().slot, f.result().generation) in recalled]
            self.counts.recalled += len(back)
            self._give_up([mine.pop(e) for e in back], count=False)

    def release_holds(self) -> None:
        """Give up every hold pin (the cache is full of pins and a demand miss needs a slot)."""
        if self.cache is None:
            return
        for key in sorted(self._holds):
            self.cache.unpin(key, "hold")
        self._holds.clear()

    def drop_all(self) -> None:
        """Give up every prefetch and hold pin (the source closes)."""
        futures = [f for mine in self._futures.values() for f in mine.values()]
        self._futures.clear()
        self._deferred.clear()
        self.release_holds()
        self._give_up(futures)

    def wait_answered(self, timeout: float) -> bool:
        """Block until every prefetch in flight has its answer (a lease or an error)."""
        _, not_done = cf.wait([f for mine in self._futures.values() for f in mine.values()], timeout)
        return not not_done

    def _give_up(self, futures: list[cf.Future], count: bool = True) -> None:
        """Cancel those in flight (one message) and hand back the leases that came (lazy
        landing; with eager landing the receiver lands them and the slot stays cached);
        `count` them cancelled or wasted."""
        if not futures:
            return
        self.client.cancel([f for f in futures if not f.done()])  # a lease arriving later goes back
        back = []
        for fut in futures:
            if fut.cancelled():
                self.counts.cancelled += count
                continue
            self.counts.wasted += count
            if self.landing == "lazy" and fut.exception() is None:
                back.append(fut.result())
        self.client.release_many(back)


def _in_time(entry: BookEntry | None, fut: cf.Future, joined: bool) -> bool | None:
    """A used prefetch landed in time: its eagerly landed entry is READY, or the lease it joins
    is in. None: not used."""
    if entry is not None:
        return entry.ready
    return fut.done() if joined else None
