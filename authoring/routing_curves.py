"""Routing traces shaped like a real model's: generated to match a published LRU hit-rate curve,
for `moestream bench capped --routing curve NAME` (both sides then replay the same forced top-k).

A random model's own routing is either narrow (greedy decoding loops over a few tokens) or
near-uniform (the chain model); real models lie between. Published trace measurements give an
LRU's hit rate against the share of a layer's experts it caches:

| curve        | 5 % cached | 16 % | 25 % |
|--------------|-----------:|-----:|-----:|
| qwen3-235b   | 0.34       | 0.66 | 0.80 |
| qwen3.5-397b | 0.41       | 0.65 | 0.76 |

The generator, per layer and independently: expert popularity ~ (rank + q)^-alpha (Zipf-
Mandelbrot: the offset q flattens the head) over a random order of the experts, and each of a
token's k picks kept from the previous token's with probability rho (temporal locality), else
drawn by popularity. (q, alpha, rho) are fitted, by a coarse then a fine grid, to the curve's points that the model can express (a per-layer LRU must hold one
token's k experts), on a steady-state per-layer LRU (the first quarter of the tokens warms it).

Output: an integer array [tokens, layers, k] (`common.traces`' .npy format).
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# curve name -> ((share of a layer's experts cached, LRU hit rate), ...)
CURVES: dict[str, tuple[tuple[float, float], ...]] = {
    "qwen3-235b": ((0.05, 0.34), (0.16, 0.66), (0.25, 0.80)),
    "qwen3.5-397b": ((0.05, 0.41), (0.16, 0.65), (0.25, 0.76)),
}
FIT_TOKENS = 256  # at least; and 4 x E / k, so the warm quarter fills even an LRU of every expert
FIT_LAYERS = 2
COARSE_ALPHA = np.linspace(0.0, 2.4, 7)
COARSE_RHO = np.linspace(0.0, 0.9, 7)
COARSE_OFFSET = (0.0, 1 / 16, 1 / 4)  # q as a share of the experts


@dataclass(frozen=True)
class CurveFit:
    alpha: float  # Zipf exponent of the experts' popularity
    rho: float  # chance that a pick repeats one of the previous token's
    q: float  # Zipf-Mandelbrot offset of the popularity ranks
    points: tuple[tuple[float, float, float], ...]  # (share cached, target hit rate, fitted one)
    skipped: tuple[float, ...]  # shares whose LRU would hold fewer than k experts


def layer_stream(rng: np.random.Generator, n_expert: int, k: int, tokens: int, alpha: float, rho: float,
                 q: float = 0.0) -> np.ndarray:
    """One layer's expert ids [tokens, k] (see the module docstring)."""
    pop = np.empty(n_expert)
    pop[rng.permutation(n_expert)] = (np.arange(n_expert) + 1.0 + q) ** -alpha
    pop /= pop.sum()
    out = np.empty((tokens, k), dtype=np.int64)
    prev = rng.choice(n_expert, k, replace=False, p=pop)
    out[0] = prev
    for t in range(1, tokens):
        keep = prev[rng.random(k) < rho]
        p = pop.copy()
        p[keep] = 0.0
        new = rng.choice(n_expert, k - len(keep), replace=False, p=p / p.sum())
        prev = out[t] = np.concatenate([keep, new])
    return out


def lru_hit_rate(stream: np.ndarray, capacity: int, warm: int | None = None) -> float:
    """Steady-state hit rate of an LRU of `capacity` experts over one layer's ids [tokens, k]:
    a token's hits are taken before its misses are filled (so capacity >= k); the first `warm`
    tokens (default a quarter) only warm the cache."""
    warm = len(stream) // 4 if warm is None else warm
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for t, row in enumerate(stream.tolist()):
        missed = []
        for e in row:
            if e in cache:
                cache.move_to_end(e)
                hits += t >= warm
            else:
                missed.append(e)
        total += len(row) if t >= warm else 0
        for e in missed:
            if len(cache) >= capacity:
                cache.popitem(last=False)
            cache[e] = None
    return hits / total if total else 0.0


def capacity_of(share: float, n_expert: int) -> int:
    return max(1, round(share * n_expert))


def fit_tokens(n_expert: int, k: int) -> int:
    return max(FIT_TOKENS, 4 * n_expert // k)


def _error(points: list[tuple[float, float]], n_expert: int, k: int, alpha: float, rho: float, q: float,
           seed: int) -> float:
    rng = np.random.default_rng([seed, 0xF17])
    streams = [layer_stream(rng, n_expert, k, fit_tokens(n_expert, k), alpha, rho, q) for _ in range(FIT_LAYERS)]
    return sum((np.mean([lru_hit_rate(s, capacity_of(f, n_expert)) for s in streams]) - h) ** 2 for f, h in points)


def fit_curve(name: str, n_expert: int, k: int, seed: int = 0) -> CurveFit:
    """(alpha, rho) whose streams' LRU hit rates come closest to curve `name`'s points."""
    if name not in CURVES:
        raise ValueError(f"unknown routing curve {name!r} (have: {', '.join(CURVES)})")
    points = [(f, h) for f, h in CURVES[name] if capacity_of(f, n_expert) >= k]
    skipped = tuple(f for f, _ in CURVES[name] if capacity_of(f, n_expert) < k)
    if not points:
        raise ValueError(f"curve {name}: no point of it fits a model of {n_expert} experts, top {k} (the LRU "
                         f"must hold {k} of them: at least {k / n_expert:.0%} cached)")
    grid = [(a, r, f * n_expert) for f in COARSE_OFFSET for a in COARSE_ALPHA for r in COARSE_RHO]
    best = min(grid, key=lambda arq: _error(points, n_expert, k, *arq, seed))
    fine = [(max(0.0, best[0] + da), min(0.95, max(0.0, best[1] + dr)), best[2] * dq)
            for da in (-0.2, 0.0, 0.2) for dr in (-0.05, 0.0, 0.05) for dq in (0.5, 1.0, 2.0)]
    alpha, rho, q = min(fine, key=lambda arq: _error(points, n_expert, k, *arq, seed))
    rng = np.random.default_rng([seed, 0xF17])
    streams = [layer_stream(rng, n_expert, k, fit_tokens(n_expert, k), alpha, rho, q) for _ in range(FIT_LAYERS)]
    fitted = tuple((f, h, float(np.mean([lru_hit_rate(s, capacity_of(f, n_expert)) for s in streams])))
                   for f, h in points)
    return CurveFit(float(alpha), float(rho), float(q), fitted, skipped)


def curve_trace(name: str, n_layer: int, n_expert: int, k: int, tokens: int, seed: int = 0) -> tuple[np.ndarray, CurveFit]:
    """A trace [tokens, n_layer, k] of int16 expert ids shaped like curve `name`, and its fit."""
    fit = fit_curve(name, n_expert, k, seed)
    rng = np.random.default_rng([seed, 0x7CE])
    ids = np.stack([layer_stream(rng, n_expert, k, tokens, fit.alpha, fit.rho, fit.q) for _ in range(n_layer)], axis=1)
    return ids.astype(np.int16), fit  # [T, L, k]


def describe(name: str, fit: CurveFit) -> str:
    pts = ", ".join(f"{f:.0%}: {h:.2f} (fitted {g:.2f})" for f, h, g in fit.points)
    skip = f"; not expressible here: {', '.join(f'{f:.0%}' for f in fit.skipped)}" if fit.skipped else ""
    return f"curve {name}: LRU hit rate at {pts}; Zipf {fit.alpha:.2f} (offset {fit.q:.0f}), repeat {fit.rho:.2f}{skip}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moestream.authoring.routing_curves", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("curve", choices=sorted(CURVES))
    p.add_argument("out", help="trace file to write (.npy [tokens, layers, k])")
    for flag in ("--layers", "--experts", "--top-k", "--tokens"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        ids, fit = curve_trace(a.curve, a.layers, a.experts, a.top_k, a.tokens, a.seed)
    except ValueError as e:
        print(f"routing_curves: {e}", file=sys.stderr)
        return 1
    np.save(a.out, ids)
    print(describe(a.curve, fit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
