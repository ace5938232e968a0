"""Routing traces fitted to published LRU hit-rate curves: replayed through the cache simulator's
own LRU (policy_sim, not the generator's), their hit rates are the published ones."""

from __future__ import annotations

import numpy as np
import pytest
from moestream.authoring import routing_curves as rc
from moestream.authoring.policy_sim import simulate


def _lru_steady(ids: np.ndarray, layer: int, capacity: int) -> float:
    """policy_sim's LRU on one layer's tokens; the first quarter only warms it (an online policy:
    the prefix's own replay gives the hits to subtract)."""
    steps = [[int(e) for e in row] for row in ids[:, layer]]
    warm = len(steps) // 4
    full, pre = simulate(steps, capacity, "lru"), simulate(steps[:warm], capacity, "lru")
    hits = full.hits - pre.hits
    return hits / (hits + full.misses - pre.misses)


@pytest.mark.parametrize("name", sorted(rc.CURVES))
def test_curve_traces_hit_the_published_rates_through_an_lru(name):
    E, k, L = 128, 8, 3
    ids, fit = rc.curve_trace(name, n_layer=L, n_expert=E, k=k, tokens=400, seed=0)
    assert ids.shape == (400, L, k) and ids.min() >= 0 and ids.max() < E
    assert all(len(set(row)) == k for row in ids.reshape(-1, k).tolist())  # k distinct experts per token
    assert fit.skipped == (0.05,)  # 6 of 128 experts cannot hold one token's 8
    for share, published, _ in fit.points:
        got = np.mean([_lru_steady(ids, la, round(share * E)) for la in range(L)])
        assert abs(got - published) <= 0.05, f"{name} at {share:.0%}: LRU hit rate {got:.3f}, published {published}"


def test_the_same_seed_gives_the_same_trace_and_another_does_not():
    a, fa = rc.curve_trace("qwen3-235b", 2, 16, 2, 50, seed=1)
    b, fb = rc.curve_trace("qwen3-235b", 2, 16, 2, 50, seed=1)
    assert (a == b).all() and fa == fb

    def stream(seed):
        return rc.layer_stream(np.random.default_rng(seed), 64, 4, 50, fa.alpha, fa.rho, fa.q)

    assert (stream(3) == stream(3)).all() and not (stream(3) == stream(4)).all()


def test_curves_that_cannot_be_expressed_say_why():
    with pytest.raises(ValueError, match="unknown routing curve"):
        rc.fit_curve("gpt-9", 64, 8)
    with pytest.raises(ValueError, match="no point of it fits a model of 16 experts, top 8"):
        rc.fit_curve("qwen3-235b", 16, 8)
