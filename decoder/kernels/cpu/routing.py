"""A layer call's routing grouped by expert, and the experts' outputs summed back: the small
steps around the expert kernels, compiled.

Each is a handful of numpy calls (argsort, bincount, cumsum; `np.add.at`) costing several
microseconds apiece on a decode step's few rows, per layer: on a 60-layer model that is
milliseconds a token. Compiled, a call costs about its dispatch.

The results are the numpy versions' exactly: a stable sort, and adds done one at a time in the
given order (no fast-math), so every output row sums its experts in the order the caller chose.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_JIT = {"cache": True, "nogil": True}


@njit(**_JIT)
def group_by_expert(ids):
    """ids [N, k] int64 -> (experts [U] ascending, row_ptr [U + 1], rows [R], picks [R]), R = N*k:
    pair i of expert experts[j] (i in row_ptr[j] .. row_ptr[j + 1] - 1) is routing slot picks[i]
    of ids.reshape(-1), token row rows[i] (ascending within an expert: the sort is stable)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)  # [R]
    picks = np.argsort(flat, kind="mergesort")  # [R] stable
    r = flat.size
    experts, row_ptr, rows = np.empty(r, np.int64), np.empty(r + 1, np.int64), np.empty(r, np.int64)
    u, prev = 0, -1
    for i in range(r):
        p = picks[i]
        e = flat[p]
        rows[i] = p // k
        if e != prev:
            experts[u], row_ptr[u] = e, i
            u += 1
            prev = e
    row_ptr[u] = r
    return experts[:u].copy(), row_ptr[:u + 1].copy(), rows, picks


@njit(**_JIT)
def weigh(ys, weights, picks):
    """ys[i] *= weights[picks[i]] in place (ys [R, d] float32, weights [N*k] float32)."""
    for i in range(ys.shape[0]):
        w = weights[picks[i]]
        for j in range(ys.shape[1]):
            ys[i, j] *= w


@njit(**_JIT)
def scatter_add(out, rows, ys):
    """out[rows[i]] += ys[i] for i = 0, 1, ... in that order (as np.add.at; out [n, d], ys [R, d])."""
    for i in range(rows.size):
        r = rows[i]
        for j in range(ys.shape[1]):
            out[r, j] += ys[i, j]


@njit(**_JIT)
def rows_within(rows, n):
    """Whether every index of rows lies in [0, n) (the kernels index activations unchecked)."""
    for i in range(rows.size):
        if rows[i] < 0 or rows[i] >= n:
            return False
    return True
