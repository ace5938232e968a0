"""Single-pass dot products of one quantized weight row with float32 activation rows.

`fused_dots(qtype, p, off, n_in, x0, x1, x2, x3, nx)` returns W_row . x_i (i < nx, 1 to 4
activation rows; the others 0) for one weight row of `qtype` stored at address p + off, the
activation rows given as the addresses of their float32 values (simd/vectors: no array arguments,
so no reference counting per row). For the hot types
(Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) a block's codes are decoded into 16-lane vector registers
(simd/vectors) and multiply-added into accumulators held across the whole row: the weight bytes are
read once and no float32 row is written and read back. The weights themselves are the decoders'
(w = d * q, or d * sc * q - dmin * m rounded once); only the order of the sums differs from the
float64 reference (float32, 16 lanes x 2 accumulators, a fixed tree at the end): ~1e-6 of the
output's scale. Every other type is decoded into a float32 row by its decoder (rows.py).

Bit-identity: a row's sum is the same sequence of IEEE operations whether it was computed alone
or with three other activation rows (the 4-row bodies are the 1-row body with four
accumulators), so a token's result does not depend on which other tokens share its expert.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from numba import njit

from .simd import vectors as v
from .rows_base import _JIT

_Q8_0, _Q4_0, _Q4_K, _Q5_K, _Q6_K = int(Q.Q8_0), int(Q.Q4_0), int(Q.Q4_K), int(Q.Q5_K), int(Q.Q6_K)
FUSED = (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)  # types with a single-pass dot here


@njit(**_JIT)
def has_fused(qtype):
    return qtype == _Q8_0 or qtype == _Q4_0 or qtype == _Q4_K or qtype == _Q5_K or qtype == _Q6_K


# -- Q8_0 / Q4_0: one scale per 32 ---------------------------------------------------------------
@njit(**_JIT)
def _q8_0(p, off, n_in, x0, x1, x2, x3, nx):
    o, e = np.int64(off), np.int64(0)
    a0, b0, a1, b1, a2, b2, a3, b3 = v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero()
    for _ in range(n_in // 32):
        d = v.splat(v.f16_at(p, o))
        w0 = v.mul(v.to_f(v.ld_i8(p, o + 2)), d)  # elements 0-15 = d * q
        w1 = v.mul(v.to_f(v.ld_i8(p, o + 18)), d)  # elements 16-31
        a0, b0 = v.fma(w0, v.ld_f32(x0, e), a0), v.fma(w1, v.ld_f32(x0, e + 16), b0)
        if nx > 1:
            a1, b1 = v.fma(w0, v.ld_f32(x1, e), a1), v.fma(w1, v.ld_f32(x1, e + 16), b1)
            a2, b2 = v.fma(w0, v.ld_f32(x2, e), a2), v.fma(w1, v.ld_f32(x2, e + 16), b2)
            a3, b3 = v.fma(w0, v.ld_f32(x3, e), a3), v.fma(w1, v.ld_f32(x3, e + 16), b3)
        o += 34
        e += 32
    return _sums(a0, b0, a1, b1, a2, b2, a3, b3)


@njit(**_JIT)
def _q4_0(p, off, n_in, x0, x1, x2, x3, nx):
    o, e = np.int64(off), np.int64(0)
    a0, b0, a1, b1, a2, b2, a3, b3 = v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero()
    for _ in range(n_in // 32):
        d = v.splat(v.f16_at(p, o))
        c = v.ld_u8(p, o + 2)  # elements 0-15 in the low nibbles, 16-31 in the high ones
        w0 = v.mul(v.to_f(v.isub(v.iand(c, 15), 8)), d)
        w1 = v.mul(v.to_f(v.isub(v.ishr(c, 4), 8)), d)
        a0, b0 = v.fma(w0, v.ld_f32(x0, e), a0), v.fma(w1, v.ld_f32(x0, e + 16), b0)
        if nx > 1:
            a1, b1 = v.fma(w0, v.ld_f32(x1, e), a1), v.fma(w1, v.ld_f32(x1, e + 16), b1)
            a2, b2 = v.fma(w0, v.ld_f32(x2, e), a2), v.fma(w1, v.ld_f32(x2, e + 16), b2)
            a3, b3 = v.fma(w0, v.ld_f32(x3, e), a3), v.fma(w1, v.ld_f32(x3, e + 16), b3)
        o += 18
        e += 32
    return _sums(a0, b0, a1, b1, a2, b2, a3, b3)


@njit(**_JIT)
def _sums(a0, b0, a1, b1, a2, b2, a3, b3):
    return v.hsum(v.add(a0, b0)), v.hsum(v.add(a1, b1)), v.hsum(v.add(a2, b2)), v.hsum(v.add(a3, b3))


# -- K types: 256 per super-block ------------------------------------------------------------------
@njit(**_JIT)
def _fma16(w, x0, x1, x2, x3, nx, e, a0, a1, a2, a3):
    """a_i += w * x_i[e:e + 16] (x_i addresses): row 0 always, rows 1-3 when nx > 1."""
    a0 = v.fma(w, v.ld_f32(x0, e), a0)
    if nx > 1:
        a1 = v.fma(w, v.ld_f32(x1, e), a1)
        a2 = v.fma(w, v.ld_f32(x2, e), a2)
        a3 = v.fma(w, v.ld_f32(x3, e), a3)
    return a0, a1, a2, a3


@njit(**_JIT)
def _k4_scale(p, s, j):
    """(scale, min) j of the 12 bytes of 6-bit pairs at address p + s (ggml's get_scale_min_k4)."""
    if j < 4:
        return v.u8_at(p, s + j) & 63, v.u8_at(p, s + j + 4) & 63
    hi = v.u8_at(p, s + j + 4)
    return (hi & 0xF) | ((v.u8_at(p, s + j - 4) >> 6) << 4), (hi >> 4) | ((v.u8_at(p, s + j) >> 6) << 4)


@njit(inline="always", **_JIT)
def _k_pair(p, ch, qh, g, d, dmin, sc, x0, x1, x2, x3, nx, e, a0, a1, a2, a3, b0, b1, b2, b3, five):
    """Q4_K/Q5_K chunk g (32 bytes at ch): sub-block 2g from the low nibbles (elements e ..
    e + 31), 2g + 1 from the high ones (e + 32 ..), [+ 16 * bits 2g, 2g + 1 of qh[k]]."""
    s0, m0 = _k4_scale(p, sc, 2 * g)
    s1, m1 = _k4_scale(p, sc, 2 * g + 1)
    c0, c1 = v.ld_u8(p, ch), v.ld_u8(p, ch + 16)  # bytes 0-15, 16-31
    lo0, lo1, hi0, hi1 = v.iand(c0, 15), v.iand(c1, 15), v.ishr(c0, 4), v.ishr(c1, 4)
    if five:
        h0, h1 = v.ishr(v.ld_u8(p, qh), 2 * g), v.ishr(v.ld_u8(p, qh + 16), 2 * g)
        lo0, lo1 = v.ior(lo0, v.ishl(v.iand(h0, 1), 4)), v.ior(lo1, v.ishl(v.iand(h1, 1), 4))
        hi0, hi1 = v.ior(hi0, v.ishl(v.iand(h0, 2), 3)), v.ior(hi1, v.ishl(v.iand(h1, 2), 3))
    sa, ma = v.splat(d * np.float32(s0)), v.splat(-(dmin * np.float32(m0)))
    sb, mb = v.splat(d * np.float32(s1)), v.splat(-(dmin * np.float32(m1)))
    a0, a1, a2, a3 = _fma16(v.fma(v.to_f(lo0), sa, ma), x0, x1, x2, x3, nx, e, a0, a1, a2, a3)
    b0, b1, b2, b3 = _fma16(v.fma(v.to_f(lo1), sa, ma), x0, x1, x2, x3, nx, e + 16, b0, b1, b2, b3)
    a0, a1, a2, a3 = _fma16(v.fma(v.to_f(hi0), sb, mb), x0, x1, x2, x3, nx, e + 32, a0, a1, a2, a3)
    b0, b1, b2, b3 = _fma16(v.fma(v.to_f(hi1), sb, mb), x0, x1, x2, x3, nx, e + 48, b0, b1, b2, b3)
    return a0, a1, a2, a3, b0, b1, b2, b3


@njit(**_JIT)
def _q45_k(p, off, n_in, x0, x1, x2, x3, nx, five):
    """Q4_K (five=False, 144 B) or Q5_K (176 B: 32 B of fifth bits before the nibbles): sub-block
    j (32 values) = nibbles of byte k of chunk j // 2 (low for even j) [+ 16 * bit j of qh[k]],
    times d * scale_j, less dmin * min_j (one rounding: an fma). The four chunks written out, so
    every shift is a constant."""
    o, e = np.int64(off), np.int64(0)
    a0, b0, a1, b1, a2, b2, a3, b3 = v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero()
    size = 176 if five else 144
    for _ in range(n_in // 256):
        d, dmin = v.f16_at(p, o), v.f16_at(p, o + 2)
        q, qh, sc = (o + 48 if five else o + 16), o + 16, o + 4
        a0, a1, a2, a3, b0, b1, b2, b3 = _k_pair(p, q, qh, 0, d, dmin, sc, x0, x1, x2, x3, nx, e,
                                                 a0, a1, a2, a3, b0, b1, b2, b3, five)
        a0, a1, a2, a3, b0, b1, b2, b3 = _k_pair(p, q + 32, qh, 1, d, dmin, sc, x0, x1, x2, x3, nx, e + 64,
                                                 a0, a1, a2, a3, b0, b1, b2, b3, five)
        a0, a1, a2, a3, b0, b1, b2, b3 = _k_pair(p, q + 64, qh, 2, d, dmin, sc, x0, x1, x2, x3, nx, e + 128,
                                                 a0, a1, a2, a3, b0, b1, b2, b3, five)
        a0, a1, a2, a3, b0, b1, b2, b3 = _k_pair(p, q + 96, qh, 3, d, dmin, sc, x0, x1, x2, x3, nx, e + 192,
                                                 a0, a1, a2, a3, b0, b1, b2, b3, five)
        o += size
        e += 256
    return _sums(a0, b0, a1, b1, a2, b2, a3, b3)


@njit(**_JIT)
def _q6_k(p, off, n_in, x0, x1, x2, x3, nx):
    """Per 128-element half: element 32g + l is nibble g // 2 of ql[32 * (g % 2) + l] with bits
    2g..2g+1 of qh[l] above it, minus 32, times d * int8 scale 2g + l // 16."""
    o, e = np.int64(off), np.int64(0)
    a0, b0, a1, b1, a2, b2, a3, b3 = v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero()
    for _ in range(n_in // 256):
        d = v.f16_at(p, o + 208)
        for half in range(2):
            ql, qh, sc = o + 64 * half, o + 128 + 32 * half, o + 192 + 8 * half
            for s in range(2):  # elements l = 16s .. 16s + 15 of each 32-element group
                la, lb = v.ld_u8(p, ql + 16 * s), v.ld_u8(p, ql + 32 + 16 * s)
                h = v.ld_u8(p, qh + 16 * s)
                y = e + 128 * half + 16 * s
                for g in range(4):
                    nib = v.iand(la if g % 2 == 0 else lb, 15) if g < 2 else v.ishr(la if g % 2 == 0 else lb, 4)
                    c = v.isub(v.ior(nib, v.ishl(v.iand(v.ishr(h, 2 * g), 3), 4)), 32)
                    w = v.mul(v.to_f(c), v.splat(d * np.float32(np.int8(v.u8_at(p, sc + s + 2 * g)))))
                    if s == 0:
                        a0, a1, a2, a3 = _fma16(w, x0, x1, x2, x3, nx, y + 32 * g, a0, a1, a2, a3)
                    else:
                        b0, b1, b2, b3 = _fma16(w, x0, x1, x2, x3, nx, y + 32 * g, b0, b1, b2, b3)
        o += 210
        e += 256
    return _sums(a0, b0, a1, b1, a2, b2, a3, b3)


@njit(**_JIT)
def fused_dots(qtype, p, off, n_in, x0, x1, x2, x3, nx):
    """(W . x0, W . x1, W . x2, W . x3) for the row W of `qtype` (a FUSED type) at address p + off
    and the float32 rows at addresses x0 .. x3: nx = 1 computes x0's alone (the rest 0), any
    other nx all four (the caller repeats a row where it has fewer)."""
    if qtype == _Q8_0:
        return _q8_0(p, off, n_in, x0, x1, x2, x3, nx)
    if qtype == _Q4_0:
        return _q4_0(p, off, n_in, x0, x1, x2, x3, nx)
    if qtype == _Q4_K:
        return _q45_k(p, off, n_in, x0, x1, x2, x3, nx, False)
    if qtype == _Q5_K:
        return _q45_k(p, off, n_in, x0, x1, x2, x3, nx, True)
    return _q6_k(p, off, n_in, x0, x1, x2, x3, nx)
