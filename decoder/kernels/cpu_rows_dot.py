"""Single-pass dot products of one quantized weight row with float32 activation rows.

`dot_rows(qtype, data, off, n_in, xs, tmp, out)` computes out[i] = W_row . xs[i] for one weight
row of `qtype` stored at data[off:], for 1 to 4 activation rows at a time. For the hot types
(Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) a block's codes are decoded into 16-lane vector registers
(cpu_simd) and multiply-added into accumulators held across the whole row: the weight bytes are
read once and no float32 row is written and read back. The weights themselves are the decoders'
(w = d * q, or d * sc * q - dmin * m rounded once); only the order of the sums differs from the
float64 reference (float32, 16 lanes x 2 accumulators, a fixed tree at the end): ~1e-6 of the
output's scale. Every other type decodes the row into `tmp` (its row decoder) and takes the
float dot there.

Bit-identity: a row's sum is the same sequence of IEEE operations whether it was computed alone
or with three other activation rows (the 4-row bodies are the 1-row body with four
accumulators), so a token's result does not depend on which other tokens share its expert.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from numba import njit

from . import cpu_simd as v
from .cpu_rows_base import _JIT, _U

_Q8_0, _Q4_0, _Q4_K, _Q5_K, _Q6_K = int(Q.Q8_0), int(Q.Q4_0), int(Q.Q4_K), int(Q.Q5_K), int(Q.Q6_K)
FUSED = (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)  # types with a single-pass dot here


@njit(**_JIT)
def has_fused(qtype):
    return qtype == _Q8_0 or qtype == _Q4_0 or qtype == _Q4_K or qtype == _Q5_K or qtype == _Q6_K


# -- Q8_0 / Q4_0: one scale per 32 ---------------------------------------------------------------
@njit(**_JIT)
def _q8_0(data, off, n_in, x0, x1, x2, x3, nx, out):
    """nx (1..4) dots of the Q8_0 row at data[off:] with x0..x3 -> out[:nx]."""
    o, e = _U(off), _U(0)
    a0, b0, a1, b1, a2, b2, a3, b3 = v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero()
    for _ in range(n_in // 32):
        d = v.splat(v.f16_at(data, o))
        w0 = v.mul(v.to_f(v.ld_i8(data, o + _U(2))), d)  # elements 0-15 = d * q
        w1 = v.mul(v.to_f(v.ld_i8(data, o + _U(18))), d)  # elements 16-31
        a0, b0 = v.fma(w0, v.ld_f32(x0, e), a0), v.fma(w1, v.ld_f32(x0, e + _U(16)), b0)
        if nx > 1:
            a1, b1 = v.fma(w0, v.ld_f32(x1, e), a1), v.fma(w1, v.ld_f32(x1, e + _U(16)), b1)
        if nx > 2:
            a2, b2 = v.fma(w0, v.ld_f32(x2, e), a2), v.fma(w1, v.ld_f32(x2, e + _U(16)), b2)
        if nx > 3:
            a3, b3 = v.fma(w0, v.ld_f32(x3, e), a3), v.fma(w1, v.ld_f32(x3, e + _U(16)), b3)
        o += _U(34)
        e += _U(32)
    _store(out, nx, a0, b0, a1, b1, a2, b2, a3, b3)


@njit(**_JIT)
def _q4_0(data, off, n_in, x0, x1, x2, x3, nx, out):
    o, e = _U(off), _U(0)
    a0, b0, a1, b1, a2, b2, a3, b3 = v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero()
    for _ in range(n_in // 32):
        d = v.splat(v.f16_at(data, o))
        c = v.ld_u8(data, o + _U(2))  # elements 0-15 in the low nibbles, 16-31 in the high ones
        w0 = v.mul(v.to_f(v.isub(v.iand(c, 15), 8)), d)
        w1 = v.mul(v.to_f(v.isub(v.ishr(c, 4), 8)), d)
        a0, b0 = v.fma(w0, v.ld_f32(x0, e), a0), v.fma(w1, v.ld_f32(x0, e + _U(16)), b0)
        if nx > 1:
            a1, b1 = v.fma(w0, v.ld_f32(x1, e), a1), v.fma(w1, v.ld_f32(x1, e + _U(16)), b1)
        if nx > 2:
            a2, b2 = v.fma(w0, v.ld_f32(x2, e), a2), v.fma(w1, v.ld_f32(x2, e + _U(16)), b2)
        if nx > 3:
            a3, b3 = v.fma(w0, v.ld_f32(x3, e), a3), v.fma(w1, v.ld_f32(x3, e + _U(16)), b3)
        o += _U(18)
        e += _U(32)
    _store(out, nx, a0, b0, a1, b1, a2, b2, a3, b3)


@njit(**_JIT)
def _store(out, nx, a0, b0, a1, b1, a2, b2, a3, b3):
    out[0] = v.hsum(v.add(a0, b0))
    if nx > 1:
        out[1] = v.hsum(v.add(a1, b1))
    if nx > 2:
        out[2] = v.hsum(v.add(a2, b2))
    if nx > 3:
        out[3] = v.hsum(v.add(a3, b3))


# -- K types: 256 per super-block ------------------------------------------------------------------
@njit(**_JIT)
def _fma16(w, x0, x1, x2, x3, nx, e, a0, a1, a2, a3):
    """a_i += w * x_i[e:e + 16] for the first nx activation rows."""
    a0 = v.fma(w, v.ld_f32(x0, e), a0)
    if nx > 1:
        a1 = v.fma(w, v.ld_f32(x1, e), a1)
    if nx > 2:
        a2 = v.fma(w, v.ld_f32(x2, e), a2)
    if nx > 3:
        a3 = v.fma(w, v.ld_f32(x3, e), a3)
    return a0, a1, a2, a3


@njit(**_JIT)
def _k4_scales(data, s, d, dmin, scales):
    """The 12 bytes at data[s:]: 6-bit (scale, min) x 8 -> scales[j] = d * scale, scales[8 + j] =
    -(dmin * min) (ggml's get_scale_min_k4; the min negated for the fma)."""
    for j in range(8):
        if j < 4:
            sc = np.int32(data[s + _U(j)]) & 63
            mn = np.int32(data[s + _U(j + 4)]) & 63
        else:
            hi = np.int32(data[s + _U(j + 4)])
            sc = (hi & 0xF) | ((np.int32(data[s + _U(j - 4)]) >> 6) << 4)
            mn = (hi >> 4) | ((np.int32(data[s + _U(j)]) >> 6) << 4)
        scales[j] = d * np.float32(sc)
        scales[8 + j] = -(dmin * np.float32(mn))


@njit(**_JIT)
def _q45_k(data, off, n_in, x0, x1, x2, x3, nx, out, sc, five):
    """Q4_K (five=False, 144 B) or Q5_K (176 B: 32 B of fifth bits before the nibbles): sub-block
    j (32 values) = nibbles of byte k of chunk j // 2 (low for even j), scaled d*sc_j, less dmin*m_j."""
    o, e = _U(off), _U(0)
    a0, b0, a1, b1, a2, b2, a3, b3 = v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero()
    size = _U(176) if five else _U(144)
    for _ in range(n_in // 256):
        _k4_scales(data, o + _U(4), v.f16_at(data, o), v.f16_at(data, o + _U(2)), sc)
        q = o + _U(48) if five else o + _U(16)
        for j in range(8):  # sub-block j: elements e + 32j ..
            ch = q + _U(32 * (j // 2))
            shift = 4 * (j % 2)
            s, m = v.splat(sc[j]), v.splat(sc[8 + j])
            for t in range(2):  # its 16-lane halves
                c = v.ishr(v.ld_u8(data, ch + _U(16 * t)), shift)
                c = v.iand(c, 15)
                if five:
                    hb = v.iand(v.ishr(v.ld_u8(data, o + _U(16 + 16 * t)), j), 1)
                    c = v.ior(c, v.ishl(hb, 4))
                w = v.fma(v.to_f(c), s, m)
                ex = e + _U(32 * j + 16 * t)
                if t == 0:
                    a0, a1, a2, a3 = _fma16(w, x0, x1, x2, x3, nx, ex, a0, a1, a2, a3)
                else:
                    b0, b1, b2, b3 = _fma16(w, x0, x1, x2, x3, nx, ex, b0, b1, b2, b3)
        o += size
        e += _U(256)
    _store(out, nx, a0, b0, a1, b1, a2, b2, a3, b3)


@njit(**_JIT)
def _q6_k(data, off, n_in, x0, x1, x2, x3, nx, out):
    """Per 128-element half: element 32g + l is nibble g // 2 of ql[32 * (g % 2) + l] with bits
    2g..2g+1 of qh[l] above it, minus 32, scaled by d * int8 scale 2g + l // 16."""
    o, e = _U(off), _U(0)
    a0, b0, a1, b1, a2, b2, a3, b3 = v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero(), v.zero()
    for _ in range(n_in // 256):
        d = v.f16_at(data, o + _U(208))
        for half in range(2):
            ql, qh = o + _U(64 * half), o + _U(128 + 32 * half)
            for s in range(2):  # elements l = 16s .. 16s + 15 of each 32-element group
                la, lb = v.ld_u8(data, ql + _U(16 * s)), v.ld_u8(data, ql + _U(32 + 16 * s))
                h = v.ld_u8(data, qh + _U(16 * s))
                sc = o + _U(192 + 8 * half + s)
                y = e + _U(128 * half + 16 * s)
                for g in range(4):
                    lo = v.iand(la, 15) if g == 0 else v.iand(lb, 15) if g == 1 else v.ishr(la, 4) if g == 2 else v.ishr(lb, 4)
                    c = v.isub(v.ior(lo, v.ishl(v.iand(v.ishr(h, 2 * g), 3), 4)), 32)
                    w = v.mul(v.to_f(c), v.splat(d * np.float32(np.int8(data[sc + _U(2 * g)]))))
                    if s == 0:
                        a0, a1, a2, a3 = _fma16(w, x0, x1, x2, x3, nx, y + _U(32 * g), a0, a1, a2, a3)
                    else:
                        b0, b1, b2, b3 = _fma16(w, x0, x1, x2, x3, nx, y + _U(32 * g), b0, b1, b2, b3)
        o += _U(210)
        e += _U(256)
    _store(out, nx, a0, b0, a1, b1, a2, b2, a3, b3)


@njit(**_JIT)
def fused_dots(qtype, data, off, n_in, x0, x1, x2, x3, nx, out, tmp):
    """out[:nx] = the row of `qtype` (a FUSED type) at data[off:] dotted with x0..x3 (nx of them);
    tmp: float32 scratch of >= 16."""
    if qtype == _Q8_0:
        _q8_0(data, off, n_in, x0, x1, x2, x3, nx, out)
    elif qtype == _Q4_0:
        _q4_0(data, off, n_in, x0, x1, x2, x3, nx, out)
    elif qtype == _Q4_K:
        _q45_k(data, off, n_in, x0, x1, x2, x3, nx, out, tmp, False)
    elif qtype == _Q5_K:
        _q45_k(data, off, n_in, x0, x1, x2, x3, nx, out, tmp, True)
    else:
        _q6_k(data, off, n_in, x0, x1, x2, x3, nx, out)
