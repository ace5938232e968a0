"""One layer call of the CPU experts: its routing grouped by expert (`Routed`), the experts run
in one kernel call (`run_experts`), their weighted outputs summed in ascending expert order
(`combine_rows`). Both CPU backends (resident.QuantResidentExperts, arena.ArenaExperts) go through
here, so a streamed layer's result is the resident one's bit for bit, however its experts arrived.

The small steps around the kernels (grouping, weighting, the scatter-add) are compiled: as numpy
calls (argsort, bincount, cumsum, `np.add.at`) they cost several microseconds apiece on a decode
step's few rows, per layer; on a 60-layer model that is milliseconds a token. Their results are
the numpy versions' exactly: a stable sort, and adds done one at a time in the given order (no
fast-math), so every output row sums its experts in the order the caller chose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from .ffn import ExpertTable, swiglu_rows

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
def select_experts(experts, row_ptr, rows, picks, keep):
    """The grouping (experts [U] ascending, row_ptr, rows, picks) of `group_by_expert` for the
    experts in keep only, and the mask [R] of the pairs kept (one compiled call, ~5 us: numpy's
    isin, repeat and cumsum took ~40, twice a streamed layer with misses)."""
    sel = np.zeros(experts.size, np.bool_)  # [U]
    for e in keep:
        j = np.searchsorted(experts, e)
        if j < experts.size and experts[j] == e:
            sel[j] = True
    pairs = np.zeros(rows.size, np.bool_)  # [R]
    u = r = 0
    for j in range(experts.size):
        if sel[j]:
            u += 1
            r += row_ptr[j + 1] - row_ptr[j]
    out_e, out_ptr = np.empty(u, np.int64), np.empty(u + 1, np.int64)
    out_rows, out_picks = np.empty(r, np.int64), np.empty(r, np.int64)
    u = r = 0
    out_ptr[0] = 0
    for j in range(experts.size):
        if not sel[j]:
            continue
        out_e[u] = experts[j]
        for i in range(row_ptr[j], row_ptr[j + 1]):
            pairs[i] = True
            out_rows[r], out_picks[r] = rows[i], picks[i]
            r += 1
        u += 1
        out_ptr[u] = r
    return out_e, out_ptr, out_rows, out_picks, pairs


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


ROUTE_SOFTMAX, ROUTE_TOPK_SOFTMAX, ROUTE_TOPK_SIGMOID = 0, 1, 2
ROUTE_KINDS = {"softmax": ROUTE_SOFTMAX, "topk_softmax": ROUTE_TOPK_SOFTMAX, "topk_sigmoid": ROUTE_TOPK_SIGMOID}


@njit(**_JIT)
def _top_k(row, k, ids):
    """ids[:k] = the indices of row's k largest values, largest first (ties: the lower index)."""
    taken = np.zeros(row.size, np.bool_)
    for j in range(k):
        best = -1
        for e in range(row.size):
            if not taken[e] and (best < 0 or row[e] > row[best]):
                best = e
        ids[j] = best
        taken[best] = True


@njit(**_JIT)
def route_rows(logits, k, kind, norm, weights, ids):
    """A router's choice for each row of logits [N, E] float32: ids [N, k] int64 (largest
    first) and weights [N, k] float32, as `models.layers`' routing function `kind` computes
    them (ROUTE_*: softmax over all then top-k, renormalized with `norm`; top-k then a softmax
    over those k; top-k each weighted by its sigmoid, renormalized with `norm`)."""
    for r in range(logits.shape[0]):
        row = logits[r]
        _top_k(row, k, ids[r])
        if kind == ROUTE_TOPK_SIGMOID:
            for j in range(k):
                weights[r, j] = np.float32(1.0) / (np.float32(1.0) + np.exp(-row[ids[r, j]]))
        else:
            top = row[ids[r, 0]]  # the largest logit, of the k and of all
            total = np.float32(0.0)
            if kind == ROUTE_SOFTMAX:
                for e in range(row.size):
                    total += np.exp(row[e] - top)
            for j in range(k):
                weights[r, j] = np.exp(row[ids[r, j]] - top)
                if kind == ROUTE_TOPK_SOFTMAX:
                    total += weights[r, j]
            for j in range(k):
                weights[r, j] /= total
        if norm and kind != ROUTE_TOPK_SOFTMAX:
            total = np.float32(0.0)
            for j in range(k):
                total += weights[r, j]
            for j in range(k):
                weights[r, j] /= total


def route(logits: np.ndarray, k: int, kind: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """`route_rows` into new arrays: (weights [N, k] float32, ids [N, k] int64)."""
    weights, ids = np.empty((logits.shape[0], k), np.float32), np.empty((logits.shape[0], k), np.int64)
    route_rows(logits, k, kind, norm, weights, ids)
    return weights, ids


@dataclass(frozen=True)
class Routed:
    """A layer call's routing grouped by expert, as the CPU kernels take it: no per-expert objects.

    experts [U] ascending; pair i of expert experts[j] (i in row_ptr[j] .. row_ptr[j + 1]) is
    token row rows[i] (ascending within an expert) and routing slot picks[i] of ids.reshape(-1).
    """

    experts: np.ndarray  # [U] int64
    row_ptr: np.ndarray  # [U + 1] int64
    rows: np.ndarray  # [R] int64
    picks: np.ndarray  # [R] int64

    @classmethod
    def of(cls, ids: np.ndarray) -> "Routed":
        """From ids [N, k]: one stable sort for the whole layer (compiled: `routing`)."""
        return cls(*group_by_expert(np.ascontiguousarray(ids, np.int64)))

    def only(self, keep: Sequence[int]) -> "Routed":
        """The same routing for the experts `keep` only (those of one arrival batch)."""
        return self if len(keep) == self.experts.size else self.select(keep)[0]

    def select(self, keep: Sequence[int]) -> tuple["Routed", np.ndarray]:
        """`only(keep)` and the mask [R] of the pairs it kept."""
        experts, row_ptr, rows, picks, pairs = select_experts(self.experts, self.row_ptr, self.rows, self.picks,
                                                              np.asarray(keep, np.int64))
        return Routed(experts, row_ptr, rows, picks), pairs


@dataclass(frozen=True)
class ExpertRows:
    """Weighted outputs of a layer call's experts: ys[i] = weight x y of pair i of `routed`."""

    routed: Routed
    ys: np.ndarray  # [R, d] float32

    def without(self, drop: Sequence[int]) -> "ExpertRows":
        """These outputs less those of the experts `drop` (computed from a slot that changed)."""
        if not drop:
            return self
        gone = set(drop)
        routed, pairs = self.routed.select([e for e in self.routed.experts.tolist() if e not in gone])
        return ExpertRows(routed, self.ys[pairs])


def run_experts(x: np.ndarray, r: Routed, weights: np.ndarray, table: ExpertTable,
                act: str = "swiglu") -> ExpertRows:
    """The experts of `r` (`table` holds them, in `r.experts`' order) in one kernel call (two
    parallel regions in all), each output row scaled by its routing weight (weights [N*k]
    float32). Each expert's output is the same bits whichever experts share the call, so
    arrival batches do not matter."""
    ys = swiglu_rows(x, table, r.row_ptr, r.rows, act)  # [R, d]
    weigh(ys, weights, r.picks)  # ys[i] *= weights[picks[i]]
    return ExpertRows(r, ys)


def combine_rows(n: int, d: int, outputs: Sequence[ExpertRows]) -> np.ndarray:
    """Sum the weighted outputs into [n, d], per row in ascending expert order whatever batches
    they came in (resident's one batch and the arena's arrival batches add the same floats in the
    same order: bit-identical)."""
    out = np.zeros((n, d), np.float32)  # [n, d]
    outputs = [o for o in outputs if o.ys.shape[0]]
    if not outputs:
        return out
    if len(outputs) == 1:
        rows, ys = outputs[0].routed.rows, outputs[0].ys
    else:
        expert_of = np.concatenate([np.repeat(o.routed.experts, np.diff(o.routed.row_ptr)) for o in outputs])  # [R]
        order = np.argsort(expert_of, kind="stable")  # [R] expert-major, each expert's rows ascending
        rows = np.concatenate([o.routed.rows for o in outputs])[order]
        ys = np.concatenate([o.ys for o in outputs])[order]
    scatter_add(out, rows, ys)  # in order: out[rows[i]] += ys[i]
    return out


def cpu_inputs(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray, Routed]:
    """What the CPU kernels take of a layer call: x [N, d] and the weights [N*k] as float32
    arrays, and the routing grouped by expert."""
    return _f32(x), _f32(weights).reshape(-1), Routed.of(ids.numpy())  # [N, d], [N*k]


def _f32(t: torch.Tensor) -> np.ndarray:
    """`t` as a C-contiguous float32 array (no conversion calls when it already is one: a decode
    step's tensors are, and each call costs microseconds, per layer)."""
    if t.dtype != torch.float32 or not t.is_contiguous():
        t = t.to(torch.float32).contiguous()
    return t.numpy()
