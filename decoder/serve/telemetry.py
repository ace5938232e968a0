"""Expert traffic per step and per request.

`StepExperts` counts the bytes of the distinct experts each layer's routing picked in a step;
`ExpertShare` is one request's part of the source's counters: each step's change is split
equally among the step's sequences (they share one fetch per layer), so the shares of all
requests add up to the source's counters over the same steps. `usage.moestream` of a reply:

| field | meaning |
|---|---|
| expert_bytes_used | bytes of the distinct experts the steps routed to (share) |
| expert_bytes_fetched | expert bytes the daemon delivered (demand and prefetch; share; 0 resident) |
| arena_hits, arena_misses | experts found in the arena / fetched on demand (share) |
| expert_stall_s | time the steps waited on experts (share) |
| prefetch_hidden_share | of the experts that would have missed, those whose I/O prefetch hid |
| steps | engine steps the request took part in |
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch

from ..experts.bank import BankStats
from ..models.moe_transformer import LayerObserver


COUNTERS = ("expert_bytes_fetched", "arena_hits", "arena_misses", "stall_s", "prefetch_hidden", "prefetch_useful")


def expert_counters(st: BankStats, received: int | None = None) -> dict[str, float]:
    """The counters a request gets a share of, from the bank's typed stats (`traffic()`).
    `received`: the daemon client's count of every blob delivered (prefetches too), preferred."""
    t = st.traffic()
    fetched = received if received is not None else t.bytes_fetched
    return dict(zip(COUNTERS, map(float, (fetched, t.hits, t.misses, t.stall_s, t.prefetch_hidden,
                                          t.prefetch_useful))))


@dataclass
class ExpertShare:
    """One request's part of the expert traffic of the steps it ran in."""

    used_bytes: float = 0.0  # distinct experts of each step's routing
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    steps: int = 0

    def add(self, used: float, deltas: dict[str, float]) -> None:
        self.used_bytes += used
        self.steps += 1
        for k, v in deltas.items():
            self.counters[k] += v

    def json(self) -> dict[str, float]:
        c = self.counters
        would_miss = c["arena_misses"] + c["prefetch_useful"]
        return {"expert_bytes_used": round(self.used_bytes), "expert_bytes_fetched": round(c["expert_bytes_fetched"]),
                "arena_hits": round(c["arena_hits"], 3), "arena_misses": round(c["arena_misses"], 3),
                "expert_stall_s": round(c["stall_s"], 6), "steps": self.steps,
                "prefetch_hidden_share": round(c["prefetch_hidden"] / would_miss, 4) if would_miss else 0.0}



class StepExperts(LayerObserver):
    """Counts the bytes of the distinct experts each layer's routing picked (the union over the
    step's sequences), and passes every call on to an inner observer (the prefetcher)."""

    def __init__(self, blob_bytes: list[int], inner: LayerObserver | None):
        self.blob_bytes, self.inner = blob_bytes, inner or LayerObserver()
        self.bytes = 0

    def after_attention(self, layer: int, h: torch.Tensor) -> None:
        self.inner.after_attention(layer, h)

    def routed(self, layer: int, ids: torch.Tensor) -> None:
        self.bytes += self.blob_bytes[layer] * int(ids.unique().numel())  # ids [n, k]
        self.inner.routed(layer, ids)

    def after_layer(self, layer: int, h: torch.Tensor) -> None:
        self.inner.after_layer(layer, h)
