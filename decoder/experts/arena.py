"""Streamed experts on CPU: the daemon's shared-memory arena is the expert cache.

A decoder on CPU keeps no expert memory of its own. For each layer, `ArenaExperts.mix`:

1. routes and lists the wanted experts (ascending);
2. joins this layer's prefetches whose lease already came (`AheadPrefetches.take`, the one prefetch book);
3. looks the others up in the arena's directory (`common.arena.Directory`, published by the
   daemon): those the arena holds complete are computed straight from their slots with no
   request and no lease — a hit costs no round trip. Every other wanted expert — including a
   prefetch still in flight, which is cancelled so that it cannot queue behind other
   prefetches — goes out in one `fetch now` message, before the hits are computed;
4. sends the predictions deferred until now (`prefetch_ahead(..., defer=True)`), so they queue
   behind this layer's demand at the daemon, which reads `now` before `ahead`. With a
   directory, predicted experts the arena holds are not asked for at all; without one,
   predictions come in two strengths: `ahead` (read from disk if need be: each token's
   `prefetch_top` best guesses) and `cached` (the rest of the top-k: leased only if the arena
   already holds them, never read);
5. computes the hits (one kernel call), then checks each hit's slot sequence number: a slot the
   daemon began to overwrite meanwhile (another decoder's miss evicted it) is fetched `now` and
   computed again from a lease; the step's hits go to the daemon's decayed LFU in one `touch`
   message at the next step, never waited on;
6. computes the experts whose leases have arrived (one kernel call per batch of arrivals),
   straight from the read-only arena slots (`moe.run_experts`, zero copies), and
   releases those leases at once: the slots stay in the daemon's host tier (decayed LFU,
   shared by every decoder) until evicted;
7. sums the outputs in ascending expert order (`moe.combine_rows`): bit-identical to
   `QuantResidentExperts` on the same file, however the experts came.

A daemon restart voids every lease of the lost connection (the client reconnects and sends
the requests still outstanding again): a void lease, landed before the loss or voided while
its expert was being computed, is fetched again `now` and its output computed anew from the
new daemon's arena, so the result stays bit-identical.

Nothing aborts for lack of room: the daemon queues what the arena cannot hold yet and each
lease goes back as soon as its expert is computed, so a prompt whose layer routes to more
experts than the arena holds is processed in pieces; a prefetch this layer joined that
failed (dropped as stale, refused as busy) is fetched again `now`. Prefetched leases this
decoder holds are capped (`max_in_flight`) so they can never fill the arena, and those the
daemon recalls (another peer needs room) are handed back at the next layer. A `deadline` (the
arena stayed full of others' leases for the daemon's queue deadline) is not fatal either: the
expert is asked for again, until `fetch_timeout_s` of such waits in all (`--stats` says how long
it waited and on whom).

Each wanted expert is in one state at a time: a hit (found in the directory, computed, then
checked), requested (a future), computing (its lease held by this thread), done (its output
kept, lease released) — owned by `mix`'s loop.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from ...common.arena import ArenaView
from ...common.client import IodClient, IodUnavailable, Lease, LeaseVoided
from ...common.layout import ModelLayout
from ..kernels.cpu.ffn import ExpertTable, TableRows
from ..kernels.cpu.moe import ExpertRows, Routed, combine_rows, cpu_inputs, run_experts
from .ahead import AheadPrefetches
from .leases import LeasePipeline, Owed
from .resident import expert_mats
from .source import ExpertBackend, Predictions
from .stats import ArenaCounters, ArenaStats, would_miss



WIDE_MISS_SHARE = 0.5  # wide prefetches while at least this share of the wanted experts would miss


class MissShare:
    """The share of the wanted experts that were not in the arena when asked for (fetched `now`,
    late prefetches included, or prefetched in time), averaged over the last steps (each step's
    share weighs half the one before; 1 before any: a cold arena): what sets the prefetch width.
    A wide prefetch's guesses are not counted as hits, so it cannot talk itself out of being wide.
    Steps weigh alike, not by experts, so a cold prefill of many tokens is forgotten in two or
    three decode steps (weighed by experts, a 22-token prefill kept the sampled peer model wide
    for 8 of 32 steps)."""

    DECAY = 0.5

    def __init__(self) -> None:
        self.share = 1.0
        self._last = (0, 0)

    def step(self, would_miss: int, wanted: int) -> None:
        """The counters' totals so far (their growth since the last call is the last step's)."""
        missed, asked = would_miss - self._last[0], wanted - self._last[1]
        self._last = (would_miss, wanted)
        if asked > 0:
            self.share = self.DECAY * self.share + (1.0 - self.DECAY) * missed / asked


class ArenaExperts(ExpertBackend):
    """Experts computed from leased arena slots of a moestream-iod (see the module docstring)."""

    kind = "cpu-arena"

    def __init__(self, client: IodClient, layout: ModelLayout, *, fetch_timeout_s: float = 60.0,
                 owns_client: bool = False, prefetch_limit: int | None = None):
        self.client, self.layout = client, layout
        self.fetch_timeout_s, self._owns_client = fetch_timeout_s, owns_client
        n_slots = client.arena.n_slots if client.arena is not None else 0
        # within the daemon's lease quota, less a layer's demand (and never over half the shared arena)
        share = min(n_slots // 2, client.lease_quota or n_slots)
        limit = prefetch_limit if prefetch_limit is not None else share - layout.hparams.n_expert_used
        self.prefetches = AheadPrefetches(client, landing="lazy", max_in_flight=max(0, limit), join_late=False)
        self._base: np.ndarray | None = None  # the arena as one array (`_base_of`), re-made after a reconnect
        self._base_arena: ArenaView | None = None
        self._rows: dict[int, TableRows] = {}  # layer -> its experts' table rows over the arena (`_place`)
        # (slot, the layer's part geometry, offsets in the slot) -> that slot's checked table row (`_place`)
        self._slot_rows: dict[tuple, ExpertTable] = {}
        self._geometry: dict[int, tuple] = {}  # layer -> its experts' (part name, type, shape), shared by all
        self._n_expert = layout.experts.n_expert
        self._deferred: list[tuple[Predictions, Predictions]] = []  # sent after the next layer's demand
        self._closed = False
        self.counts = ArenaCounters()
        self.misses = MissShare()
        self.leases = LeasePipeline(client, self.counts, fetch_timeout_s)

    # -- ExpertBackend ----------------------------------------------------------------------
    def begin_step(self) -> None:
        self.misses.step(would_miss(self.counts, self.prefetches.counts), self.counts.acquired)
        self._deferred.clear()
        self.leases.begin_step()
        self.prefetches.end_step()

    def prefetch_ahead(self, predictions: Predictions, defer: bool = False,
                       if_cached: Predictions | None = None) -> None:
        """`predictions` are fetched `ahead` (read if need be); `if_cached` ones only if the arena
        holds them (a lease, no read: a hit then costs this layer no round trip)."""
        if defer:
            self._deferred.append((predictions, if_cached or {}))
        else:
            self._send(predictions, if_cached or {})

    def prefetch_top(self, k: int) -> int:
        """All of each token's guesses but the least likely (k - 1) while most wanted experts are
        not in the arena when asked for (`MissShare`), else its top-1. A wrong guess is a disk read
        and an eviction in the arena every decoder shares; a right one a read overlapped with
        compute, which pays when reads bound the step. Measured in interleaved runs (`bench capped`):
        - chain-routed model (16 layers, top 8; 76 % / 95 % missed): at a 50 % cap top-1 3.97-4.41
          tok/s at 1.02-1.03x an ideal LRU's disk bytes, top-7 4.97-5.06 at 1.04-1.05, top-8
          4.89-5.11 at 1.10-1.14 (its last guess is the one most often wrong); at 25 % top-1
          3.05-3.33, top-7 3.26-3.47, top-8 3.24-3.34;
        - the sampled peer model (top 4; an ideal LRU hits 96 % / 69 %): top-3 against top-1 the
          same tok/s at 50 % for 1.74x against 1.28-1.33x the bytes, 10 % slower at 25 %."""
        return max(1, k - 1) if self.misses.share >= WIDE_MISS_SHARE else 1

    def _send(self, predictions: Predictions, if_cached: Predictions) -> None:
        arena = self.client.arena
        if arena is not None and arena.directory is not None:
            # what the arena holds needs no lease: a guess that it holds is no message at all
            predictions = {layer: [e for e in es if e not in self._look_up(arena, layer, list(es))]
                           for layer, es in predictions.items()}
            if_cached = {}
        self.prefetches.send(predictions, "ahead")
        if any(if_cached.values()):
            self.prefetches.send(if_cached, "cached")

    def mix(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.prefetches.hand_back_recalled()
        xs, w, routed = cpu_inputs(x, weights, ids)
        wanted = routed.experts.tolist()
        uses = dict(zip(wanted, np.diff(routed.row_ptr).tolist())) if x.shape[0] > 1 else None  # rows per expert:
        # the daemon's policy counts a prompt's tokens, not one use per request
        landed = self.prefetches.take(layer, {}, wanted)
        arena = self.client.arena  # (one arena for the lookup and the compute: a reconnect swaps it)
        direct = self._look_up(arena, layer, [e for e in wanted if e not in landed] if landed else wanted)
        owed = self.leases.request(layer, [e for e in wanted if e not in landed and e not in direct], landed, uses)
        self._send_deferred()  # behind this layer's demand at the daemon
        outputs = []
        try:
            if direct:  # computed while the misses are on their way
                outputs.append(self._compute_direct(arena, layer, xs, routed, w, direct, owed, uses))
            if owed.pending:
                self._compute_arrivals(layer, xs, routed, w, owed, outputs)
        except BaseException:
            self.leases.give_up(owed)
            raise
        self.counts.acquired += len(wanted)
        return torch.from_numpy(combine_rows(*xs.shape, outputs)).to(x.dtype)  # [N, d]

    def stats(self) -> ArenaStats:
        return ArenaStats(replace(self.counts), replace(self.prefetches.counts), dict(self.client.recalls))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._base = self._base_arena = None  # the arena mapping can go with the client
        self._rows.clear()
        try:
            self.prefetches.drop_all()
        except IodUnavailable:
            pass  # the daemon is gone, and our leases with it
        if self._owns_client:
            self.client.close()

    # -- internals ---------------------------------------------------------------------------
    def _send_deferred(self) -> None:
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        for predictions, if_cached in deferred:
            self._send(predictions, if_cached)

    def _compute_arrivals(self, layer: int, xs: np.ndarray, routed: Routed, w: np.ndarray, owed: Owed,
                          outputs: list[ExpertRows]) -> None:
        """Compute the experts owed to this layer as their leases arrive (one kernel call per
        batch), releasing each batch at once; a void lease is fetched again."""
        for leases in self.leases.arrivals(owed):
            t0 = time.perf_counter()
            try:
                computed = self._compute(layer, xs, routed, w, leases)
            finally:
                self.client.release_many(list(leases.values()))
            self.counts.compute_s += time.perf_counter() - t0
            # computed from a lost daemon's (or a revoked) slot: not to be trusted, fetched again
            void = [e for e, lease in leases.items() if computed is None or self.client.voided(lease)]
            for e in void:
                self.leases.refetch(owed, e, "voided")
            if computed is not None:
                outputs.append(computed.without(void))

    # -- lease-free hits (the arena's directory) ----------------------------------------------------
    def _look_up(self, arena: ArenaView | None, layer: int, experts: list[int]) -> dict[int, tuple[int, int]]:
        """{expert: (slot, seq)} of those `arena` holds complete now, by its directory (none
        without one)."""
        d = arena.directory if arena is not None else None
        if d is None or not experts:
            return {}
        return d.lookup(experts, first=layer * self._n_expert)

    def _compute_direct(self, arena: ArenaView, layer: int, x: np.ndarray, routed: Routed, w: np.ndarray,
                        direct: dict[int, tuple[int, int]], owed: Owed, uses: dict[int, int] | None) -> ExpertRows:
        """Outputs of the experts found through the directory, computed from their slots without a
        lease; an expert whose slot changed meanwhile (evicted, reloaded) is fetched `now` instead.
        The hits go to the daemon with the rows each served (`uses`; None: one each)."""
        t0 = time.perf_counter()
        mine = routed.only(sorted(direct))
        rows = self._rows_of(layer, arena)
        held = rows.held
        for e, (slot, _) in direct.items():
            if held[e] != slot:
                self._slot_placed(rows, layer, e, slot, arena)
        computed = run_experts(x, mine, w, rows.take(mine.experts), self.layout.spec.expert_act)
        changed = arena.directory.moved(direct)
        for e in changed:
            self.leases.refetch(owed, e, "changed")
        done = [e for e in direct if e not in changed] if changed else list(direct)
        self.client.touch(layer, done, [uses[e] for e in done] if uses else None)  # sent later
        self.counts.direct += len(direct) - len(changed)
        self.counts.compute_s += time.perf_counter() - t0
        return computed.without(changed)

    def _slot_placed(self, rows: TableRows, layer: int, e: int, slot: int, arena: ArenaView) -> None:
        """Expert (layer, e)'s table row for `slot`, where the directory places its parts."""
        offs = arena.directory.slot_offs[slot]  # [MAX_PARTS], in the layout's part order
        self._place(rows, layer, e, slot, arena, lambda parts: [int(offs[i]) for i in range(len(parts))])

    def _compute(self, layer: int, x: np.ndarray, routed: Routed, w: np.ndarray,
                 leases: dict[int, Lease]) -> ExpertRows | None:
        """The outputs of the leased experts, computed where they lie in the arena; leases voided
        by then are left out (the caller fetches them again), None when all of them were."""
        current = {e: lease for e, lease in leases.items() if not self.client.voided(lease)}
        if not current:
            return None
        try:
            self._base_for(next(iter(current.values())))
        except LeaseVoided:  # lost since: all of them are void now
            return None
        mine = routed.only(sorted(current))
        rows = self._rows_of(layer, self._base_arena)
        for e, lease in current.items():
            if rows.held[e] != lease.slot:
                self._place(rows, layer, e, lease.slot, self._base_arena,
                            lambda parts: [lease.parts[p.name][0] for p in parts])
        return run_experts(x, mine, w, rows.take(mine.experts), self.layout.spec.expert_act)

    def _base_for(self, lease: Lease) -> np.ndarray:
        """The arena `lease` lives in, as one uint8 array."""
        return self._base_of(self.client.arena_of(lease))

    def _base_of(self, arena: ArenaView) -> np.ndarray:
        """`arena` as one uint8 array (re-made when a reconnect brought a new arena, and with it
        the table rows kept over the old one)."""
        if arena is not self._base_arena:
            self._base, self._base_arena = np.frombuffer(arena.whole(), dtype=np.uint8), arena
            self._rows.clear()
            self._slot_rows.clear()
        return self._base

    def _rows_of(self, layer: int, arena: ArenaView) -> TableRows:
        """`layer`'s table rows over `arena` (made on first use, and anew with a new arena)."""
        base = self._base_of(arena)
        rows = self._rows.get(layer)
        if rows is None:
            rows = self._rows[layer] = TableRows(base, self._n_expert)
        return rows

    def _place(self, rows: TableRows, layer: int, e: int, slot: int, arena: ArenaView, offsets: Any) -> None:
        """Row e := (layer, e)'s parts in `slot` at `offsets(parts)` (views into the arena array,
        no copy), checked once while the expert stays in that slot: the offsets of a key's parts
        in a slot never change, so a row whose `held` slot matches needs nothing. The views depend
        on the slot and the parts' geometry, not on which expert: a slot's checked row is made once
        and reused by every expert of that geometry landing there (a miss's placement was ~10 %
        of a streamed decode step's main-thread samples)."""
        parts = self.layout.experts.parts(layer, e)
        offs = tuple(offsets(parts))
        geometry = self._geometry.get(layer)
        if geometry is None:
            geometry = self._geometry[layer] = tuple((p.name, int(p.qtype), p.shape, p.nbytes) for p in parts)
        key = (slot, geometry, offs)
        one = self._slot_rows.get(key)
        if one is None:
            base, start = rows.base, slot * arena.slot_bytes
            views = {p.name: base[start + off:start + off + p.nbytes] for p, off in zip(parts, offs)}
            one = rows.check(expert_mats(parts, views))
            if not one.has_bias:  # (biases are copied out of the slot: they belong to the expert)
                self._slot_rows[key] = one
        rows.put(e, slot, one)


def open_arena(layout: ModelLayout, endpoint: str, *, timeout_s: float = 5.0, fetch_timeout_s: float = 60.0,
               name: str | None = None, prefetch_limit: int | None = None, reconnect_s: float = 30.0) -> ArenaExperts:
    """Connect to the daemon at `endpoint` (checking it serves this file; reconnecting for up to
    `reconnect_s` when it restarts)."""
    client = IodClient(endpoint, expect_fingerprint=layout.fingerprint.as_dict(), timeout_s=timeout_s, name=name,
                       reconnect_s=reconnect_s)
    try:
        return ArenaExperts(client, layout, fetch_timeout_s=fetch_timeout_s, owns_client=True,
                            prefetch_limit=prefetch_limit)
    except BaseException:
        client.close()
        raise
