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
dot products (summed in vector lanes) scaled by 1/sqrt(hd), a max-subtracted softmax (exp on
16 lanes, within 3 ulp) and the value sum.

Attention is split into chunks of CHUNK keys per kv head (flash decoding): a chunk's keys and
values are read from memory once for all the query heads that share them (GQA), and a long
context spreads over the threads; each head's chunks are then joined, rescaled to the largest
score. Every output depends only on its own row (a sequence's token alone or in a batch, on one
thread or many: same bits).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import rows_base  # noqa: F401  (first: the cache stamp covers simd/vectors.py, inlined here)
from .rows import exp16
from .simd import vectors as v
from .simd.integer import f32_at, prefetch_lines

_JIT = {"cache": True, "nogil": True}

QK_NONE, QK_HEAD, QK_FULL = 0, 1, 2  # `AttnShape.qk_norm`: none, per head, over all heads
QK_NORM = {"none": QK_NONE, "head": QK_HEAD, "full": QK_FULL}
ROPE_NEOX, ROPE_NORM = 0, 1  # `AttnShape.rope`
ROPE = {"neox": ROPE_NEOX, "norm": ROPE_NORM}
# Score x value work (sequences x query heads x cached keys x head dim) from which a step's
# attention runs on every thread: below it one thread is faster than waking the others.
PARALLEL_WORK = 1 << 18
# Keys per work item: a sequence's kv head and a chunk of its keys (flash decoding), so long
# contexts spread over the threads and a chunk's keys and values are read once from memory for
# all the query heads that share them. Fixed, not per thread: the bits never depend on threads.
CHUNK = 64


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
    roped, then k and v written to the caches kc, vc [B, Hkv, C, hd] (float32, or float16 as int16
    bits) at index `start`."""
    nq, nk = n_head * hd, n_kv * hd
    for b in range(qkv.shape[0]):
        qs, ks = qkv[b, :nq].copy(), qkv[b, nq:nq + nk].copy()
        if qk_norm == QK_FULL:
            _norm_in_place(qs, qn, eps)
            _norm_in_place(ks, kn, eps)
        for h in range(n_head):
            x = qs[h * hd:(h + 1) * hd]
            if qk_norm == QK_HEAD:
                _norm_in_place(x, qn, eps)
            _rope(x, cos[b], sin[b], style)
            q[b, h] = x
        for g in range(n_kv):
            x = ks[g * hd:(g + 1) * hd]
            if qk_norm == QK_HEAD:
                _norm_in_place(x, kn, eps)
            _rope(x, cos[b], sin[b], style)
            ka, va, v0 = v.addr(kc[b, g, start]), v.addr(vc[b, g, start]), nq + nk + g * hd
            for i in range(hd):
                v.set_row(kc, ka, i, x[i])
                v.set_row(vc, va, i, qkv[b, v0 + i])


@njit(**_JIT)
def _rows4(arr, a, row, i):
    """Elements i .. i + 15 of the 4 rows of `arr`'s type at a, a + row, a + 2 row, a + 3 row."""
    return v.ld_row(arr, a, i), v.ld_row(arr, a + row, i), v.ld_row(arr, a + 2 * row, i), v.ld_row(arr, a + 3 * row, i)


@njit(**_JIT)
def _splat4(pa):
    """The 4 float32 at address pa, each in every lane."""
    return v.splat(f32_at(pa, 0)), v.splat(f32_at(pa, 4)), v.splat(f32_at(pa, 8)), v.splat(f32_at(pa, 12))


@njit(**_JIT)
def _dots4(kc, qa, ka, row, end, sa, s):
    """sa[s .. s + 3] = q . k for the 4 key rows (of kc's type) at ka, ka + row, ... over the
    first `end` (a multiple of 16) dims: per key 16 lanes of fused multiply-adds summed in hsum's
    tree (explicit vectors, so the same bits whatever code it is compiled into, and as one key at a
    time)."""
    a0, a1, a2, a3 = v.zero(), v.zero(), v.zero(), v.zero()
    for i in range(0, end, v.LANES):
        qv = v.ld_f32(qa, i)
        a0 = v.fma(qv, v.ld_row(kc, ka, i), a0)
        a1 = v.fma(qv, v.ld_row(kc, ka + row, i), a1)
        a2 = v.fma(qv, v.ld_row(kc, ka + 2 * row, i), a2)
        a3 = v.fma(qv, v.ld_row(kc, ka + 3 * row, i), a3)
    v.st_hsum4(sa, s, a0, a1, a2, a3)


@njit(**_JIT)
def _dot(kc, qa, ka, end):
    """q . k for one key row (a chunk's last 1 to 3): _dots4's chain and tree."""
    acc = v.zero()
    for i in range(0, end, v.LANES):
        acc = v.fma(v.ld_f32(qa, i), v.ld_row(kc, ka, i), acc)
    return v.hsum(acc)


@njit(**_JIT)
def _dots4x4(kc, qa, qrow, ka, row, end, sa, srow, s):
    """_dots4 for 4 query heads at once (q rows qa, qa + qrow, ...; their scores at sa, sa + srow,
    ...): 16 chains over the 4 heads x 4 keys, 8 loads per 16 fused multiply-adds (one head at a
    time is 5 per 4). Each score's chain and tree are _dots4's: the same bits."""
    z = v.zero()
    a00, a01, a02, a03, a10, a11, a12, a13 = z, z, z, z, z, z, z, z
    a20, a21, a22, a23, a30, a31, a32, a33 = z, z, z, z, z, z, z, z
    for i in range(0, end, v.LANES):
        q0, q1, q2, q3 = v.ld_f32(qa, i), v.ld_f32(qa + qrow, i), v.ld_f32(qa + 2 * qrow, i), v.ld_f32(qa + 3 * qrow, i)
        k0, k1, k2, k3 = _rows4(kc, ka, row, i)
        a00, a01, a02, a03 = v.fma(q0, k0, a00), v.fma(q0, k1, a01), v.fma(q0, k2, a02), v.fma(q0, k3, a03)
        a10, a11, a12, a13 = v.fma(q1, k0, a10), v.fma(q1, k1, a11), v.fma(q1, k2, a12), v.fma(q1, k3, a13)
        a20, a21, a22, a23 = v.fma(q2, k0, a20), v.fma(q2, k1, a21), v.fma(q2, k2, a22), v.fma(q2, k3, a23)
        a30, a31, a32, a33 = v.fma(q3, k0, a30), v.fma(q3, k1, a31), v.fma(q3, k2, a32), v.fma(q3, k3, a33)
    v.st_hsum4(sa, s, a00, a01, a02, a03)
    v.st_hsum4(sa + srow, s, a10, a11, a12, a13)
    v.st_hsum4(sa + 2 * srow, s, a20, a21, a22, a23)
    v.st_hsum4(sa + 3 * srow, s, a30, a31, a32, a33)


@njit(**_JIT)
def _keep(valid, start, c0, n, keep):
    """keep[s] = 1.0 where the chunk's key c0 + s is seen (real, or the query's own), else 0.0;
    0.0 in the spare lanes up to the next 16. Returns whether any key is masked."""
    masked = False
    for s in range(n):
        kept = valid[c0 + s] or c0 + s == start
        keep[s] = np.float32(1.0) if kept else np.float32(0.0)
        masked |= not kept
    for s in range(n, keep.size):
        keep[s] = np.float32(0.0)
    return masked


@njit(**_JIT)
def _scores(q, kc, c0, n, sc, keep, masked):
    """sc[h, s] = q[h] . kc[c0 + s] / sqrt(hd) for the chunk's n keys and each of the query heads
    q [heads, hd], 4 heads x 4 keys at a time; -inf where the key is masked and in the spare lanes
    up to the next 16."""
    heads, hd = q.shape
    vec_end, row, srow = hd - hd % v.LANES, kc.strides[0], sc.strides[0]
    qa, qrow, sa, ka = v.addr(q), q.strides[0], v.addr(sc), v.addr(kc) + np.int64(c0) * row
    h = 0
    while h + 4 <= heads:
        s = 0
        while s + 4 <= n:
            _dots4x4(kc, qa + h * qrow, qrow, ka + s * row, row, vec_end, sa + h * srow, srow, s)
            s += 4
        h += 4
    for h in range(heads - heads % 4, heads):
        s = 0
        while s + 4 <= n:
            _dots4(kc, qa + h * qrow, ka + s * row, row, vec_end, sa + h * srow, s)
            s += 4
    scale = np.float32(1.0 / np.sqrt(hd))
    for h in range(heads):
        for s in range(n - n % 4, n):
            sc[h, s] = _dot(kc, qa + h * qrow, ka + s * row, vec_end)
        if vec_end < hd:  # head dims past the last 16
            for s in range(n):
                for i in range(vec_end, hd):
                    sc[h, s] += q[h, i] * v.row_at(kc, ka + s * row, i)
        for s in range(sc.shape[1]):
            seen = s < n and not (masked and keep[s] == np.float32(0.0))
            sc[h, s] = sc[h, s] * scale if seen else np.float32(-np.inf)


@njit(**_JIT)
def _weights(sc, keep, n):
    """The chunk's softmax numerators in place of its scores, exp(sc - top) (0 where masked),
    16 at a time; returns (top, their sum). top is -inf when every key of the chunk is masked."""
    sa, ka = v.addr(sc), v.addr(keep)
    m = v.ld_f32(sa, 0)
    for s in range(v.LANES, n, v.LANES):  # (sc, keep padded to whole vectors by _scores, _keep)
        m = v.fmax(m, v.ld_f32(sa, s))
    top = v.hmax(m)
    if top == np.float32(-np.inf):
        return top, np.float32(0.0)
    t, total = v.splat(top), v.zero()
    for s in range(0, n, v.LANES):
        p = v.mul(exp16(v.sub(v.ld_f32(sa, s), t)), v.ld_f32(ka, s))
        v.st_f32(sa, s, p)
        total = v.add(total, p)
    return top, v.hsum(total)


@njit(**_JIT)
def _values4(vc, pa, prow, va, row, end, oa, orow):
    """o[h] += p[h, s] * v[s] for 4 heads (p at pa, pa + prow, ...; o at oa, oa + orow, ...) and
    the 4 keys at va, va + row, ...: per head the keys' fused multiply-adds in key order, as
    _values does one head at a time (the same bits), 8 loads per 16."""
    p00, p01, p02, p03 = _splat4(pa)
    p10, p11, p12, p13 = _splat4(pa + prow)
    p20, p21, p22, p23 = _splat4(pa + 2 * prow)
    p30, p31, p32, p33 = _splat4(pa + 3 * prow)
    for i in range(0, end, v.LANES):
        v0, v1, v2, v3 = _rows4(vc, va, row, i)
        o = v.ld_f32(oa, i)
        v.st_f32(oa, i, v.fma(p03, v3, v.fma(p02, v2, v.fma(p01, v1, v.fma(p00, v0, o)))))
        o = v.ld_f32(oa + orow, i)
        v.st_f32(oa + orow, i, v.fma(p13, v3, v.fma(p12, v2, v.fma(p11, v1, v.fma(p10, v0, o)))))
        o = v.ld_f32(oa + 2 * orow, i)
        v.st_f32(oa + 2 * orow, i, v.fma(p23, v3, v.fma(p22, v2, v.fma(p21, v1, v.fma(p20, v0, o)))))
        o = v.ld_f32(oa + 3 * orow, i)
        v.st_f32(oa + 3 * orow, i, v.fma(p33, v3, v.fma(p32, v2, v.fma(p31, v1, v.fma(p30, v0, o)))))


@njit(**_JIT)
def _values1(vc, pa, va, row, end, oa, keys):
    """o += p[s] * v[s] for one head and `keys` (1 to 4) keys, in key order."""
    if keys == 4:
        p0, p1, p2, p3 = _splat4(pa)
        for i in range(0, end, v.LANES):
            v0, v1, v2, v3 = _rows4(vc, va, row, i)
            v.st_f32(oa, i, v.fma(p3, v3, v.fma(p2, v2, v.fma(p1, v1, v.fma(p0, v0, v.ld_f32(oa, i))))))
        return
    for k in range(keys):
        ps, ks = v.splat(f32_at(pa, 4 * k)), va + k * row
        for i in range(0, end, v.LANES):
            v.st_f32(oa, i, v.fma(ps, v.ld_row(vc, ks, i), v.ld_f32(oa, i)))


@njit(**_JIT)
def _values(p, vc, c0, n, o):
    """o [heads, hd] = sum over the chunk's keys s of p[h, s] * vc[c0 + s], in key order: 16 lanes
    of o at a time, chains of fused multiply-adds through memory (a chunk's values stay in L1),
    4 heads x 4 keys at a time."""
    heads, hd = o.shape
    vec_end, row, prow, orow = hd - hd % v.LANES, vc.strides[0], p.strides[0], o.strides[0]
    va, pa, oa = v.addr(vc) + np.int64(c0) * row, v.addr(p), v.addr(o)
    o[:] = np.float32(0.0)
    for s in range(0, n, 4):
        keys, h = min(4, n - s), 0
        while keys == 4 and h + 4 <= heads:
            _values4(vc, pa + h * prow + 4 * s, prow, va + s * row, row, vec_end, oa + h * orow, orow)
            h += 4
        for h in range(h, heads):
            _values1(vc, pa + h * prow + 4 * s, va + s * row, row, vec_end, oa + h * orow, keys)
    if vec_end < hd:  # head dims past the last 16
        for h in range(heads):
            for i in range(vec_end, hd):
                for s in range(n):
                    o[h, i] += p[h, s] * v.row_at(vc, va + s * row, i)


@njit(**_JIT)
def _item(item, n_kv, n_chunk, start):
    """Work item `item`'s sequence b, kv head g, chunk c, first key c0 and key count n."""
    b, g, c = item // (n_kv * n_chunk), item // n_chunk % n_kv, item % n_chunk
    c0 = c * CHUNK
    return b, g, c, c0, min(CHUNK, start + 1 - c0)


@njit(**_JIT)
def _prefetch_chunk(item, kc, vc, start, n_kv, n_chunk):
    """Ask for the cache lines of work item `item`'s keys and values: they arrive while this item
    computes (a chunk's rows are contiguous; without it every chunk began with a memory wait)."""
    b, g, _, c0, n = _item(item, n_kv, n_chunk, start)
    row = kc.strides[2]
    prefetch_lines(v.addr(kc[b, g]), np.int64(c0) * row, n * row)
    prefetch_lines(v.addr(vc[b, g]), np.int64(c0) * vc.strides[2], (n - 1) * vc.strides[2] + vc.shape[3] * vc.itemsize)


@njit(**_JIT)
def _chunk(item, q, kc, vc, valid, start, rep, tops, sums, parts):
    """Work item `item` = (sequence b, kv head g, key chunk c): for each of g's rep query heads,
    the chunk's softmax top, numerator sum and unnormalized value sum (tops, sums [B, Hkv, n_chunk,
    rep], parts [..., hd])."""
    n_kv, n_chunk = tops.shape[1], tops.shape[2]
    b, g, c, c0, n = _item(item, n_kv, n_chunk, start)
    if item + 1 < tops.shape[0] * n_kv * n_chunk:  # the next item's keys and values (the same thread's, mostly)
        _prefetch_chunk(item + 1, kc, vc, start, n_kv, n_chunk)
    sc = np.empty((rep, CHUNK + v.LANES), np.float32)  # [rep, keys]: scores, then softmax numerators
    keep = np.empty(CHUNK + v.LANES, np.float32)
    masked = _keep(valid[b], start, c0, n, keep)
    _scores(q[b, g * rep:(g + 1) * rep], kc[b, g], c0, n, sc, keep, masked)
    for r in range(rep):
        tops[b, g, c, r], sums[b, g, c, r] = _weights(sc[r], keep, n)
    _values(sc, vc[b, g], c0, n, parts[b, g, c])


@njit(**_JIT)
def _combine(tops, sums, parts, out):
    """out [B, H hd]: each head's chunks joined (flash decoding): sums and value sums rescaled to
    the largest top, in chunk order, then divided."""
    B, n_kv, n_chunk, rep = tops.shape
    hd = parts.shape[-1]
    for b in range(B):
        for g in range(n_kv):
            for r in range(rep):
                dst = out[b, (g * rep + r) * hd:(g * rep + r + 1) * hd]
                if n_chunk == 1:  # one chunk (its own top): no rescaling
                    inv = np.float32(1.0) / sums[b, g, 0, r]
                    part = parts[b, g, 0, r]
                    for i in range(hd):
                        dst[i] = part[i] * inv
                    continue
                top = np.float32(-np.inf)
                for c in range(n_chunk):
                    top = max(top, tops[b, g, c, r])
                total = np.float32(0.0)
                dst[:] = np.float32(0.0)
                for c in range(n_chunk):
                    if tops[b, g, c, r] == np.float32(-np.inf):
                        continue  # every key of the chunk masked: it adds nothing
                    f = np.float32(np.exp(tops[b, g, c, r] - top))  # 1 for the top chunk
                    total += f * sums[b, g, c, r]
                    part = parts[b, g, c, r]
                    for i in range(hd):
                        dst[i] += f * part[i]
                inv = np.float32(1.0) / total
                for i in range(hd):
                    dst[i] *= inv


@njit(**_JIT)
def _partials(qkv, n_head, n_kv, hd, start):
    n_chunk = start // CHUNK + 1
    shape = (qkv.shape[0], n_kv, n_chunk, n_head // n_kv)
    return (np.empty((qkv.shape[0], n_head, hd), np.float32), np.empty(shape, np.float32),
            np.empty(shape, np.float32), np.empty(shape + (hd,), np.float32))


@njit(**_JIT)
def _decode_attention(qkv, n_head, n_kv, hd, qn, kn, qk_norm, eps, cos, sin, style, kc, vc, valid, start, out):
    q, tops, sums, parts = _partials(qkv, n_head, n_kv, hd, start)  # [B, H, hd], [B, Hkv, chunks, rep] x2, [.., hd]
    _prepare(qkv, n_head, n_kv, hd, qn, kn, qk_norm, eps, cos, sin, style, kc, vc, start, q)
    for item in range(tops.shape[0] * tops.shape[1] * tops.shape[2]):
        _chunk(item, q, kc, vc, valid, start, n_head // n_kv, tops, sums, parts)
    _combine(tops, sums, parts, out)


@njit(parallel=True, **_JIT)
def _decode_attention_par(qkv, n_head, n_kv, hd, qn, kn, qk_norm, eps, cos, sin, style, kc, vc, valid, start, out):
    q, tops, sums, parts = _partials(qkv, n_head, n_kv, hd, start)
    _prepare(qkv, n_head, n_kv, hd, qn, kn, qk_norm, eps, cos, sin, style, kc, vc, start, q)
    for item in prange(tops.shape[0] * tops.shape[1] * tops.shape[2]):
        _chunk(item, q, kc, vc, valid, start, n_head // n_kv, tops, sums, parts)
    _combine(tops, sums, parts, out)


def decode_attention(qkv: np.ndarray, n_head: int, n_kv: int, hd: int, qn: np.ndarray, kn: np.ndarray,
                     qk_norm: int, eps: float, cos: np.ndarray, sin: np.ndarray, style: int, kc: np.ndarray,
                     vc: np.ndarray, valid: np.ndarray, start: int) -> np.ndarray:
    """Attention of one new token per sequence: qkv [B, (H + 2 Hkv) hd] float32 (the q, k, v
    projections side by side), rope tables cos/sin [B, rope_dim], caches kc/vc [B, Hkv, C, hd]
    float32, or float16 as int16 bits (this token's k and v are written at `start`), valid
    [B, C] bool (the cache's real tokens; a token always sees itself). q/k norm weights qn/kn ([hd] per head, [H hd] / [Hkv hd] over
    all heads, ignored with QK_NONE). Returns [B, H hd]: head h used kv head h // (H / Hkv)."""
    for c in (kc, vc):
        if c.dtype not in (np.float32, np.int16) or c.strides[-1] != c.itemsize:
            raise ValueError("the key and value caches' rows must be contiguous float32, or float16 as int16 bits")
    out = np.empty((qkv.shape[0], n_head * hd), np.float32)  # [B, H*hd]
    work = qkv.shape[0] * n_head * (start + 1) * hd
    run = _decode_attention_par if work >= PARALLEL_WORK else _decode_attention
    run(qkv, n_head, n_kv, hd, qn, kn, qk_norm, eps, cos, sin, style, kc, vc, valid, start, out)
    return out
