"""Counters of the expert bank's backends and of the prefetcher, as typed dataclasses.

Every backend's `stats()` returns one of these: `describe()` is the text `--stats` prints for
people, `as_dict()` the JSON (`--json`, the server's /stats; the keys are those the dicts had
before), and `traffic()` the few numbers the server splits among the requests of a step. The
counters themselves are fields bumped where they happen (`counts.hits += n`), not dict keys.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Traffic:
    """What a step's requests get a share of (`serve.telemetry`)."""

    hits: float = 0.0  # experts computed without a fetch
    misses: float = 0.0  # experts fetched on demand
    bytes_fetched: float = 0.0
    stall_s: float = 0.0  # time the compute waited on experts
    prefetch_hidden: float = 0.0  # prefetches that landed in time
    prefetch_useful: float = 0.0  # prefetches whose expert was used (in time or late)


@dataclass
class ResidentStats:
    """Every expert in process (`cpu-mmap`: the file's map; `gpu-resident`: raw slots on the device)."""

    kind: str
    slot_format: str  # "quant" (the file's blocks where they lie) | "raw" (packed slots)
    experts: int  # experts held
    bytes: int  # their bytes
    acquired: int = 0  # experts computed (per layer call), or routed pairs on the fused kernels
    compute_s: float = 0.0  # time in the CPU kernels (cpu-mmap)
    kernels: str = ""  # "triton" | "torch" (gpu-resident)

    def describe(self) -> str:
        return (f"stats: experts: source=resident, {self.experts} experts held ({self.slot_format}, "
                f"{self.bytes / 2**20:.1f} MiB), {self.acquired} acquired")

    def as_dict(self) -> dict[str, Any]:
        d = {"source": "resident", **asdict(self)}
        if not self.kernels:
            d.pop("kernels")
        return d

    def traffic(self) -> Traffic:
        return Traffic(hits=float(self.acquired))


@dataclass
class LeaseCounters:
    """The lease pipeline's (`leases.LeasePipeline`): what a backend's layers had to fetch."""

    demand: int = 0  # fetched `now`
    refetched: int = 0  # fetched again (dropped, refused, cancelled)
    voided: int = 0  # leases of a lost daemon (or revoked) fetched again
    changed: int = 0  # lease-free reads whose slot was reloaded during their compute, fetched
    bytes_fetched: int = 0  # blob bytes of the leases used
    deadlines: int = 0  # requests that waited out the daemon's queue deadline
    stall_s: float = 0.0  # waiting for leases
    deadline_wait_s: float = 0.0
    waited_on: str = ""  # the last deadline's message (who held the arena)


@dataclass
class DemandCounters(LeaseCounters):
    """What the `gpu-slots` backend's layers asked of the slot cache (`StreamedExperts.counts`);
    `demand` (from the lease pipeline) counts its misses."""

    acquired: int = 0  # experts the layers used
    hits: int = 0  # resident and not prefetched
    bypassed: int = 0  # served without a slot (every slot pinned)
    ahead_bytes: int = 0  # prefetched bytes the compute thread landed itself (lazy landing)


@dataclass
class AheadCounters:
    """The prefetch bookkeeping's counters (`ahead.AheadPrefetches.counts`)."""

    prefetch_sent: int = 0
    sent_if_cached: int = 0  # `cached` guesses (the CPU arena without a directory): leased only if there
    not_cached: int = 0  # guesses refused (not in the arena) or dropped, fetched `now` when used
    prefetch_dropped: int = 0  # predictions not sent (no slot, over the lease quota)
    recalled: int = 0  # landed, handed back at the daemon's request
    useful: int = 0  # prefetched and used: hidden + late
    hidden: int = 0  # landed in time
    late: int = 0
    wasted: int = 0  # landed (or failed) for nothing
    cancelled: int = 0
    predicted: int = 0  # (layer, expert) predictions scored against the real routing
    predicted_right: int = 0
    routed: int = 0  # the real routing's experts, for the predictions' recall


@dataclass
class CacheStats:
    """The device slot cache: the policy's counters, then the storage's."""

    capacity: int
    resident: int
    pinned: int
    hits: int
    misses: int
    hit_rate: float
    inserts: int
    evictions: int
    removes: int
    steps: int
    history: int
    device: str
    slot_bytes: int
    cache_bytes: int
    writes: int = 0
    bytes_written: int = 0
    bypassed: int = 0
    direct_copies: int = 0  # fills copied straight from the registered arena (CUDA)
    host_registered: bool = False
    kernels: str = "torch"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SlotStats:
    """The `gpu-slots` backend: its layers' demand, its prefetches, the receiver and the slot cache."""

    demand: DemandCounters
    ahead: AheadCounters
    cache: CacheStats
    landing: str
    receiver_bytes: int = 0  # prefetched bytes the receiver thread landed
    receiver_copy_s: float = 0.0
    landed_by_compute: int = 0  # landings the compute thread took over from the receiver
    kind: str = field(default="gpu-slots")

    @property
    def stall_s(self) -> float:
        return self.demand.stall_s

    @property
    def bytes_fetched(self) -> int:
        return self.demand.bytes_fetched + self.receiver_bytes

    @property
    def prefetch_bytes(self) -> int:
        return self.demand.ahead_bytes + self.receiver_bytes

    @property
    def hit_rate(self) -> float:
        return self.demand.hits / self.demand.acquired if self.demand.acquired else 0.0

    @property
    def hidden_share(self) -> float:
        """Of the experts that would have missed, those whose read prefetch hid."""
        would_miss = self.demand.demand + self.ahead.useful
        return self.ahead.hidden / would_miss if would_miss else 0.0

    def as_dict(self) -> dict[str, Any]:
        a = self.ahead
        return {"source": "streamed", **asdict(self.demand), **asdict(a), "misses": self.demand.demand,
                "hit_rate": self.hit_rate, "bytes_fetched": self.bytes_fetched, "prefetch_bytes": self.prefetch_bytes,
                "landing": self.landing, "hidden_share": self.hidden_share,
                "prefetch_precision": a.predicted_right / a.predicted if a.predicted else 0.0,
                "prefetch_recall": a.predicted_right / a.routed if a.routed else 0.0,
                "receiver_copy_s": self.receiver_copy_s, "landed_by_compute": self.landed_by_compute,
                "cache": self.cache.as_dict(), "kind": self.kind}

    def describe(self) -> str:
        """Hit rate, bytes, stall, prefetch usefulness, for people."""
        d, a, c, st = self.demand, self.ahead, self.cache, self.as_dict()
        lines = [
            f"experts: {d.acquired} used, hit rate {self.hit_rate:.1%} ({d.hits} hits, {d.demand} misses, "
            f"{a.useful} prefetched), {self.bytes_fetched / 2**20:.2f} MiB fetched, stall {self.stall_s * 1e3:.1f} ms",
            f"slot cache: {c.resident}/{c.capacity} slots, {c.evictions} evictions, {d.bypassed} served without a "
            f"slot (cache full of pins)",
        ]
        if a.prefetch_sent:
            lines.append(
                f"prefetch: {a.prefetch_sent} sent, {a.useful} useful ({a.hidden} landed in time, {a.late} late), "
                f"{a.wasted} wasted, {a.cancelled} cancelled; hid {self.hidden_share:.1%} of the misses; predictions "
                f"precision {st['prefetch_precision']:.1%}, recall {st['prefetch_recall']:.1%}")
        return "\n".join(lines)

    def traffic(self) -> Traffic:
        return Traffic(hits=self.demand.hits, misses=self.demand.demand, bytes_fetched=self.bytes_fetched,
                       stall_s=self.stall_s, prefetch_hidden=self.ahead.hidden, prefetch_useful=self.ahead.useful)


@dataclass
class ArenaCounters(LeaseCounters):
    """What the `cpu-arena` backend's layers did (`arena.ArenaExperts.counts`)."""

    acquired: int = 0  # experts the layers used
    direct: int = 0  # computed straight from the arena through its directory: no request, no lease
    compute_s: float = 0.0


def would_miss(counts: ArenaCounters, prefetch: AheadCounters) -> int:
    """The experts a `cpu-arena` backend's layers found not in the arena when they asked: fetched
    `now` (a late prefetch is cancelled and fetched now: counted there), or prefetched in time."""
    return counts.demand + prefetch.hidden


@dataclass
class ArenaStats:
    """The `cpu-arena` backend: its layers, its prefetches, and the daemon's recalls."""

    counts: ArenaCounters
    prefetch: AheadCounters
    recalls: dict[str, int]  # {"recalled", "revoked"}: leases the daemon asked back, took back
    kind: str = "cpu-arena"

    @property
    def hidden_share(self) -> float:
        """Of the experts that would have been fetched `now`, those a prefetch had landed in time."""
        missed = would_miss(self.counts, self.prefetch)
        return self.prefetch.hidden / missed if missed else 0.0

    @property
    def miss_share(self) -> float:
        """Of the experts the layers used, those not in the arena when asked for: what the prefetch
        width follows (`arena.MissShare`, over recent steps)."""
        return would_miss(self.counts, self.prefetch) / self.counts.acquired if self.counts.acquired else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"source": "streamed", "slot_format": "quant", **asdict(self.counts), "recalls": dict(self.recalls),
                "prefetch": asdict(self.prefetch), "hidden_share": self.hidden_share, "miss_share": self.miss_share,
                "kind": self.kind}

    def describe(self) -> str:
        c, p = self.counts, self.prefetch
        lines = [f"experts: {c.acquired} used, {c.direct} read straight from the arena (no request), {c.demand} "
                 f"fetched now, {c.bytes_fetched / 2**20:.1f} MiB delivered, stall {c.stall_s * 1e3:.1f} ms, compute "
                 f"{c.compute_s * 1e3:.1f} ms, {self.miss_share:.0%} not in the arena when asked for"
                 + (f", {c.refetched} refetched" if c.refetched else "")
                 + (f", {c.changed} computed again (their slot was reloaded meanwhile)" if c.changed else "")]
        if c.deadlines:
            lines.append(f"waited for arena room: {c.deadlines} requests waited out the daemon's queue deadline "
                         f"({c.deadline_wait_s / c.deadlines:g} s each) and were asked again; last: {c.waited_on}")
        if self.recalls.get("recalled"):
            lines.append(f"recalls: the daemon asked {self.recalls['recalled']} leases back for other peers "
                         f"({p.recalled} idle prefetches handed back), took back {self.recalls['revoked']}")
        if p.prefetch_sent or p.sent_if_cached or p.prefetch_dropped:
            lines.append(f"prefetch: {p.prefetch_sent} sent ahead, {p.sent_if_cached} if cached ({p.not_cached} were "
                         f"not), {p.useful} useful ({p.hidden} in time, {p.late} late), {p.wasted} wasted, "
                         f"{p.cancelled} cancelled, {p.prefetch_dropped} over the limit; hid {self.hidden_share:.1%} "
                         "of the fetches")
        return "\n".join(lines)

    def traffic(self) -> Traffic:
        c = self.counts
        # a late prefetch was cancelled and fetched now (a miss): only those in time were of use
        return Traffic(hits=c.acquired - c.demand, misses=c.demand, bytes_fetched=c.bytes_fetched, stall_s=c.stall_s,
                       prefetch_hidden=self.prefetch.hidden, prefetch_useful=self.prefetch.hidden)


@dataclass
class ZeroCopyStats(LeaseCounters):
    """The `gpu-arena` backend: leases kept across tokens, read in place by the kernels."""

    keep: int = 0  # leases it keeps at most
    held: int = 0  # held now
    acquired: int = 0  # experts the layers used
    held_hits: int = 0  # used from a lease still held: no request
    released: int = 0
    recalled: int = 0  # handed back at the daemon's request
    kind: str = "gpu-arena"

    def as_dict(self) -> dict[str, Any]:
        return {"source": "streamed", "slot_format": "arena", **asdict(self)}

    def describe(self) -> str:
        return (f"experts: {self.acquired} used in place in the arena, {self.held_hits} from leases kept "
                f"({self.held}/{self.keep} held), {self.demand} fetched now, {self.released} handed back "
                f"({self.recalled} recalled), stall {self.stall_s * 1e3:.1f} ms")

    def traffic(self) -> Traffic:
        return Traffic(hits=self.held_hits, misses=self.demand, stall_s=self.stall_s)


@dataclass
class PrefetcherStats:
    """The prefetcher's predictions (`prefetch.Prefetcher`)."""

    depth: int
    at: str
    predictions: int = 0  # (layer, expert) keys predicted
    predict_s: float = 0.0  # time spent applying the routers ahead
    hints: int = 0  # predictions made (one per layer and pass)
    wide: int = 0  # of them, those that fetched more than each token's top-1 guess

    def describe(self) -> str:
        return f"prefetcher: depth {self.depth} at {self.at}, {self.predictions} predictions, " \
               f"{self.predict_s * 1e3:.1f} ms, {self.wide} of {self.hints} wide"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
