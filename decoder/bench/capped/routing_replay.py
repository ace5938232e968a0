"""moestream's routing trace of one run, replayed for `moestream bench capped`: what an ideal LRU
cache of the arena's size would have missed (and the daemon's own policy, for the forecast), and
how widely the decode steps spread over the experts (greedy decoding of a random model tends to
loop over a few tokens, so few experts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ....authoring.policy_sim import simulate, split_per_layer

NARROW_SHARE = 0.5  # routing narrower than this share of the experts per layer counts as narrow
NARROW_MIN_TOKENS = 32
DAEMON_DECAY = 0.9  # the arena's hotness decay per tick (moestream-iod's HostCache default)

Steps = Sequence[Sequence[tuple[int, int]]]  # per forward pass, its (layer, expert) keys


def is_narrow(share: float, tokens: int) -> bool:
    """Too few experts touched, over a run long enough to judge."""
    return tokens >= NARROW_MIN_TOKENS and share < NARROW_SHARE


def ideal_lru(steps: Steps, capacity: int, expert_bytes: float, decode_from: int = 1) -> dict[str, Any]:
    """LRU over `steps` (one per forward pass; the first `decode_from` are the prefill) with
    `capacity` experts: misses of the decode steps and their bytes per decoded token; the same
    for Belady's optimum (keys `belady_*`: the fewest misses any cache of that size could have;
    Belady's prefill misses the same as LRU's, every key is new there).

    Steps are split per layer (one layer's experts are in use at a time, as in the arena), and
    a layer's keys that outnumber the capacity into pieces that fit (the arena, too, processes
    such a prompt in pieces). For LRU neither split changes anything where a whole step fits."""
    out: dict[str, Any] = {"capacity": capacity, "decode_steps": len(steps) - decode_from}
    if capacity < 1:
        return {**out, "error": f"an arena of {capacity} slots holds no expert"}
    for policy, tag in (("lru", ""), ("belady", "belady_")):
        r = _replay(steps, capacity, expert_bytes, decode_from, policy)
        out.update({f"{tag}{k}": v for k, v in r.items() if k != "prefill_misses"})
        out.setdefault("prefill_misses", r["prefill_misses"])
    return out


def arena_policy(steps: Steps, capacity: int, expert_bytes: float, decode_from: int = 1,
                 decay: float = DAEMON_DECAY) -> dict[str, Any]:
    """`ideal_lru`'s figures for the daemon's own policy (`common.policy.SlotPolicy(adaptive=True)`:
    hotness-decayed LFU, or LRU while a shadow LRU hits more) on the same per-layer pieces, hotness
    decaying by `decay` per step (the daemon decays per tick of up to a second, about a token at
    these speeds). On skewed routing with room for less than a token's experts it keeps the hot
    experts an LRU cycles out: on a Qwen3-235B-curve trace, 102 slots of 16 x 64 experts top-8, LRU
    hits 0 %, this 52 %; with room for a token's, it follows LRU."""
    out: dict[str, Any] = {"capacity": capacity, "decode_steps": len(steps) - decode_from}
    if capacity < 1:
        return {**out, "error": f"an arena of {capacity} slots holds no expert"}
    return {**out, **_replay(steps, capacity, expert_bytes, decode_from, "adaptive", decay)}


def _replay(steps: Steps, capacity: int, expert_bytes: float, decode_from: int, policy: str,
            decay: float = DAEMON_DECAY) -> dict[str, Any]:
    """`policy` over the per-layer pieces of `steps`; the decode steps' hits and misses (the
    prefill's warm the cache), `decay` spread over each step's pieces (lfu and adaptive)."""
    flat = _pieces(steps, capacity)
    n_pre = len(_pieces(steps[:decode_from], capacity))
    per_piece = decay ** (len(steps) / max(1, len(flat)))
    pre = simulate(flat[:n_pre], capacity, policy, per_piece) if n_pre else None
    full = simulate(flat, capacity, policy, per_piece)
    misses, hits = full.misses - (pre.misses if pre else 0), full.hits - (pre.hits if pre else 0)
    tokens = len(steps) - decode_from
    return {"misses": misses, "hits": hits, "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "missed_bytes_per_token": misses * expert_bytes / tokens if tokens else None,
            "prefill_misses": pre.misses if pre else 0}


def _pieces(steps: Steps, capacity: int) -> list[list[tuple[int, int]]]:
    """Steps split per layer, then into pieces of at most `capacity` distinct keys, each key
    repeated as often as in its step (a row each: uses the daemon's policy counts)."""
    out = []
    for step in split_per_layer(steps):
        keys = list(dict.fromkeys(step))
        for i in range(0, len(keys), capacity):
            piece = set(keys[i:i + capacity])
            out.append([k for k in step if k in piece])
    return out


def routing_spread(steps: Steps, n_layer: int, n_expert: int, decode_from: int = 1) -> dict[str, Any]:
    """Distinct experts per layer over the decode steps: mean over layers, share of n_expert."""
    seen: list[set[int]] = [set() for _ in range(n_layer)]
    for step in steps[decode_from:]:
        for layer, e in step:
            seen[layer].add(e)
    mean = sum(map(len, seen)) / n_layer if n_layer else 0.0
    tokens = len(steps) - decode_from + 1  # the prefill's token + one per decode step
    share = mean / n_expert if n_expert else 0.0
    return {"mean_distinct": mean, "n_expert": n_expert, "share": share, "tokens": tokens,
            "narrow": is_narrow(share, tokens)}
