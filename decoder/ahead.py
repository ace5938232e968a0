"""Prefetches seen from the expert source: the `fetch ahead` bookkeeping of `StreamedExperts`.

`AheadPrefetches` is the prefetch half of `StreamedExperts` (a mixin: it uses the source's
`client`, `cache`, `receiver`, `landing`, `reserve` and counters `c`). It sends `fetch ahead`
for predicted experts that are not resident, keeps one future per (layer, expert) in flight
(`_ahead`), holds back predictions made before a layer's own demand fetch (`_deferred`), and
when that layer is acquired judges each prefetch (hidden, late, wasted or cancelled) and gives
up the unused ones (cancel what is in flight, hand back leases that came).

Pins (eager landing): a slot claimed for a prefetch holds an in-flight pin (the receiver drops it once the
bytes are in) and a hold pin (dropped when its layer is acquired, so a later prediction
cannot evict it first); `acquire` pins what it returns until `release`.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Mapping, Sequence
from typing import Any

from .slot_cache import Key


class AheadPrefetches:
    """Mixin for `StreamedExperts`: prefetch requests, their judging and their cancelling."""

    def _init_ahead(self) -> None:
        self._ahead: dict[int, dict[int, cf.Future]] = {}  # layer -> expert -> prefetch future
        self._deferred: dict[int, set[int]] = {}  # predictions waiting for the next acquire
        self._holds: set[Key] = set()  # prefetched keys whose hold pin is still held
        self._predicted: dict[int, set[int]] = {}

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Send `fetch ahead` for predicted experts not resident; the receiver lands them."""
        self.prefetch_ahead({layer: experts})

    def prefetch_ahead(self, predictions: Mapping[int, Sequence[int]], defer: bool = False) -> None:
        """`prefetch` for several layers in one `fetch ahead` message.

        With `defer` (made before a layer's `acquire`), the message waits until that layer's
        own experts are pinned and its demand fetch is sent, so the prefetch neither evicts
        what the layer is about to use nor delays its misses at the daemon."""
        if not defer:
            self._send_ahead(predictions)
            return
        for layer, experts in predictions.items():
            self._deferred.setdefault(layer, set()).update(int(e) for e in experts)

    def _send_ahead(self, predictions: Mapping[int, Sequence[int]]) -> None:
        """Claim slots for the predicted experts not resident and send one `fetch ahead`."""
        keys: list[Key] = []
        eager = self.landing == "eager"
        room = self.cache.n_slots - self.reserve - self.cache.pinned() if eager else 0  # leave slots for misses
        for layer, experts in predictions.items():
            self._predicted[layer] = {int(e) for e in experts}
            ahead = self._ahead.setdefault(layer, {})
            for e in sorted(self._predicted[layer]):
                key = (layer, e)
                if e in ahead or key in self.cache:
                    continue
                if not eager:  # lazy: no slot yet, a wrong guess evicts nothing
                    keys.append(key)
                    continue
                if room <= 0 or self.cache.claim(key) is None:
                    self.c["prefetch_dropped"] += 1
                    continue
                room -= 1
                self.cache.pin(key)  # the hold pin; claim's pin is the in-flight one
                self._holds.add(key)
                keys.append(key)
        if keys:
            self._fetch_ahead(keys)

    def _fetch_ahead(self, keys: list[Key]) -> None:
        try:
            futures = self.client.fetch(keys, "ahead")
        except BaseException:
            for key in keys:
                self._holds.discard(key)
                self.cache.abort(key)
            raise
        for key, fut in zip(keys, futures):
            self._ahead[key[0]][key[1]] = fut
            if self.landing == "eager":
                self.receiver.submit(key, fut)
        self.c["prefetch_sent"] += len(keys)

    def _flush_deferred(self) -> None:
        if self._deferred:
            deferred, self._deferred = self._deferred, {}
            self._send_ahead({layer: sorted(es) for layer, es in deferred.items()})

    def _score_prediction(self, layer: int, wanted: list[int]) -> None:
        predicted = self._predicted.pop(layer, None)
        if predicted is not None:
            self.c["predicted"] += len(predicted)
            self.c["predicted_right"] += len(predicted.intersection(wanted))
            self.c["routed"] += len(wanted)

    def _judge_ahead(self, layer: int, ahead: dict[int, cf.Future], present: Mapping[int, Any],
                     joined: Mapping[int, cf.Future] | None = None) -> None:
        """Judge `layer`'s prefetches as its experts are acquired: used in time (hidden), used
        while in flight (late), or wasted / cancelled; drop their hold pins; count plain hits.
        `present` entries landed eagerly; `joined` futures (lazy) land now, on demand."""
        c, unused = self.c, []
        c["hits"] += sum(1 for e in present if e not in ahead)
        for e, fut in ahead.items():
            entry = present.get(e)
            if entry is not None:
                c["useful"] += 1
                c["hidden" if entry.ready.is_set() and not entry.failed else "late"] += 1
            elif joined and e in joined:
                c["useful"] += 1
                c["hidden" if fut.done() else "late"] += 1
            else:
                unused.append(fut)
            if (layer, e) in self._holds:
                self._holds.discard((layer, e))
                self.cache.unpin((layer, e))
        if unused:
            self._drop_futures(unused)

    def _drop_futures(self, futures: list[cf.Future]) -> None:
        """Give up unused prefetches: cancel those in flight (one message) and hand back the
        leases that came (lazy landing; with eager landing the receiver lands them and the
        slot stays cached); count them cancelled or wasted."""
        self.client.cancel([f for f in futures if not f.done()])  # a lease arriving later goes back
        for fut in futures:
            if fut.cancelled():
                self.c["cancelled"] += 1
                continue
            self.c["wasted"] += 1
            if self.landing == "lazy" and fut.exception() is None:
                self.client.release(fut.result())

    def _release_holds(self) -> None:
        """Give up every hold pin (the cache is full of pins and a demand miss needs a slot)."""
        for key in sorted(self._holds):
            self.cache.unpin(key)
        self._holds.clear()
