"""The policy simulator: Belady against a brute-force optimum and textbook numbers, LRU and
LFU never above Belady, trace files and the CLI."""

from __future__ import annotations

import json
import random
from functools import lru_cache
from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.authoring.policy_sim import SimResult, main, simulate, split_per_layer
from moestream.common.traces import load_trace, write_trace

# The classic reference string: 3 frames give 7 faults under OPT, 10 under LRU.
TEXTBOOK = [[k] for k in (1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5)]


def brute_force_max_hits(trace: list[list[int]], capacity: int) -> int:
    """Best hits over every eviction choice (any number of evictions, never the step's keys)."""
    steps = [frozenset(s) for s in trace]

    @lru_cache(maxsize=None)
    def best(s: int, cache: frozenset) -> int:
        if s == len(steps):
            return 0
        keys = steps[s]
        need = len(cache | keys) - capacity
        evictable = sorted(cache - keys)
        options = [
            best(s + 1, (cache - set(drop)) | keys)
            for n in range(max(need, 0), len(evictable) + 1)
            for drop in combinations(evictable, n)
        ]
        return len(keys & cache) + max(options)

    return best(0, frozenset())


def random_trace(rng: random.Random, n_steps: int, n_keys: int, width: int) -> list[list[int]]:
    weights = [1 / (i + 1) for i in range(n_keys)]  # skewed, like expert popularity
    return [rng.choices(range(n_keys), weights, k=rng.randint(1, width)) for _ in range(n_steps)]


def test_textbook_numbers():
    assert simulate(TEXTBOOK, 3, "belady") == SimResult(hits=5, misses=7)
    assert simulate(TEXTBOOK, 3, "lru") == SimResult(hits=2, misses=10)
    assert brute_force_max_hits(TEXTBOOK, 3) == 5


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), max_size=9),
       st.integers(3, 4))
def test_belady_equals_brute_force_optimum(trace, capacity):
    res = simulate(trace, capacity, "belady")
    assert res.hits == brute_force_max_hits(trace, capacity)
    assert res.hits + res.misses == sum(len(set(s)) for s in trace)


@pytest.mark.parametrize("seed", range(6))
def test_belady_bounds_lru_and_lfu(seed):
    rng = random.Random(seed)
    trace = random_trace(rng, 400, rng.randint(8, 40), 4)
    for capacity in (4, 8, 16):
        best = simulate(trace, capacity, "belady")
        total = best.hits + best.misses
        for policy, decay in (("lru", 0.9), ("lfu", 0.9), ("lfu", 1.0), ("lfu", 0.5), ("adaptive", 0.9)):
            res = simulate(trace, capacity, policy, decay)
            assert res.hits + res.misses == total
            assert res.hits <= best.hits, (policy, decay, capacity)


@pytest.mark.parametrize("seed", range(4))
def test_lfu_with_vanishing_decay_is_lru(seed):
    # With decay 2**-60 the last step's access outweighs any history and scores of one
    # step tie exactly, so the LRU tiebreak decides: the SlotPolicy path must equal LRU.
    # (Steps without repeats: a repeat is a use, which breaks the tie.)
    rng = random.Random(seed)
    trace = [list(dict.fromkeys(step)) for step in random_trace(rng, 300, 20, 4)]
    assert simulate(trace, 6, "lfu", 2.0**-60) == simulate(trace, 6, "lru")


@pytest.mark.parametrize("policy", ["lfu", "adaptive"])
def test_a_steps_repeats_are_uses_for_the_lfu(policy):
    # A prompt's step lists key 0 three times (three tokens chose it): 0 outweighs 1 when 2 needs
    # room, so the next step's 0 hits. Listed once, 0 is the older of two equals and goes first.
    # LRU counts no uses: the repeats change nothing there.
    rows, once = [[0, 0, 0, 1], [2], [0]], [[0, 1], [2], [0]]
    assert simulate(rows, 2, policy, 1.0).hits == 1 and simulate(once, 2, policy, 1.0).hits == 0
    assert simulate(rows, 2, "lru") == simulate(once, 2, "lru")


def test_lfu_beats_lru_on_a_hot_set_with_scans():
    # Hot keys 0-2 every third step, one-off scan keys between: two scans push hot keys out
    # of an LRU cache of 4, while decayed LFU keeps the hot set once it has warmed up (and
    # a hot key evicted while cold comes back with its score).
    trace = [[0, 1, 2] if t % 3 == 0 else [100 + t] for t in range(300)]
    lfu, lru = simulate(trace, 4, "lfu", 0.9), simulate(trace, 4, "lru")
    assert lfu.hits >= 3 * 99 - 3 and lru.hits <= 2 * 99  # LRU loses a hot key every cycle
    assert lfu.hits <= simulate(trace, 4, "belady").hits


def test_repeated_key_in_a_step_counts_once():
    assert simulate([[1, 1, 2], [1]], 2, "lfu") == SimResult(hits=1, misses=2)


@pytest.mark.parametrize("capacity, policy, match", [
    (1, "lfu", "need an int >= 2"), (2, "fifo", "unknown policy 'fifo'"),
])
def test_simulate_rejects_bad_arguments(capacity, policy, match):
    with pytest.raises(ValueError, match=match):
        simulate([[1, 2]], capacity, policy)


# -- trace files and the CLI -----------------------------------------------------------------
def test_json_roundtrip_and_npy(tmp_path):
    steps = [[(0, 1), (1, 3)], [(0, 2), (1, 3)]]
    write_trace(tmp_path / "t.json", steps, n_layer=2, n_expert=4)
    assert load_trace(tmp_path / "t.json") == steps
    np.save(tmp_path / "t.npy", np.array([[[1], [3]], [[2], [3]]], dtype=np.int32))  # [2, 2, 1]
    assert load_trace(tmp_path / "t.npy") == steps
    assert split_per_layer(steps) == [[(0, 1)], [(1, 3)], [(0, 2)], [(1, 3)]]


@pytest.mark.parametrize("name, content, match", [
    ("t.json", {"n_layer": 2, "n_expert": 4, "steps": [[[0, 1]], [[2, 0]]]}, r"step 1: bad key \[2, 0\]"),
    ("t.json", {"steps": []}, "n_layer, n_expert and steps"),
    ("t.npy", np.zeros((3, 2)), r"\[tokens, layers, k\]"),
    ("t.npy", np.full((1, 1, 1), -1), "negative expert id -1"),
    ("t.txt", "", "must be .json or .npy"),
])
def test_bad_trace_files(tmp_path, name, content, match):
    path = tmp_path / name
    if name.endswith(".npy"):
        np.save(path, content)
    else:
        path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=match):
        load_trace(path)


def test_adaptive_keeps_the_hot_set_where_lru_loses_it():
    """The trace above: the arena's adaptive policy must follow the LFU there, not LRU."""
    trace = [[0, 1, 2] if t % 3 == 0 else [100 + t] for t in range(300)]
    adaptive, lfu = simulate(trace, 4, "adaptive", 0.9), simulate(trace, 4, "lfu", 0.9)
    assert adaptive.hits >= lfu.hits - 6 > simulate(trace, 4, "lru").hits


def test_cli_prints_rates_and_ratios(tmp_path, capsys):
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(16, size=(3, 2), replace=False) for _ in range(50)])  # [50, 3, 2]
    np.save(tmp_path / "t.npy", ids)
    assert main([str(tmp_path / "t.npy"), "--capacity", "6", "12", "--decay", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "50 steps, 300 accesses" in out and out.count("lfu/belady") == 2 and out.count("adaptive/belady") == 2
    assert main([str(tmp_path / "t.npy"), "--capacity", "2", "--per-layer"]) == 0
    assert "150 steps" in capsys.readouterr().out


def test_cli_errors_are_one_line(tmp_path, capsys):
    write_trace(tmp_path / "t.json", [[(0, 1), (0, 2), (0, 3)]], n_layer=1, n_expert=4)
    assert main([str(tmp_path / "t.json"), "--capacity", "2"]) == 1
    assert main([str(tmp_path / "missing.json"), "--capacity", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "need an int >= 3" in err[0] and "missing.json" in err[1]


def test_adaptive_judges_the_shadows_under_the_real_caches_pins():
    """Whole-token steps of 16 keys through 20 slots: the step's pins leave the cache 4 slots to
    choose from, and the LFU wins there. Shadows that ignored the pins (free to evict the step's own
    keys) once judged LRU the winner and lost 0.017 of hit rate."""
    rng = random.Random(5)
    weights = [1 / (e + 1) ** 1.5 for e in range(32)]
    trace, last = [], None
    for _ in range(1500):  # 8 layers x top-2 of 32, a layer's pick repeating the last token's at 0.45
        step = []
        for layer in range(8):
            picks = {rng.choice([e for lay, e in last if lay == layer])} if last and rng.random() < 0.45 else set()
            while len(picks) < 2:
                picks.add(rng.choices(range(32), weights)[0])
            step += [(layer, e) for e in sorted(picks)]
        trace.append(step)
        last = step
    lfu, lru = simulate(trace, 20, "lfu", 0.9), simulate(trace, 20, "lru")
    assert lfu.hit_rate > lru.hit_rate + 0.05
    assert simulate(trace, 20, "adaptive", 0.9).hit_rate >= lfu.hit_rate - 0.005
