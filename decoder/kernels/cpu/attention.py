"""The small per-layer steps of a CPU forward pass, compiled: RMSNorm over rows, and a decode
step's attention (one new token per sequence) from its q/k/v projections to the heads' outputs.

Why: on a decode step each of these is a few microseconds of arithmetic, but as torch ops
they are tens of microseconds apiece (dispatch, temporaries, a cold instruction cache after
kernels streamed megabytes): measured on 2 cores, 16 layers of a 1024-wide qwen3moe, RMSNorm
cost 55-70 us a call in situ (33 a token) and a layer's attention glue (q/k norm, rope, the
cache write, SDPA, reshapes) 300-500 us, against ~1.1 ms for the layer's experts. Prefill
chunks (many rows) keep torch's ops, which are efficient at that size.

Results equal torch's up to float32 rounding (the model tests hold the decode path to the
whole-prompt torch path within 1e-4): RMSNorm sums squares in float32 as F.rms_norm does,
rope is computed element by element as `x * cos + rotated * sin`, attention scores are float32
dot products (summed in vector lanes) scaled by 1/sqrt(hd), a max-subtracted softmax, and the
value sum.
Every output depends only on its own row (a sequence's token alone or in a batch: same bits).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import rows_base  # noqa: F401  (first: the cache stamp covers simd/vectors.py, inlined here)
from .simd import vectors as v

_JIT = {"cache": True, "nogil": True}

QK_NONE, QK_HEAD, QK_FULL = 0, 1, 2  # `AttnShape.qk_norm`: none, per head, over all heads
QK_NORM = {"none": QK_NONE, "head": QK_HEAD, "full": QK_FULL}
ROPE_NEOX, ROPE_NORM = 0, 1  # `AttnShape.rope`
ROPE = {"neox": ROPE_NEOX, "norm": ROPE_NORM}
# Score x value work (sequences x query heads x cached keys x head dim) from which a step's
# attention runs on every thread: below it one thread is faster than waking the others.
PARALLEL_WORK = 1 << 21


@njit(**_JIT)
def _rms_scale(x, eps):
    """1 / sqrt(mean(x^2) + eps) for a float32 vector, summed in float32."""
    acc = np.float32(0.0)
    for i in range(x.size):
        acc += x[i] * x[i]
    return np.float32(1.0) / np.sqrt(acc / np.float32(x.size) + np.float32(eps))


@njit(**_JIT)
def rms_norm_rows(x, w, eps):
    """x[r] / rms(x[r]) * w for every row of x [N, n] float32 (w [n]): a new [N, n] array."""
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        s = _rms_scale(x[r], eps)
        for i in range(x.shape[1]):
            out[r, i] = x[r, i] * s * w[i]
    return out


@njit(**_JIT)
def _norm_in_place(v, w, eps):
    s = _rms_scale(v, eps)
    for i in range(v.size):
        v[i] = v[i] * s * w[i]


@njit(**_JIT)
def _rope(v, cos, sin, style):
    """Rope of `style` on the first cos.size dims of v, in place: v * cos + rotated(v) * sin."""
    rd = cos.size
    half = rd // 2
    if style == ROPE_NEOX:  # dims i and i + rd/2 rotate together
        for i in range(half):
            a, b = v[i], v[i + half]
            v[i] = a * cos[i] + -b * sin[i]
            v[i + half] = b * cos[i + half] + a * sin[i + half]
    else:  # llama.cpp's normal rope: dims 2i and 2i + 1
        for i in range(half):
            a, b = v[2 * i], v[2 * i + 1]
            v[2 * i] = a * cos[2 * i] + -b * sin[2 * i]
            v[2 * i + 1] = b * cos[2 * i + 1] + a * sin[2 * i + 1]


@njit(**_JIT)
def _prepare(qkv, n_head, n_kv, hd, qn, kn, qk_norm, eps, cos, sin, style, kc, vc, start, q):
    """Sequence rows of qkv [B, (H + 2 Hkv) hd]: q [B, H, hd] normed and roped; k normed and
    roped, then k and v written to the caches kc, vc [B, Hkv, C, hd] at index `start`."""
    nq, nk = n_head * hd, n_kv * hd
    for b in range(qkv.shape[0]):
        qs, ks = qkv[b, :nq].copy(), qkv[b, nq:nq + nk].copy()
        if qk_norm == QK_FULL:
            _norm_in_place(qs, qn, eps)
            _norm_in_place(ks, kn, eps)
        for h in range(n_head):
            v = qs[h * hd:(h + 1) * hd]
            if qk_norm == QK_HEAD:
                _norm_in_place(v, qn, eps)
            _rope(v, cos[b], sin[b], style)
            q[b, h] = v
        for g in range(n_kv):
            v = ks[g * hd:(g + 1) * hd]
            if qk_norm == QK_HEAD:
                _norm_in_place(v, kn, eps)
            _rope(v, cos[b], sin[b], style)
            kc[b, g, start] = v
            vc[b, g, start] = qkv[b, nq + nk + g * hd:nq + nk + (g + 1) * hd]


@njit(**_JIT)
def _dot(qa, ka, end):
    """q . k over the first `end` (a multiple of 16) float32 at addresses qa, ka: 16 lanes of
    fused multiply-adds summed in a fixed tree (explicit vectors, so the same bits whatever code
    it is compiled into: fast-math would let each caller's copy sum in its own order)."""
    acc = v.zero()
    for i in range(0, end, v.LANES):
        acc = v.fma(v.ld_f32(qa, i), v.ld_f32(ka, i), acc)
    return v.hsum(acc)


@njit(**_JIT)
def _head(q, kc, vc, valid, start, scale, scores, out):
    """One query head over its kv head's cache: keys 0 .. start that are real (valid) or the
    query's own; out [hd] = softmax(q . k * scale) . v. Masked keys score -inf (weight 0), so
    the loops run branch-free over the keys; values are added 4 keys at a time (a quarter of
    the passes over out). q and kc's rows contiguous."""
    hd, n = q.size, start + 1
    vec_end, qa, ka, row = hd - hd % v.LANES, v.addr(q), v.addr(kc), kc.strides[0]
    for s in range(n):
        acc = _dot(qa, ka + s * row, vec_end)
        for i in range(vec_end, hd):
            acc += q[i] * kc[s, i]
        scores[s] = acc * scale if valid[s] or s == start else np.float32(-np.inf)
    top = np.float32(-np.inf)
    for s in range(n):
        top = max(top, scores[s])
    total = np.float32(0.0)
    for s in range(n):
        p = np.exp(scores[s] - top)  # [n] the weights, in place of the scores
        scores[s] = p
        total += p
    for i in range(hd):
        out[i] = np.float32(0.0)
    s = 0
    while s + 4 <= n:
        p0, p1, p2, p3 = scores[s], scores[s + 1], scores[s + 2], scores[s + 3]
        for i in range(hd):
            out[i] += p0 * vc[s, i] + p1 * vc[s + 1, i] + p2 * vc[s + 2, i] + p3 * vc[s + 3, i]
        s += 4
    for t in range(s, n):
        for i in range(hd):
            out[i] += scores[t] * vc[t, i]
    inv = np.float32(1.0) / total
    for i in range(hd):
        out[i] *= inv


@njit(**_JIT)
def _decode_attention(qkv, n_head, n_kv, hd, qn, kn, qk_norm, eps, cos, sin, style, kc, vc, valid, start, out):
    q = np.empty((qkv.shape[0], n_head, hd), np.float32)  # [B, H, hd]
    _prepare(qkv, n_head, n_kv, hd, qn, kn, qk_norm, eps, cos, sin, style, kc, vc, start, q)
    scale, rep = np.float32(1.0 / np.sqrt(hd)), n_head // n_kv
    scores = np.empty(start + 1, np.float32)
    for b in range(qkv.shape[0]):
        for h in range(n_head):
            _head(q[b, h], kc[b, h // rep], vc[b, h // rep], valid[b], start, scale, scores, out[b, h * hd:(h + 1) * hd])


@njit(parallel=True, **_JIT)
def _decode_attention_par(qkv, n_head, n_kv, hd, qn, kn, qk_norm, eps, cos, sin, style, kc, vc, valid, start, out):
    q = np.empty((qkv.shape[0], n_head, hd), np.float32)  # [B, H, hd]
    _prepare(qkv, n_head, n_kv, hd, qn, kn, qk_norm, eps, cos, sin, style, kc, vc, start, q)
    scale, rep, n = np.float32(1.0 / np.sqrt(hd)), n_head // n_kv, qkv.shape[0] * n_head
    for j in prange(n):
        b, h = j // n_head, j % n_head
        scores = np.empty(start + 1, np.float32)
        _head(q[b, h], kc[b, h // rep], vc[b, h // rep], valid[b], start, scale, scores, out[b, h * hd:(h + 1) * hd])


def decode_attention(qkv: np.ndarray, n_head: int, n_kv: int, hd: int, qn: np.ndarray, kn: np.ndarray,
                     qk_norm: int, eps: float, cos: np.ndarray, sin: np.ndarray, style: int, kc: np.ndarray,
                     vc: np.ndarray, valid: np.ndarray, start: int) -> np.ndarray:
    """Attention of one new token per sequence: qkv [B, (H + 2 Hkv) hd] float32 (the q, k, v
    projections side by side), rope tables cos/sin [B, rope_dim], caches kc/vc [B, Hkv, C, hd]
    (this token's k and v are written at `start`), valid [B, C] bool (the cache's real tokens;
    a token always sees itself). q/k norm weights qn/kn ([hd] per head, [H hd] / [Hkv hd] over
    all heads, ignored with QK_NONE). Returns [B, H hd]: head h used kv head h // (H / Hkv)."""
    if kc.strides[-1] != 4:
        raise ValueError("the key cache's rows must be contiguous float32")
    out = np.empty((qkv.shape[0], n_head * hd), np.float32)  # [B, H*hd]
    work = qkv.shape[0] * n_head * (start + 1) * hd
    run = _decode_attention_par if work >= PARALLEL_WORK else _decode_attention
    run(qkv, n_head, n_kv, hd, qn, kn, qk_norm, eps, cos, sin, style, kc, vc, valid, start, out)
    return out
