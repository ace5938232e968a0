"""Streamed experts: the daemon's client behind the `ExpertBackend` interface (`gpu-slots`).

`acquire(layer, experts)` reads as: score the layer's prediction → pin the resident experts
(`pin_present`, one lock) → `ahead.take` the layer's prefetches (used ones come back as
futures to join, the rest are given up) → count the hits (resident, not prefetched) → serve
the ready ones → demand-fetch the missing ones (`_fetch_now`) → wait for the ones in flight
(`_wait`). Each step returns what it pinned or served; `acquire` alone keeps the set of slots
the layer holds (`release` unpins them) and gives them back if a step fails.

Misses get a slot (`claim`), one `fetch now` for all of them through the lease pipeline
(`leases.LeasePipeline`, shared with the other streamed backends: retries, void leases, deadlines),
and each batch of arrivals is copied from the arena into its slots, then its leases go back. When every slot is pinned
an expert is served straight from the arena (`bypass`), so a prefill that routes to more
experts than the cache holds still runs, and the cache never overcommits.

Prefetch landing (`landing`): "eager" claims a slot when the prediction is made and the
receiver thread copies the expert in as soon as its lease arrives (the compute thread takes
the copy over when it needs the expert first); "lazy" claims nothing, keeps the lease in the
arena, and the layer's `acquire` lands it (a wrong guess then costs no slot, no eviction and
no copy). `open_streamed` picks eager on CUDA and lazy elsewhere (`default_landing`).

The prefetch bookkeeping is a composed object, `self.ahead` (`ahead.AheadPrefetches`), with
its own state and counters (`stats.AheadCounters`), which `stats()` nests.

Fused layers (raw slots with the Triton kernels, `cache.fused(layer)`): `mix` learns the
layer's distinct experts with one host sync (the one the host cannot skip: it decides what to
fetch and keeps the policy's counts), `acquire`s them as slot references (nothing
dequantized), sends the layer's expert -> slot map to the device and runs the kernels on the
slots themselves. On CUDA the daemon's arena is registered with CUDA (`register_host`), so a
miss is one async copy arena -> device slot.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from ....common.client import IodClient, IodUnavailable, Lease, LeaseVoided
from ....common.layout import ModelLayout
from ..ahead import AheadPrefetches
from ..leases import LeasePipeline
from ..source import AcquireSource, ExpertWeights
from ..prefetch import Receiver
from ..slot_book import BookEntry
from ..stats import DemandCounters, SlotStats
from .slot_cache import DeviceSlotCache, FetchFailed, Key


class StreamedExperts(AcquireSource):
    """Experts fetched from moestream-iod into a `DeviceSlotCache`."""

    kind = "gpu-slots"

    def __init__(self, client: IodClient, layout: ModelLayout, cache: DeviceSlotCache, *,
                 fetch_timeout_s: float = 60.0, owns_client: bool = False, landing: str = "eager"):
        self.client, self.layout, self.cache = client, layout, cache
        self.expert_act = layout.spec.expert_act  # (the torch path's; the kernels' comes with the cache)
        self.fetch_timeout_s, self._owns_client = fetch_timeout_s, owns_client
        self.landing = landing
        if self.landing not in LANDINGS:
            raise ValueError(f"prefetch landing must be one of {LANDINGS}, got {self.landing!r}")
        self.receiver = Receiver(client, cache)
        top_k = layout.hparams.n_expert_used
        quota = client.lease_quota  # prefetch leases stay under it, leaving a layer's demand room
        self.ahead = AheadPrefetches(client, cache, self.receiver, landing, top_k,
                                     max_in_flight=None if quota is None else max(0, quota - top_k))
        self._bypassed: dict[int, set[int]] = {}  # layer -> experts served without a slot (no pin)
        self._closed = False
        self.counts = DemandCounters()
        self.leases = LeasePipeline(client, self.counts, fetch_timeout_s)
        self._arena: Any = None  # the client's arena mapping as registered with CUDA
        self._register_arena()

    # -- ExpertBackend ----------------------------------------------------------------------
    def begin_step(self) -> None:
        self.cache.step()
        self.ahead.end_step()
        self.leases.begin_step()

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Send `fetch ahead` for predicted experts not resident."""
        self.ahead.send({layer: experts})

    def prefetch_ahead(self, predictions: Mapping[int, Sequence[int]], defer: bool = False,
                       if_cached: Mapping[int, Sequence[int]] | None = None) -> None:
        """`prefetch` for several layers in one message; with `defer` (made before a layer's
        `acquire`) it goes out right after that layer's own demand fetch. `if_cached` is not used:
        a slot cache copies what it is given, so only real predictions are worth a slot."""
        (self.ahead.defer if defer else self.ahead.send)(predictions)

    def mix(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not self.cache.fused(layer):
            return super().mix(layer, x, weights, ids)
        self._register_arena()
        wanted = sorted(set(ids.flatten().tolist()))  # the layer's one host sync: what to pin or fetch
        self.cache.begin_layer()
        refs = self.acquire(layer, wanted)  # expert -> SlotRef (a slot, or a spare row)
        try:
            slot_row = self.cache.slot_row(layer, refs)  # [n_expert] on the device
            return self.cache.kernels.mix(layer, self.cache.blobs, self.cache.spare, slot_row, x, weights, ids)
        finally:
            self.release(layer, wanted)  # on CUDA: an event after the kernels guards the slots' reuse

    def _register_arena(self) -> None:
        """Register the client's arena mapping with CUDA once (again after a reconnect maps a
        new one); without CUDA, raw slots or on failure, copies go through pinned staging."""
        arena = getattr(self.client, "arena", None)
        if arena is None or arena is self._arena or self.cache.device.type != "cuda":
            return
        self._arena = arena
        self.cache.unregister_host()
        self.cache.register_host(arena.whole())

    def acquire(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]:
        wanted = sorted({int(e) for e in experts})
        self.ahead.hand_back_recalled()
        self.ahead.score(layer, wanted)
        present, missing = self.cache.pin_present(layer, wanted)  # one lock for the layer
        used = self.ahead.take(layer, present, missing)
        self.counts.hits += sum(1 for e in present if e not in used)
        held = set(present)  # the experts whose slot this acquire pins, until `release`
        try:
            out, slow = self._ready_hits(layer, present)
            if missing or slow or self.ahead.has_deferred:
                got, slotted = self._fetch_now(layer, missing, {e: used[e] for e in missing if e in used})
                out.update(got)
                held |= slotted
                t0 = time.perf_counter()
                for e in slow:
                    held.discard(e)  # `_wait` owns its pin until it returns
                    out[e], pinned = self._wait(layer, e, used.get(e))
                    if pinned:
                        held.add(e)
                self.counts.stall_s += time.perf_counter() - t0
        except BaseException:
            for e in held:  # nothing is released after a failed acquire
                self.cache.unpin((layer, e))
            raise
        if len(held) < len(wanted):
            self._bypassed.setdefault(layer, set()).update(set(wanted) - held)
        self.counts.acquired += len(wanted)
        return out

    def release(self, layer: int, experts: Sequence[int]) -> None:
        bypassed = self._bypassed.pop(layer, None)
        keep = sorted({int(e) for e in experts})
        if bypassed:
            keep = [e for e in keep if e not in bypassed]
        self.cache.release_many(layer, keep)

    def stats(self) -> SlotStats:
        r = self.receiver
        return SlotStats(demand=replace(self.counts), ahead=replace(self.ahead.counts), cache=self.cache.stats(),
                         landing=self.landing, receiver_bytes=r.bytes,
                         receiver_copy_s=r.copy_s, landed_by_compute=r.stolen)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.ahead.drop_all()
        except Exception:
            pass  # the client may already be gone; the receiver still drains what is left
        self.receiver.close(timeout=5.0)
        self.cache.unregister_host()  # before the client unmaps the arena
        if self._owns_client:
            self.client.close()

    # -- demand internals ------------------------------------------------------------------
    def _ready_hits(self, layer: int, present: Mapping[int, BookEntry]) -> tuple[dict[int, ExpertWeights], list[int]]:
        """The hit path: weights of the present experts whose bytes are in; the others (slow)."""
        out, slow = {}, []
        for e, entry in present.items():
            w = self.cache.ready_weights(layer, entry)
            if w is None:
                slow.append(e)
            else:
                out[e] = w
        return out, slow

    def _claim(self, key: Key) -> bool:
        if self.cache.claim(key) is not None:
            return True
        self.ahead.release_holds()
        return self.cache.claim(key) is not None

    def _fetch_now(self, layer: int, missing: list[int],
                   joined: Mapping[int, cf.Future] | None = None) -> tuple[dict[int, ExpertWeights], set[int]]:
        """Demand-fetch `missing` through the lease pipeline (one `fetch now`; retries, void
        leases): into claimed slots, or bypassing the cache when none is free. Experts in `joined`
        are already requested (a lazy prefetch): land them, never ask twice. Deferred prefetches
        go out right after the demand message, before we wait on it. Returns the weights and the
        experts that got a slot (pinned: the caller's to release); if it fails, nothing it claimed
        stays behind."""
        if not missing:
            self.ahead.flush_deferred()
            return {}, set()
        joined = dict(joined or {})
        slotted = {e for e in missing if self._claim((layer, e))}
        self.counts.bypassed += len(missing) - len(slotted)
        owed = self.leases.request(layer, [e for e in missing if e not in joined], joined)
        self.ahead.flush_deferred()
        out: dict[int, ExpertWeights] = {}
        try:
            for leases in self.leases.arrivals(owed):
                try:
                    for e, lease in leases.items():
                        try:
                            out[e] = self._land(layer, e, lease, e in slotted, prefetched=e in joined)
                        except LeaseVoided:  # the daemon was lost after the lease came: ask the new one
                            self.leases.refetch(owed, e, "voided")
                finally:
                    self.client.release_many(list(leases.values()))
        except BaseException:
            self.leases.give_up(owed)
            for e in sorted(slotted):  # landed ones are pinned, the others still filling
                (self.cache.unpin if e in out else self.cache.abort)((layer, e))
            raise
        return out, slotted

    def _land(self, layer: int, e: int, lease: Lease, slotted: bool, prefetched: bool) -> ExpertWeights:
        """Copy a lease's expert into its claimed slot, or serve it without one (`slotted` false)."""
        if prefetched:  # a lazy prefetch joined here
            self.counts.ahead_bytes += sum(n for _, n in lease.parts.values())
        parts = {name: self.client.part_view(lease, name) for name in lease.parts}
        if not slotted:
            return self.cache.bypass_weights(layer, parts)
        self.cache.write((layer, e), parts)
        self.cache.wait((layer, e))
        return self.cache.weights((layer, e))

    def _wait(self, layer: int, e: int, fut: cf.Future | None) -> tuple[ExpertWeights, bool]:
        """A present expert still in flight: land its prefetch here or wait for the receiver;
        refetch it if that prefetch failed. Owns `e`'s pin while it runs: returns the weights
        and whether `e` is pinned in a slot (a refetch may bypass the cache); unpins if it fails."""
        key = (layer, e)
        try:
            return self._landed(key, fut), True
        except FetchFailed:  # the prefetch failed or was cancelled, its entry gone with its pins
            self.counts.refetched += 1
            got, slotted = self._fetch_now(layer, [e])
            return got[e], bool(slotted)
        except BaseException:
            self.cache.unpin(key)
            raise

    def _landed(self, key: Key, fut: cf.Future | None) -> ExpertWeights:
        """Land `fut` here if its lease is in and the receiver has not started on it (join it,
        never fetch it twice), else wait for the receiver to land it."""
        late = f"prefetched expert {key} not delivered within {self.fetch_timeout_s}s"
        if fut is not None:
            try:
                self.receiver.land_here(key, fut, self.fetch_timeout_s)
            except cf.TimeoutError:
                raise IodUnavailable(late) from None
        if not self.cache.wait(key, self.fetch_timeout_s):
            raise IodUnavailable(late)
        return self.cache.weights(key)


LANDINGS = ("eager", "lazy")


def default_landing(cache: DeviceSlotCache) -> str:
    """Where a prefetched expert goes when its lease arrives: on CUDA, "eager" (the receiver
    thread copies it into a claimed slot on a side stream: cheap and truly off the compute
    path); elsewhere "lazy" (the lease waits in the arena until the layer runs, then the
    compute thread lands it: on a CPU, landing is dequantizing, which would compete with the
    compute for the same cores and the GIL, and a wrong guess would have cost a slot)."""
    return "eager" if cache.device.type == "cuda" else "lazy"


def open_streamed(layout: ModelLayout, endpoint: str, *, device: Any = "cpu", dtype: Any = None,
                  slots: int | None = None, cache_bytes: int | None = None, decay: float = 0.9, timeout_s: float = 5.0, fetch_timeout_s: float = 60.0,
                  name: str | None = None, landing: str | None = None, reconnect_s: float = 30.0,
                  kernels: bool | None = None) -> StreamedExperts:
    """Connect to the daemon at `endpoint` (checking it serves this file) and build the slot cache.

    Capacity: `slots`, or as many slots as `cache_bytes` of device memory holds (one is required).
    `kernels`: the fused Triton kernels on raw slots (None: on CUDA; see `slot_format.slot_kernels`).
    """
    import torch

    from .slot_format import slots_for_bytes

    dtype = dtype or torch.float32
    if (slots is None) == (cache_bytes is None):
        raise ValueError("give exactly one of slots (--slots) or cache_bytes (--cache-bytes)")
    n = slots if slots is not None else slots_for_bytes(layout.experts, cache_bytes)
    cache = DeviceSlotCache(layout.experts, n, device, dtype=dtype, decay=decay, kernels=kernels,
                            act=layout.spec.expert_act)
    client = IodClient(endpoint, expect_fingerprint=layout.fingerprint.as_dict(), timeout_s=timeout_s, name=name,
                       reconnect_s=reconnect_s)
    try:
        return StreamedExperts(client, layout, cache, fetch_timeout_s=fetch_timeout_s, owns_client=True,
                               landing=landing or default_landing(cache))
    except BaseException:
        client.close()
        raise

