"""Integer dot products of one quantized weight row with int8-quantized activation rows.

The float kernels (cpu_rows_dot.py, cpu_rows.py's decoders) turn every weight into a float32
and multiply-add it: for the 1-4 bit types that decoding, not the memory, set the speed. Here,
as llama.cpp does, each activation row is quantized once per call (`quantize_acts`) and a
weight sub-block of 32 codes meets its 32 activation bytes in one integer `dpbusd`
(cpu_simd_int: u8 x s8 -> 8 int32 lanes); floats appear once per sub-block, for its scales.

Activation format (per row of n values, n a multiple of 32), `Acts`:
  q  int8  [n]       round(x / d_b), |q| <= 127, block b = elements 32b .. 32b + 31
  d  float [n / 32]  d_b = max |x| over block b / 127
  s  int32 [n / 16]  sums of q over each 16 elements (for weight offsets and K-quant mins)
Blocks of 32, not llama.cpp's 256-wide Q8_K: every type's sub-blocks are 32 (or 16) weights,
a float per sub-block is as cheap as an integer scale multiply, and an outlier only coarsens
its own 32 activations.

Weights as unsigned bytes (dpbusd's u8 side), per type, for sub-block j with weight scale c_j:
  Q8_0     |q| with the activation's signs flipped where q < 0 (psignb)      c = d
  Q4_0     nibble n, w = d (n - 8)            : c = d, offset -8 d x sum(a)
  Q4_K/Q5_K  n (+16 x fifth bit), w = d sc n - dmin m: c = d sc, offset -dmin m x sum(a)
  Q6_K     q in 0..63, w = d sc (q - 32)       : c per 16 weights, offset -32 c x sum(a)
  IQ2_XXS  grid bytes (<= 43), signs applied to the activation bytes        c = d (0.5 + s) / 4
  IQ1_S    grid + 1 (0..2), w = dl (g + delta) : c = dl, offset dl (delta - 1) x sum(a)
  TQ2_0    q in 0..2, w = d (q - 1)            : c = d, offset -d x sum(a)
A row's result is, per activation row, sum_j c_j d_a,j (W_j . q_j) plus the offsets: the same
real number as the dequantized weights (gguf-py's) dotted with the dequantized int8 activation,
up to float32 rounding of the scales and the sums (8 lanes, a fixed tree at the end). Every
activation row runs the same operations whether alone or one of four, so a token's result
does not depend on the other rows sharing its expert, nor on the thread count.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from numba import njit

from . import cpu_simd_int as s
from .cpu_rows_base import _JIT, _U
from .cpu_rows_dot import _k4_scale
from .cpu_rows_iq import GRID64_IQ2_XXS, GRID_IQ1_S, KSIGNS
from .cpu_simd import addr, f16_at, u8_at

_Q8_0, _Q4_0, _Q4_K, _Q5_K, _Q6_K = int(Q.Q8_0), int(Q.Q4_0), int(Q.Q4_K), int(Q.Q5_K), int(Q.Q6_K)
_IQ2_XXS, _IQ1_S, _TQ2_0 = int(Q.IQ2_XXS), int(Q.IQ1_S), int(Q.TQ2_0)
INT_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.IQ1_S, Q.TQ2_0)
_INL = {**_JIT, "inline": "always"}
# IQ1_S's code book {-1, 0, 1} plus one, as unsigned bytes: 8 per index, one uint64 per group
GRID64_IQ1_S_P1 = (GRID_IQ1_S.astype(np.int16) + 1).astype(np.uint8).view(np.uint64)  # [2048]
KSIGNS32 = KSIGNS.astype(np.int64)  # [128] 7 sign bits -> 8 (the 8th: even count of minus signs)
_F0, _EIGHTH = np.float32(0.0), np.float32(0.125)


@njit(**_JIT)
def has_int(qtype):
    return (qtype == _Q8_0 or qtype == _Q4_0 or qtype == _Q4_K or qtype == _Q5_K or qtype == _Q6_K
            or qtype == _IQ2_XXS or qtype == _IQ1_S or qtype == _TQ2_0)


# -- activations ---------------------------------------------------------------------------------
@njit(**_JIT)
def quantize_acts(x):
    """x [N, n] float32 (n % 32 == 0) -> (q int8 [N, n], d float32 [N, n/32], s int32 [N, n/16])."""
    n_rows, n = x.shape
    q = np.empty((n_rows, n), np.int8)
    d = np.empty((n_rows, n // 32), np.float32)
    sums = np.empty((n_rows, n // 16), np.int32)
    for r in range(n_rows):
        for b in range(n // 32):
            amax = np.float32(0.0)
            for k in range(32):
                amax = max(amax, abs(x[r, 32 * b + k]))
            d[r, b] = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            for h in range(2):
                t = np.int32(0)
                for k in range(16):
                    v = np.int32(np.rint(x[r, 32 * b + 16 * h + k] * inv))
                    v = min(np.int32(127), max(np.int32(-127), v))
                    q[r, 32 * b + 16 * h + k] = v
                    t += v
                sums[r, 2 * b + h] = t
    return q, d, sums


# -- two 32-weight sub-blocks against 1 or 4 activation rows -------------------------------------
# Sub-blocks go in pairs, A and B: acc += float(A . a) cA + float(B . a) cB, so each accumulator
# waits for one add per pair (one fma per sub-block made the fma latency the bound).
# R = (q addresses of rows 0-3, d addresses 0-3, s addresses 0-3); e = a sub-block's element.
# The activation bytes are used as they are (mode 0), with the signs of the int8 weights w
# (mode 1: the weights' magnitudes are the unsigned side), or negated where `bits` is set (2).
@njit(**_INL)
def _da(R, i, e):
    return s.f32_at(R[4 + i], (e >> 5) * 4)


@njit(**_INL)
def _sum16(R, i, e):
    return np.float32(s.i32_at(R[8 + i], (e >> 4) * 4))


@njit(**_INL)
def _dp(u, a):
    return s.dpbusd(s.i8_zero(), u, a)


@njit(**_INL)
def _act(R, i, e, mode, w, bits):
    a = s.ld_b(R[i], e)
    if mode == 1:
        return s.b_sign(a, w)
    if mode == 2:
        return s.b_neg_where(a, bits)
    return a


@njit(**_INL)
def _row2(i, R, uA, uB, cA, cB, eA, eB, mode, wA, wB, bA, bB, acc):
    aA, aB = _act(R, i, eA, mode, wA, bA), _act(R, i, eB, mode, wB, bB)
    t = s.f8_fma_i(_dp(uB, aB), cB * _da(R, i, eB), s.f8_mul_i(_dp(uA, aA), cA * _da(R, i, eA)))
    return s.f8_add(acc, t)


@njit(**_INL)
def _pair(uA, uB, cA, cB, eA, eB, mode, wA, wB, bA, bB, nx, R, c0, c1, c2, c3):
    """c_i += (A . a_i[eA:]) cA d_a + (B . a_i[eB:]) cB d_a for the unsigned weight bytes uA, uB."""
    c0 = _row2(0, R, uA, uB, cA, cB, eA, eB, mode, wA, wB, bA, bB, c0)
    if nx > 1:
        c1 = _row2(1, R, uA, uB, cA, cB, eA, eB, mode, wA, wB, bA, bB, c1)
        c2 = _row2(2, R, uA, uB, cA, cB, eA, eB, mode, wA, wB, bA, bB, c2)
        c3 = _row2(3, R, uA, uB, cA, cB, eA, eB, mode, wA, wB, bA, bB, c3)
    return c0, c1, c2, c3


@njit(**_INL)
def _row2_16(i, R, uA, uB, cA0, cA1, cB0, cB1, eA, eB, acc):
    dA, dB = _da(R, i, eA), _da(R, i, eB)
    t = s.f8_fma_i2(_dp(uB, s.ld_b(R[i], eB)), cB0 * dB, cB1 * dB,
                    s.f8_mul_i2(_dp(uA, s.ld_b(R[i], eA)), cA0 * dA, cA1 * dA))
    return s.f8_add(acc, t)


@njit(**_INL)
def _pair16(uA, uB, cA0, cA1, cB0, cB1, eA, eB, nx, R, c0, c1, c2, c3):
    """As _pair with a weight scale per 16 weights (cA0 for A's first 16, cA1 for its last)."""
    c0 = _row2_16(0, R, uA, uB, cA0, cA1, cB0, cB1, eA, eB, c0)
    if nx > 1:
        c1 = _row2_16(1, R, uA, uB, cA0, cA1, cB0, cB1, eA, eB, c1)
        c2 = _row2_16(2, R, uA, uB, cA0, cA1, cB0, cB1, eA, eB, c2)
        c3 = _row2_16(3, R, uA, uB, cA0, cA1, cB0, cB1, eA, eB, c3)
    return c0, c1, c2, c3


@njit(**_INL)
def _cor_one(R, i, e, cm0, cm1):
    """d_a (cm0 x the sum of a_i[e:e+16] + cm1 x that of a_i[e+16:e+32])."""
    return _da(R, i, e) * (cm0 * _sum16(R, i, e) + cm1 * _sum16(R, i, e + 16))


@njit(**_INL)
def _cor(cmA0, cmA1, cmB0, cmB1, eA, eB, nx, R, m0, m1, m2, m3):
    """m_i += the weight offsets (or mins) times the activations' sums, for sub-blocks A and B
    (per 16 activations: cmA0 for A's first 16, ...)."""
    m0 += _cor_one(R, 0, eA, cmA0, cmA1) + _cor_one(R, 0, eB, cmB0, cmB1)
    if nx > 1:
        m1 += _cor_one(R, 1, eA, cmA0, cmA1) + _cor_one(R, 1, eB, cmB0, cmB1)
        m2 += _cor_one(R, 2, eA, cmA0, cmA1) + _cor_one(R, 2, eB, cmB0, cmB1)
        m3 += _cor_one(R, 3, eA, cmA0, cmA1) + _cor_one(R, 3, eB, cmB0, cmB1)
    return m0, m1, m2, m3


@njit(**_INL)
def _fin(c0, c1, c2, c3, m0, m1, m2, m3):
    return s.f8_hsum(c0) + m0, s.f8_hsum(c1) + m1, s.f8_hsum(c2) + m2, s.f8_hsum(c3) + m3


@njit(**_INL)
def _zeros():
    return s.f8_zero(), s.f8_zero(), s.f8_zero(), s.f8_zero(), _F0, _F0, _F0, _F0


_NB = np.int64(0)  # no sign bits


# -- types ---------------------------------------------------------------------------------------
@njit(**_JIT)
def _q8_0(p, off, n_in, R, nx):
    """34 B / 32: f16 d, int8 q[32]. Blocks in pairs; an odd last block pairs with itself at
    scale 0 (the same operations, so a row's result never depends on the block count's parity)."""
    o, nb = np.int64(off), n_in // 32
    c0, c1, c2, c3, m0, m1, m2, m3 = _zeros()
    for b in range(0, nb, 2):
        wA, dA = s.ld_b(p, o + 2), f16_at(p, o)
        last = b + 1 == nb
        wB = wA if last else s.ld_b(p, o + 36)
        dB = _F0 if last else f16_at(p, o + 34)
        eB = 32 * b if last else 32 * b + 32
        c0, c1, c2, c3 = _pair(s.b_abs(wA), s.b_abs(wB), dA, dB, 32 * b, eB, 1, wA, wB, _NB, _NB,
                               nx, R, c0, c1, c2, c3)
        o += 68
    return _fin(c0, c1, c2, c3, m0, m1, m2, m3)


@njit(**_JIT)
def _q4_0(p, off, n_in, R, nx):
    """18 B / 32: f16 d, 16 B nibbles (elements 0-15 low, 16-31 high): w = d (n - 8)."""
    o, nb = np.int64(off), n_in // 32
    c0, c1, c2, c3, m0, m1, m2, m3 = _zeros()
    for b in range(0, nb, 2):
        uA, dA = s.nib16(p, o + 2), f16_at(p, o)
        last = b + 1 == nb
        uB = uA if last else s.nib16(p, o + 20)
        dB = _F0 if last else f16_at(p, o + 18)
        eB = 32 * b if last else 32 * b + 32
        c0, c1, c2, c3 = _pair(uA, uB, dA, dB, 32 * b, eB, 0, uA, uB, _NB, _NB, nx, R, c0, c1, c2, c3)
        kA, kB = np.float32(-8.0) * dA, np.float32(-8.0) * dB
        m0, m1, m2, m3 = _cor(kA, kA, kB, kB, 32 * b, eB, nx, R, m0, m1, m2, m3)
        o += 36
    return _fin(c0, c1, c2, c3, m0, m1, m2, m3)


@njit(**_JIT)
def _q45_k(p, off, n_in, R, nx, five):
    """Q4_K (144 B) / Q5_K (176 B: 32 B of fifth bits before the nibbles): chunk g of 32 bytes
    holds sub-block 2g in its low nibbles, 2g + 1 in its high ones."""
    o = np.int64(off)
    c0, c1, c2, c3, m0, m1, m2, m3 = _zeros()
    size = 176 if five else 144
    for sb in range(n_in // 256):
        d, dmin = f16_at(p, o), f16_at(p, o + 2)
        q = o + 48 if five else o + 16
        for g in range(4):
            e = 256 * sb + 64 * g
            sc0, mn0 = _k4_scale(p, o + 4, 2 * g)
            sc1, mn1 = _k4_scale(p, o + 4, 2 * g + 1)
            c = s.ld_b(p, q + 32 * g)
            lo, hi = s.b_and(c, 15), s.b_shr(c, 4)
            if five:
                h = s.b_shr(s.ld_b(p, o + 16), 2 * g)
                lo = s.b_or(lo, s.b_shl(s.b_and(h, 1), 4))
                hi = s.b_or(hi, s.b_shl(s.b_and(h, 2), 3))
            c0, c1, c2, c3 = _pair(lo, hi, d * np.float32(sc0), d * np.float32(sc1), e, e + 32, 0, lo, hi, _NB, _NB,
                                   nx, R, c0, c1, c2, c3)
            kA, kB = -(dmin * np.float32(mn0)), -(dmin * np.float32(mn1))
            m0, m1, m2, m3 = _cor(kA, kA, kB, kB, e, e + 32, nx, R, m0, m1, m2, m3)
        o += size
    return _fin(c0, c1, c2, c3, m0, m1, m2, m3)


@njit(**_INL)
def _q6_u(p, ql, h, g):
    """Q6_K group g of a half: nibble g // 2 of ql[32 (g % 2) + l] with bits 2g.. of h above."""
    la = s.ld_b(p, ql + 32 * (g % 2))
    nib = s.b_and(la, 15) if g < 2 else s.b_shr(la, 4)
    return s.b_or(nib, s.b_shl(s.b_and(s.b_shr(h, 2 * g), 3), 4))


@njit(**_INL)
def _i8s(p, a):
    return np.float32(np.int8(u8_at(p, a)))


@njit(**_JIT)
def _q6_k(p, off, n_in, R, nx):
    """Per 128-element half: element 32g + l is nibble g // 2 of ql[32 (g % 2) + l] with bits
    2g..2g+1 of qh[l] above it (0..63, less 32), times d * int8 scale 2g + l // 16."""
    o = np.int64(off)
    c0, c1, c2, c3, m0, m1, m2, m3 = _zeros()
    k = np.float32(-32.0)
    for sb in range(n_in // 256):
        d = f16_at(p, o + 208)
        for half in range(2):
            ql, sc = o + 64 * half, o + 192 + 8 * half
            h = s.ld_b(p, o + 128 + 32 * half)
            for g in range(0, 4, 2):
                uA, uB = _q6_u(p, ql, h, g), _q6_u(p, ql, h, g + 1)
                a0, a1 = d * _i8s(p, sc + 2 * g), d * _i8s(p, sc + 2 * g + 1)
                b0, b1 = d * _i8s(p, sc + 2 * g + 2), d * _i8s(p, sc + 2 * g + 3)
                e = 256 * sb + 128 * half + 32 * g
                c0, c1, c2, c3 = _pair16(uA, uB, a0, a1, b0, b1, e, e + 32, nx, R, c0, c1, c2, c3)
                m0, m1, m2, m3 = _cor(k * a0, k * a1, k * b0, k * b1, e, e + 32, nx, R, m0, m1, m2, m3)
        o += 210
    return _fin(c0, c1, c2, c3, m0, m1, m2, m3)


@njit(**_INL)
def _g2(p, q, k):
    return GRID64_IQ2_XXS[_U(u8_at(p, q + k))]


@njit(**_INL)
def _ks(aux, l):
    return KSIGNS32[_U((aux >> (7 * l)) & 127)] << (8 * l)


@njit(**_INL)
def _iq2_xxs_sub(p, d, q):
    """IQ2_XXS sub-block at q: (grid bytes, sign bits, scale)."""
    aux = s.u32_at(p, q + 4)
    u = s.b_u64x4(_g2(p, q, 0), _g2(p, q, 1), _g2(p, q, 2), _g2(p, q, 3))
    bits = _ks(aux, 0) | _ks(aux, 1) | _ks(aux, 2) | _ks(aux, 3)
    return u, bits, d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.25)


@njit(**_JIT)
def _iq2_xxs(p, off, n_in, R, nx):
    """66 B / 256: f16 d, then per sub-block 4 grid indices (bytes) and a u32 of 4 x 7 sign bits
    and a 4-bit scale s: w = d (0.5 + s) / 4 x grid x sign."""
    o = np.int64(off)
    c0, c1, c2, c3, m0, m1, m2, m3 = _zeros()
    for sb in range(n_in // 256):
        d = f16_at(p, o)
        for ib in range(0, 8, 2):
            uA, bA, cA = _iq2_xxs_sub(p, d, o + 2 + 8 * ib)
            uB, bB, cB = _iq2_xxs_sub(p, d, o + 10 + 8 * ib)
            e = 256 * sb + 32 * ib
            c0, c1, c2, c3 = _pair(uA, uB, cA, cB, e, e + 32, 2, uA, uB, bA, bB, nx, R, c0, c1, c2, c3)
        o += 66
    return _fin(c0, c1, c2, c3, m0, m1, m2, m3)


@njit(**_INL)
def _g1(p, qs, qh, l):
    return GRID64_IQ1_S_P1[_U(u8_at(p, qs + l) | (((qh >> (3 * l)) & 7) << 8))]


@njit(**_INL)
def _iq1_s_sub(p, o, d, ib):
    """IQ1_S sub-block ib: (grid + 1 bytes, scale dl, offset dl (delta - 1))."""
    qh, qs = s.u16_at(p, o + 34 + 2 * ib), o + 2 + 4 * ib
    u = s.b_u64x4(_g1(p, qs, qh, 0), _g1(p, qs, qh, 1), _g1(p, qs, qh, 2), _g1(p, qs, qh, 3))
    dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
    delta = -_EIGHTH if qh & 0x8000 else _EIGHTH
    return u, dl, dl * (delta - np.float32(1.0))


@njit(**_JIT)
def _iq1_s(p, off, n_in, R, nx):
    """50 B / 256: f16 d, qs[32], u16 qh[8]: sub-block ib's 4 groups are grid entries of 8 + 3
    bits (qs[4 ib + l], bits 3l.. of qh[ib]); w = d (2 s + 1) (grid + delta), delta = +-1/8."""
    o = np.int64(off)
    c0, c1, c2, c3, m0, m1, m2, m3 = _zeros()
    for sb in range(n_in // 256):
        d = f16_at(p, o)
        for ib in range(0, 8, 2):
            uA, cA, kA = _iq1_s_sub(p, o, d, ib)
            uB, cB, kB = _iq1_s_sub(p, o, d, ib + 1)
            e = 256 * sb + 32 * ib
            c0, c1, c2, c3 = _pair(uA, uB, cA, cB, e, e + 32, 0, uA, uB, _NB, _NB, nx, R, c0, c1, c2, c3)
            m0, m1, m2, m3 = _cor(kA, kA, kB, kB, e, e + 32, nx, R, m0, m1, m2, m3)
        o += 50
    return _fin(c0, c1, c2, c3, m0, m1, m2, m3)


@njit(**_JIT)
def _tq2_0(p, off, n_in, R, nx):
    """66 B / 256: qs[64] of 2-bit codes, f16 d: element 128 j + 32 l + m is bits 2l.. of
    qs[32 j + m]; w = d (q - 1)."""
    o = np.int64(off)
    c0, c1, c2, c3, m0, m1, m2, m3 = _zeros()
    for sb in range(n_in // 256):
        d = f16_at(p, o + 64)
        for j in range(2):
            c = s.ld_b(p, o + 32 * j)
            for l in range(0, 4, 2):
                e = 256 * sb + 128 * j + 32 * l
                uA, uB = s.b_and(s.b_shr(c, 2 * l), 3), s.b_and(s.b_shr(c, 2 * l + 2), 3)
                c0, c1, c2, c3 = _pair(uA, uB, d, d, e, e + 32, 0, uA, uB, _NB, _NB, nx, R, c0, c1, c2, c3)
                m0, m1, m2, m3 = _cor(-d, -d, -d, -d, e, e + 32, nx, R, m0, m1, m2, m3)
        o += 66
    return _fin(c0, c1, c2, c3, m0, m1, m2, m3)


@njit(**_JIT)
def int_dots(qtype, p, off, n_in, R, nx):
    """(W . a0, .., W . a3) for the row W of `qtype` (has_int) at address p + off and the
    quantized activation rows R (see above): nx = 1 computes row 0 alone (the rest 0), any other
    nx all four (the caller repeats a row where it has fewer)."""
    if qtype == _Q8_0:
        return _q8_0(p, off, n_in, R, nx)
    if qtype == _Q4_0:
        return _q4_0(p, off, n_in, R, nx)
    if qtype == _Q4_K:
        return _q45_k(p, off, n_in, R, nx, False)
    if qtype == _Q5_K:
        return _q45_k(p, off, n_in, R, nx, True)
    if qtype == _Q6_K:
        return _q6_k(p, off, n_in, R, nx)
    if qtype == _IQ2_XXS:
        return _iq2_xxs(p, off, n_in, R, nx)
    if qtype == _IQ1_S:
        return _iq1_s(p, off, n_in, R, nx)
    return _tq2_0(p, off, n_in, R, nx)


@njit(**_INL)
def act_rows(qa, qd, qs, i0, i1, i2, i3):
    """R for rows i0 .. i3 of the quantized activations (q [N, n], d [N, n/32], s [N, n/16])."""
    a, d, sm = addr(qa), addr(qd), addr(qs)
    n, nd, ns = np.int64(qa.shape[1]), np.int64(qd.shape[1]) * 4, np.int64(qs.shape[1]) * 4
    return (a + i0 * n, a + i1 * n, a + i2 * n, a + i3 * n, d + i0 * nd, d + i1 * nd, d + i2 * nd, d + i3 * nd,
            sm + i0 * ns, sm + i1 * ns, sm + i2 * ns, sm + i3 * ns)
