"""Streamed experts: the daemon's client behind the `ExpertSource` interface.

`acquire(layer, experts)`: hits are served from the device slot cache; misses get a slot
(`claim`), one `fetch now` for all of them, and each expert is copied from the shared-memory
arena into its slot as its `ready` arrives, then the lease goes back. Experts a `prefetch`
already requested are waited for, not fetched again. When every slot is pinned the expert
is served straight from the arena without a slot (`bypass`), so a prefill that routes to
more experts than the cache holds still runs, and the cache never overcommits.

Pins: a slot claimed for a prefetch holds an in-flight pin (the receiver drops it once the
bytes are in) and a hold pin (dropped when its layer is acquired, so a later prediction
cannot evict it first); `acquire` pins what it returns until `release`.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Sequence
from typing import Any

from ..common.client import IodClient, IodUnavailable, Lease
from ..common.layout import ModelLayout
from .experts import ExpertSource, ExpertWeights
from .prefetch import Receiver
from .slot_cache import DeviceSlotCache, FetchFailed, Key


class StreamedExperts(ExpertSource):
    """Experts fetched from moestream-iod into a `DeviceSlotCache`."""

    def __init__(self, client: IodClient, layout: ModelLayout, cache: DeviceSlotCache, *,
                 fetch_timeout_s: float = 60.0, owns_client: bool = False):
        self.client, self.layout, self.cache = client, layout, cache
        self.fetch_timeout_s, self._owns_client = fetch_timeout_s, owns_client
        self.receiver = Receiver(client, cache)
        self.reserve = layout.hparams.n_expert_used  # slots a prefetch leaves for demand misses
        self._ahead: dict[int, dict[int, cf.Future]] = {}  # layer -> expert -> prefetch future
        self._holds: set[Key] = set()  # prefetched keys whose hold pin is still held
        self._predicted: dict[int, set[int]] = {}
        self._bypassed: dict[int, set[int]] = {}  # layer -> experts served without a slot (no pin)
        self._closed = False
        self.c = dict.fromkeys(
            ("acquired", "hits", "misses", "bypassed", "useful", "hidden", "late", "wasted", "cancelled",
             "prefetch_sent", "prefetch_dropped", "refetched", "predicted", "predicted_right", "routed",
             "demand_bytes"), 0)
        self.stall_s = 0.0

    # -- ExpertSource ----------------------------------------------------------------------
    def begin_step(self) -> None:
        self.cache.step()
        for layer in list(self._ahead):  # hold pins of layers never acquired last step
            self._drop_ahead(layer, ())

    def acquire(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]:
        wanted = sorted({int(e) for e in experts})
        self._score_prediction(layer, wanted)
        present, missing, pinned = [], [], []
        for e in wanted:
            if self.cache.lookup_pin((layer, e)):
                present.append(e)
                pinned.append(e)
            else:
                missing.append(e)
        self._count_present(layer, present)
        self._drop_ahead(layer, present)
        try:
            t0 = time.perf_counter()
            out = self._fetch_now(layer, missing, pinned)
            for e in present:
                out[e] = self._wait(layer, e, pinned)
            self.stall_s += time.perf_counter() - t0
        except BaseException:
            for e in pinned:
                self.cache.unpin((layer, e))
            raise
        self.c["acquired"] += len(wanted)
        return out

    def release(self, layer: int, experts: Sequence[int]) -> None:
        bypassed = self._bypassed.pop(layer, set())
        for e in sorted({int(e) for e in experts}):
            if e not in bypassed:
                self.cache.mark_used((layer, e))
                self.cache.unpin((layer, e))

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Send `fetch ahead` for predicted experts not resident; the receiver lands them."""
        self._predicted[layer] = {int(e) for e in experts}
        ahead = self._ahead.setdefault(layer, {})
        keys = []
        for e in sorted(self._predicted[layer]):
            key = (layer, e)
            if e in ahead or key in self.cache:
                continue
            if self.cache.pinned() >= self.cache.n_slots - self.reserve or self.cache.claim(key) is None:
                self.c["prefetch_dropped"] += 1
                continue
            self.cache.pin(key)  # the hold pin; claim's pin is the in-flight one
            self._holds.add(key)
            keys.append(key)
        if not keys:
            return
        try:
            futures = self.client.fetch(keys, "ahead")
        except BaseException:
            for key in keys:
                self._holds.discard(key)
                self.cache.abort(key)
            raise
        for key, fut in zip(keys, futures):
            ahead[key[1]] = fut
            self.receiver.submit(key, fut)
        self.c["prefetch_sent"] += len(keys)

    def stats(self) -> dict[str, Any]:
        c = self.c
        would_miss = c["misses"] + c["useful"]
        out = {"source": "streamed", **c, "stall_s": self.stall_s,
               "hit_rate": c["hits"] / c["acquired"] if c["acquired"] else 0.0,
               "bytes_fetched": c["demand_bytes"] + self.receiver.bytes,
               "prefetch_bytes": self.receiver.bytes,
               "hidden_share": c["hidden"] / would_miss if would_miss else 0.0,
               "prefetch_precision": c["predicted_right"] / c["predicted"] if c["predicted"] else 0.0,
               "prefetch_recall": c["predicted_right"] / c["routed"] if c["routed"] else 0.0,
               "receiver_copy_s": self.receiver.copy_s}
        out["cache"] = self.cache.stats()
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        pending = [f for ahead in self._ahead.values() for f in ahead.values() if not f.done()]
        try:
            self.client.cancel(pending)
        except Exception:
            pass  # the client may already be gone; the receiver still drains what is left
        self.receiver.close(timeout=5.0)
        self._ahead.clear()
        if self._owns_client:
            self.client.close()

    # -- internals -------------------------------------------------------------------------
    def _score_prediction(self, layer: int, wanted: list[int]) -> None:
        predicted = self._predicted.pop(layer, None)
        if predicted is not None:
            self.c["predicted"] += len(predicted)
            self.c["predicted_right"] += len(predicted.intersection(wanted))
            self.c["routed"] += len(wanted)

    def _count_present(self, layer: int, present: list[int]) -> None:
        ahead = self._ahead.get(layer, {})
        for e in present:
            if e not in ahead:
                self.c["hits"] += 1
            elif self.cache.state((layer, e)) == "ready":
                self.c["useful"] += 1
                self.c["hidden"] += 1  # its I/O finished before compute needed it
            else:
                self.c["useful"] += 1
                self.c["late"] += 1  # in flight: partly hidden

    def _drop_ahead(self, layer: int, used: Sequence[int]) -> None:
        """Drop the hold pins of `layer`'s prefetches; judge each: used (counted by
        `_count_present`), or wasted / cancelled (unwanted, or evicted before use)."""
        for e, fut in self._ahead.pop(layer, {}).items():
            if e not in used:
                if not fut.done():
                    self.client.cancel([fut])  # tells the daemon too; the receiver drops the slot
                self.c["cancelled" if fut.cancelled() else "wasted"] += 1
            if (layer, e) in self._holds:
                self._holds.discard((layer, e))
                self.cache.unpin((layer, e))

    def _release_holds(self) -> None:
        """Give up every hold pin (the cache is full of pins and a demand miss needs a slot)."""
        for key in sorted(self._holds):
            self.cache.unpin(key)
        self._holds.clear()

    def _claim(self, key: Key) -> bool:
        if self.cache.claim(key) is not None:
            return True
        self._release_holds()
        return self.cache.claim(key) is not None

    def _fetch_now(self, layer: int, missing: list[int], pinned: list[int]) -> dict[int, ExpertWeights]:
        """Demand-fetch `missing`: into claimed slots, or bypassing the cache when none is free."""
        if not missing:
            return {}
        slotted = {e for e in missing if self._claim((layer, e))}
        pinned += sorted(slotted)
        self._bypassed[layer] = set(missing) - slotted
        self.c["misses"] += len(missing)
        self.c["bypassed"] += len(missing) - len(slotted)
        futures = self.client.fetch([(layer, e) for e in missing], "now")
        out: dict[int, ExpertWeights] = {}
        try:
            for e, fut in zip(missing, futures):
                out[e] = self._land_now(layer, e, fut, e in slotted)
        except BaseException:
            self.client.cancel(futures)
            _release_unused(self.client, futures, len(out))
            for e in slotted:
                if e not in out:
                    self.cache.abort((layer, e))
                    pinned.remove(e)
            raise
        return out

    def _land_now(self, layer: int, e: int, fut: cf.Future, slotted: bool) -> ExpertWeights:
        lease = self._result(fut, (layer, e))
        try:
            parts = {name: self.client.part_view(lease, name) for name in lease.parts}
            self.c["demand_bytes"] += sum(n for _, n in lease.parts.values())
            if not slotted:
                return self.cache.bypass_weights(layer, parts)
            self.cache.write((layer, e), parts)
        finally:
            self.client.release(lease)
        self.cache.wait((layer, e))
        return self.cache.weights((layer, e))

    def _result(self, fut: cf.Future, key: Key) -> Lease:
        try:
            return fut.result(self.fetch_timeout_s)
        except cf.TimeoutError:
            raise IodUnavailable(f"expert {key} not delivered within {self.fetch_timeout_s}s") from None

    def _wait(self, layer: int, e: int, pinned: list[int]) -> ExpertWeights:
        """A present expert: wait for an in-flight prefetch; refetch if that prefetch failed."""
        key = (layer, e)
        try:
            if not self.cache.wait(key, self.fetch_timeout_s):
                raise IodUnavailable(f"prefetched expert {key} not delivered within {self.fetch_timeout_s}s")
            return self.cache.weights(key)
        except FetchFailed:  # the prefetch failed or was cancelled: fetch it now
            pinned.remove(e)  # the failed entry took its pins with it
            self.c["refetched"] += 1
            return self._fetch_now(layer, [e], pinned)[e]


def _release_unused(client: IodClient, futures: list[cf.Future], used: int) -> None:
    """Hand back leases that arrived for a demand fetch we abandoned (the rest were cancelled)."""
    for fut in futures[used:]:
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            try:
                client.release(fut.result())
            except (ValueError, IodUnavailable):
                pass  # already released, or the daemon is gone and leases with it


def open_streamed(layout: ModelLayout, endpoint: str, *, device: Any = "cpu", dtype: Any = None,
                  slots: int | None = None, cache_bytes: int | None = None, slot_format: str | None = None,
                  decay: float = 0.9, timeout_s: float = 5.0, fetch_timeout_s: float = 60.0,
                  name: str | None = None) -> StreamedExperts:
    """Connect to the daemon at `endpoint` (checking it serves this file) and build the slot cache.

    Capacity: `slots`, or as many slots as `cache_bytes` of device memory holds (one is required).
    """
    import torch

    from .slot_cache import default_slot_format, slots_for_bytes

    dtype = dtype or torch.float32
    fmt = slot_format or default_slot_format(device)
    if (slots is None) == (cache_bytes is None):
        raise ValueError("give exactly one of slots (--slots) or cache_bytes (--cache-bytes)")
    n = slots if slots is not None else slots_for_bytes(layout.experts, cache_bytes, fmt, dtype)
    cache = DeviceSlotCache(layout.experts, n, device, slot_format=fmt, dtype=dtype, decay=decay)
    client = IodClient(endpoint, expect_fingerprint=layout.fingerprint.as_dict(), timeout_s=timeout_s, name=name)
    try:
        return StreamedExperts(client, layout, cache, fetch_timeout_s=fetch_timeout_s, owns_client=True)
    except BaseException:
        client.close()
        raise


def describe_stats(st: dict[str, Any]) -> str:
    """Streaming counters for people: hit rate, bytes, stall, prefetch usefulness."""
    cache = st.get("cache", {})
    lines = [
        f"experts: {st['acquired']} used, hit rate {st['hit_rate']:.1%} ({st['hits']} hits, {st['misses']} misses, "
        f"{st['useful']} prefetched), {st['bytes_fetched'] / 2**20:.2f} MiB fetched, stall {st['stall_s'] * 1e3:.1f} ms",
        f"slot cache: {cache.get('resident', 0)}/{cache.get('capacity', 0)} slots ({cache.get('slot_format')}), "
        f"{cache.get('evictions', 0)} evictions, {st['bypassed']} served without a slot (cache full of pins)",
    ]
    if st["prefetch_sent"]:
        lines.append(
            f"prefetch: {st['prefetch_sent']} sent, {st['useful']} useful ({st['hidden']} landed in time, "
            f"{st['late']} late), {st['wasted']} wasted, {st['cancelled']} cancelled; hid {st['hidden_share']:.1%} "
            f"of the misses; predictions precision {st['prefetch_precision']:.1%}, recall {st['prefetch_recall']:.1%}")
    return "\n".join(lines)
