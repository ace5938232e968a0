"""A CPU layer call's compiled steps around the expert kernels, against numpy doing the same thing."""

from __future__ import annotations

import numpy as np
import pytest
from moestream.decoder.kernels.cpu import moe
from moestream.decoder.kernels.cpu.moe import ExpertRows, Routed, combine_rows


def numpy_grouping(ids: np.ndarray) -> tuple[np.ndarray, ...]:
    flat = ids.reshape(-1)
    picks = np.argsort(flat, kind="stable")
    counts = np.bincount(flat)
    experts = np.flatnonzero(counts)
    row_ptr = np.concatenate([[0], np.cumsum(counts[experts])])
    return experts, row_ptr, picks // ids.shape[1], picks


@pytest.mark.parametrize("n, k, e", [(1, 1, 1), (1, 8, 64), (7, 4, 6), (33, 10, 512)])
def test_group_by_expert_is_a_stable_sort(n: int, k: int, e: int) -> None:
    rng = np.random.default_rng(n * k)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int64)  # [n, k]
    got = moe.group_by_expert(ids)
    for g, want in zip(got, numpy_grouping(ids)):
        assert g.dtype == np.int64
        np.testing.assert_array_equal(g, want)
    r = Routed.of(ids[:, ::-1])  # a non-contiguous view is accepted
    np.testing.assert_array_equal(r.experts, numpy_grouping(np.ascontiguousarray(ids[:, ::-1]))[0])


def test_weigh_and_scatter_add_match_numpy_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    ys = (rng.standard_normal((40, 24)) * 10.0 ** rng.integers(-6, 6, (40, 1))).astype(np.float32)  # order matters
    rows = rng.integers(0, 5, 40).astype(np.int64)
    weights, picks = rng.random(60).astype(np.float32), rng.permutation(60)[:40].astype(np.int64)
    want = ys * weights[picks][:, None]
    got = ys.copy()
    moe.weigh(got, weights, picks)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    out, ref = np.zeros((5, 24), np.float32), np.zeros((5, 24), np.float32)
    moe.scatter_add(out, rows, got)
    np.add.at(ref, rows, want)
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))


def test_combine_rows_is_the_same_whatever_the_batches() -> None:
    """Arrival batches in any order sum as one batch does (the arena's result == resident's)."""
    rng = np.random.default_rng(1)
    ids = np.stack([rng.choice(16, 4, replace=False) for _ in range(6)]).astype(np.int64)  # [6, 4]
    whole = Routed.of(ids)
    ys = (rng.standard_normal((whole.rows.size, 8)) * 1e3).astype(np.float32)
    one = combine_rows(6, 8, [ExpertRows(whole, ys)])
    experts = whole.experts.tolist()
    batches = [experts[1::3], experts[0::3], experts[2::3]]
    parts = []
    for b in batches:
        mine, pairs = whole.select(b)
        parts.append(ExpertRows(mine, ys[pairs]))
    np.testing.assert_array_equal(combine_rows(6, 8, parts).view(np.uint32), one.view(np.uint32))
    ref = np.zeros((6, 8), np.float32)
    np.add.at(ref, whole.rows, ys)
    np.testing.assert_array_equal(one.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("n, k, e", [(1, 4, 64), (9, 8, 32), (40, 2, 6)])
def test_selecting_experts_matches_numpy(n: int, k: int, e: int) -> None:
    """A batch's experts picked out of a layer's grouping (Routed.select) as numpy's isin picks them,
    experts kept in any order, absent ones ignored."""
    rng = np.random.default_rng(n + e)
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int64)  # [n, k]
    whole = Routed.of(ids)
    for keep in ([], whole.experts.tolist(), rng.permutation(whole.experts)[: max(1, whole.experts.size // 2)].tolist()
                 + [e + 5]):
        got, pairs = whole.select(keep)
        sel = np.isin(whole.experts, keep)  # [U]
        want_pairs = np.repeat(sel, np.diff(whole.row_ptr))  # [R]
        np.testing.assert_array_equal(pairs, want_pairs)
        np.testing.assert_array_equal(got.experts, whole.experts[sel])
        np.testing.assert_array_equal(got.row_ptr, np.concatenate([[0], np.cumsum(np.diff(whole.row_ptr)[sel])]))
        np.testing.assert_array_equal(got.rows, whole.rows[want_pairs])
        np.testing.assert_array_equal(got.picks, whole.picks[want_pairs])
