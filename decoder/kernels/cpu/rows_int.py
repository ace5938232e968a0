"""Integer dot products of one quantized weight row with int8-quantized activation rows.

The float kernels (rows_dot.py, rows.py's decoders) turn every weight into a float32
and multiply-add it: for the 1-4 bit types that decoding, not the memory, set the speed. Here,
as llama.cpp does, each activation row is quantized once per call (`quantize_acts`) and a
weight sub-block of 32 codes meets its 32 activation bytes in one integer `dpbusd`
(simd/integer: u8 x s8 -> 8 int32 lanes). The 8 sub-blocks of 256 weights are summed into one
vector of 8 integer sums (hsum8x8) and scaled at once, so floats appear once per 256 weights and
activation row (rows are taken 256 weights at a time: the callers ask n_in % 256 == 0).

Activation format (per row of n values, n a multiple of 32), `Acts`:
  q  int8  [n]       round(x / d_b), |q| <= 127, block b = elements 32b .. 32b + 31
  d  float [n / 32]  d_b = max |x| over block b x float32(1 / 127)
  ds float [n / 32]  d_b x the sum of q over block b (for weight offsets and K-quant mins)
Blocks of 32, not llama.cpp's 256-wide Q8_K: the 8 block scales of a super-block are one vector
load, as cheap as Q8_K's one scale with integer sub-scale multiplies, and an outlier only
coarsens its own 32 activations.

Wide activations (`quantize_acts(x, wide=True)`): one scale per 256, the same in the 8 entries
of d. The WIDE_TYPES (is_wide) always take them, the others never: the callers quantize for each
type what it takes, so a call may quantize its rows both ways. They are the types whose float
scale is per 128 or per 256, any finer one an integer (dpbusd_k's K): Q1_0, TQ1_0, TQ2_0, Q2_K,
Q3_K, IQ2_XS, IQ2_S (IQ1_M would qualify: 5 % faster, not worth the coarser rounding). Their 8
sub-block dots then add up as integers and are scaled once: the per-sub-block sums (hsum8x8)
go. Q1_0, TQ2_0, TQ1_0, Q2_K and Q3_K go further, on 64-byte vectors and 16 float lanes: a
block's dot with its offset is one integer chain started from the activations' negated lane sums
(pm_dot128, tq2_dot256, tq1_dot256 in simd/integer) or ended by the group sums times the mins
(q2k_dot256, q3k_dot256), so no offset term is left to scale. The IQ types with sign bits
(IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) dot 64-byte runs of grid bytes too (_runs_row,
_runs_k_row: the activations negated by a mask, per-16 scales as vpdpwssd's multipliers); with
AVX-512 VBMI their code books are looked up as level words in registers (simd/blocks'
_word_lookup, _grid_runs), not loaded one entry at a time. The activation rounding is
llama.cpp's Q8_K's: the error per element is at most a 256-block's max |x| / 254 instead of its
32-block's (a random expert's output: ~1.5x the error of per-32).

Weights as unsigned bytes (dpbusd's u8 side), per type, for sub-block j with weight scale c_j;
"signed" = their magnitudes, with the activation bytes' signs flipped where the weight is < 0
(psignb); "k" = integer scales per 16 weights, multiplied into the dot's int32 lanes (dpbusd_k:
vpmaddwd by k instead of by 1 on AVX2):
  Q8_0     q signed                                                     c = d
  Q4_0     nibble n, w = d (n - 8)            : c = d, offset -8 d x sum(a)
  Q4_1     nibble n, w = d n + m              : c = d, offset m x sum(a)
  Q5_0/Q5_1  n + 16 x fifth bit, w = d (n - 16) or d n + m: c = d, offset -16 d or m
  Q4_K/Q5_K  n (+16 x fifth bit), w = d sc n - dmin m: c = d sc, offset -dmin m x sum(a)
  Q2_K     sc q (64 bytes, a lookup); a second dot, the sums per 16 times m: w = d sc q - dmin m
  Q3_K     u = q + 4 h (0..7), K = sc - 32 per 16: K u a - 4 K gsum     c = d (64 bytes)
  Q6_K     q - 32 signed: c per 16 weights (float: hsum4x8_halves)
  Q1_0     bits b (0/1), w = d (2 b - 1)      : 64 bytes: a added or negated by b  c = d
  IQ4_NL   KV[n] (vpshufb, |KV| <= 127) signed                          c = d
  IQ4_XS   KV[n] signed                                                 c = d (sc - 32)
  IQ2_XXS  grid bytes (<= 43), signs applied to the activation bytes    c = d (0.5 + s) / 4
  IQ2_XS, IQ2_S  grid bytes (<= 43), signs on the activations, k = 2 s + 1     c = d / 8
  IQ3_XXS  grid bytes (<= 62), signs on the activations                 c = d (0.5 + s) / 2
  IQ3_S    grid bytes (odd, <= 15), signs on the activations            c = d (1 + 2 s)
  IQ1_S    grid + 1 (0..2), w = dl (g + delta) : c = dl, offset dl (delta - 1) x sum(a)
  IQ1_M    8 (g + delta) (|.| <= 9, delta per 8 weights) signed, k = 2 s + 1   c = d / 8
  TQ2_0, TQ1_0  q in 0..2, w = d (q - 1)       : c = d, offset -d x sum(a) (64 bytes, the chain
                                                  starts from -sum(a)'s lanes)
  MXFP4    E2M1 doubled (vpshufb, |.| <= 12) signed                     c = 2^(e - 128)
  NVFP4    E2M1 doubled signed: c per 16 weights (UE4M3 / 2, float: hsum4x8_halves)
Every unsigned byte stays <= 128 (AVX2's int16 pair sums), every lane sum < 2^24 (exact as float).
A row's result is, per activation row, sum_j c_j d_a,j (W_j . q_j)_k plus the offsets: the same
real number as the dequantized weights (gguf-py's) dotted with the dequantized int8 activation,
up to float32 rounding of the scales and the sums (8 lanes, a fixed tree at the end). Every
activation row runs the same operations whether alone or one of four, so a token's result
does not depend on the other rows sharing its expert, nor on the thread count.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from numba import njit

from .simd import blocks as blk
from .simd import integer as s
from .simd import vectors as v
from .rows_base import _JIT
from .rows_iq import GRID32_IQ3_S, GRID32_IQ3_XXS, GRID64_IQ1, GRID64_IQ2_S, GRID64_IQ2_XS, GRID64_IQ2_XXS, GRID_IQ1_S
from .simd.vectors import addr, f16_at

WORDS_IQ2_XXS = blk.word_grid(GRID64_IQ2_XXS.view(np.uint8).reshape(-1, 8), blk.IQ2_LEVELS)  # [256] (iq2xxs_runs)
WORDS_IQ3_XXS = blk.word_grid(GRID32_IQ3_XXS.view(np.uint8).reshape(-1, 4), blk.IQ3_LEVELS)  # [256] (iq3xxs_runs)
WORDS_IQ2_XS = blk.word_grid(GRID64_IQ2_XS.view(np.uint8).reshape(-1, 8), blk.IQ2_LEVELS)  # [512] (iq2xs_runs)
WORDS_IQ3_S = blk.word_grid(GRID32_IQ3_S.view(np.uint8).reshape(-1, 4), blk.IQ3S_LEVELS)  # [512] (iq3s_runs)

_Q8_0, _Q4_0, _Q4_K, _Q5_K, _Q6_K = int(Q.Q8_0), int(Q.Q4_0), int(Q.Q4_K), int(Q.Q5_K), int(Q.Q6_K)
_Q2_K = int(Q.Q2_K)
_IQ2_XXS, _IQ1_S, _TQ2_0, _TQ1_0 = int(Q.IQ2_XXS), int(Q.IQ1_S), int(Q.TQ2_0), int(Q.TQ1_0)
_Q1_0, _IQ2_XS, _IQ2_S, _IQ3_XXS = int(Q.Q1_0), int(Q.IQ2_XS), int(Q.IQ2_S), int(Q.IQ3_XXS)
_IQ3_S, _IQ1_M, _Q3_K, _IQ4_XS, _IQ4_NL = int(Q.IQ3_S), int(Q.IQ1_M), int(Q.Q3_K), int(Q.IQ4_XS), int(Q.IQ4_NL)
_Q4_1, _Q5_0, _Q5_1, _MXFP4, _NVFP4 = int(Q.Q4_1), int(Q.Q5_0), int(Q.Q5_1), int(Q.MXFP4), int(Q.NVFP4)
INT_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q2_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.IQ1_S, Q.TQ2_0, Q.TQ1_0, Q.Q1_0,
             Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_M, Q.Q3_K, Q.IQ4_XS, Q.IQ4_NL,
             Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4, Q.NVFP4)
# The per-super-block helpers are inlined by LLVM (forceinline: its alwaysinline attribute), not
# by numba (inline="always"): numba deep-copies a callee's IR into every call site, which cost
# ~12 s of compile per type kernel (8 dots x 4 rows of copies); compiled once per signature and
# inlined by LLVM, the same code compiles in 1-3 s and runs as fast.
_INL = {**_JIT, "forceinline": True}
# IQ1_S's code book {-1, 0, 1} plus one, as unsigned bytes: 8 per index, one uint64 per group
GRID64_IQ1_S_P1 = (GRID_IQ1_S.astype(np.int16) + 1).astype(np.uint8).view(np.uint64)  # [2048]
# IQ4_NL / IQ4_XS's code book (ggml's kvalues_iq4nl) as int8, twice: vpshufb looks up per 16 bytes
KV2_IQ4NL = np.tile(np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), np.int8), 2)
# MXFP4 / NVFP4's E2M1 values doubled (gguf-py's kvalues), twice
KV2_E2M1 = np.tile(np.array((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), np.int8), 2)
# Each super-block step asks for the lines PREFETCH_BYTES past the bytes it reads: a steady stream
# a few lines at a time. Asking for a whole row ahead as each row starts was slower, the more so
# the farther and the wider the rows (Intel VM, 2 threads, `bench kernels`, Q8_0 of the bound:
# 1024-wide rows 0.46 a row 8 KB ahead, 0.73 a row 2 KB ahead, 0.72 per step 2 KB ahead; 4096-wide
# 0.61 a row ahead, 0.78 per step).
PREFETCH_BYTES = 2048
WIDE_TYPES = (Q.Q1_0, Q.TQ1_0, Q.TQ2_0, Q.Q2_K, Q.Q3_K, Q.IQ2_XS, Q.IQ2_S)  # wide activations (above)
_FAST_GATHER = blk.has_fast_gather()  # (IQ1_S: iq1s_runs' gathers, else iq1s_prep's loads)
_EIGHTH, _QUARTER, _INV127, _F127 = np.float32(0.125), np.float32(0.25), np.float32(1.0 / 127.0), np.float32(127.0)


@njit(**_JIT)
def has_int(qtype):
    return (qtype == _Q8_0 or qtype == _Q4_0 or qtype == _Q2_K or qtype == _Q4_K or qtype == _Q5_K or qtype == _Q6_K
            or qtype == _IQ2_XXS or qtype == _IQ1_S or qtype == _TQ2_0 or qtype == _TQ1_0 or qtype == _Q1_0
            or qtype == _IQ2_XS or qtype == _IQ2_S or qtype == _IQ3_XXS or qtype == _IQ3_S or qtype == _IQ1_M
            or qtype == _Q3_K or qtype == _IQ4_XS or qtype == _IQ4_NL or qtype == _Q4_1 or qtype == _Q5_0
            or qtype == _Q5_1 or qtype == _MXFP4 or qtype == _NVFP4)


@njit(**_JIT)
def is_wide(qtype):
    return (qtype == _Q1_0 or qtype == _TQ1_0 or qtype == _TQ2_0 or qtype == _Q2_K or qtype == _Q3_K
            or qtype == _IQ2_XS or qtype == _IQ2_S)


# -- activations ---------------------------------------------------------------------------------
@njit(**_JIT)
def _aligned_bytes(n_rows, n):
    """An int8 [n_rows, n] array at a 64-byte aligned address: the 64-byte loads of the activations
    (pm_dot128) then never straddle two cache lines (n is a multiple of 64)."""
    buf = np.empty(n_rows * n + 64, np.int8)
    k = (64 - addr(buf) % 64) % 64
    return buf[k:k + n_rows * n].reshape(n_rows, n)


@njit(**_JIT)
def quantize_acts(x, wide=False):
    """x [N, n] float32 (n % 32 == 0; n % 256 == 0 if wide) -> Acts: (q int8 [N, n], d float32
    [N, n/32], ds float32 [N, n/32] = d x the sum of q over the block). wide: one scale per 256
    (d repeats it 8 times). 16 lanes at a time: the max, then per element q = rint(x / d)
    clamped to +-127 (exact operations, so the order does not matter)."""
    n_rows, n = x.shape
    x = np.ascontiguousarray(x)
    span = 256 if wide else 32
    q = _aligned_bytes(n_rows, n)
    d = np.empty((n_rows, n // 32), np.float32)
    ds = np.empty((n_rows, n // 32), np.float32)
    lo, hi = v.splat(-_F127), v.splat(_F127)
    for r in range(n_rows):
        xr, qr = addr(x) + np.int64(r) * n * 4, addr(q) + np.int64(r) * n
        for b in range(n // span):
            m = v.zero()
            for k in range(span * b, span * b + span, 16):
                m = v.fmax(m, v.fabs(v.ld_f32(xr, k)))
            amax = v.hmax(m)
            db = amax * _INV127  # (a product, not a quotient: fast-math would rewrite that)
            inv = v.splat(np.float32(127.0) / amax if amax > 0 else np.float32(0.0))
            for j in range(span // 32):
                k = span * b + 32 * j
                q0 = v.to_i(v.fmin(v.fmax(v.rint(v.mul(v.ld_f32(xr, k), inv)), lo), hi))
                q1 = v.to_i(v.fmin(v.fmax(v.rint(v.mul(v.ld_f32(xr, k + 16), inv)), lo), hi))
                v.st_i8(qr, k, q0)
                v.st_i8(qr, k + 16, q1)
                c = span // 32 * b + j
                d[r, c], ds[r, c] = db, db * np.float32(v.ihsum(v.iadd(q0, q1)))
    return q, d, ds


# -- one super-block (8 sub-blocks of 32) against 1 or 4 activation rows -----------------------------
# The 8 sub-blocks' integer dots are summed lane-wise into one vector of 8 sums (hsum8x8), which
# is scaled by the weights' sub-block scales c and the activations' block scales d_a, and the
# weight offsets (or mins) cm by the activations' d_a x sum(q): two fmas per 256 weights and row.
# R = (q addresses of rows 0-3, d addresses 0-3, ds addresses 0-3); e = the super-block's element.
# The activation bytes are used as they are (mode 0) or with the signs of the int8 weights W
# (mode 1: U holds their magnitudes). (The IQ types with sign bits dot 64-byte runs: _runs_row.)
# K: per sub-block integer multipliers of its lanes (dpbusd_k: lanes 0-3 = its first 16 weights,
# 4-7 the last 16), for the types with a scale per 16 weights; _NK (all 1) for the others.
@njit(**_INL)
def _dp(U, W, K, a, e, j, mode):
    x = s.ld_b(a, e + 32 * j)
    if mode == 1:
        x = s.b_sign(x, W[j])
    return s.dpbusd_k(U[j], x, K[j])


@njit(**_INL)
def _sb_row(i, R, U, W, K, mode, c, cm, has_m, e, acc):
    a = R[i]
    isum = s.hsum8x8((_dp(U, W, K, a, e, 0, mode), _dp(U, W, K, a, e, 1, mode),
                      _dp(U, W, K, a, e, 2, mode), _dp(U, W, K, a, e, 3, mode),
                      _dp(U, W, K, a, e, 4, mode), _dp(U, W, K, a, e, 5, mode),
                      _dp(U, W, K, a, e, 6, mode), _dp(U, W, K, a, e, 7, mode)))
    acc = s.f8_fma(s.f8_mul(s.f8_of_i(isum), s.f8_ld(R[4 + i], (e >> 5) * 4)), c, acc)
    if has_m:
        acc = s.f8_fma(s.f8_ld(R[8 + i], (e >> 5) * 4), cm, acc)
    return acc


@njit(**_INL)
def _sb(U, W, K, mode, c, cm, has_m, e, nx, R, c0, c1, c2, c3):
    """c_i += sum_j (U_j . a_i[e + 32j:])_K c_j d_a,j + cm_j d_a,j sum(a_i[e + 32j:]) (has_m), the
    dot's two 16-byte halves times K_j's lanes."""
    c0 = _sb_row(0, R, U, W, K, mode, c, cm, has_m, e, c0)
    if nx > 1:
        c1 = _sb_row(1, R, U, W, K, mode, c, cm, has_m, e, c1)
        c2 = _sb_row(2, R, U, W, K, mode, c, cm, has_m, e, c2)
        c3 = _sb_row(3, R, U, W, K, mode, c, cm, has_m, e, c3)
    return c0, c1, c2, c3


@njit(**_INL)
def _half(U, a, e, h):
    """The integer dot of sub-blocks 4h .. 4h + 3 of U with the activation bytes at a + e: one
    chain of dpbusd (8 lanes of partial sums)."""
    t = s.dpbusd(s.i8_zero(), U[4 * h], s.ld_b(a, e + 128 * h))
    t = s.dpbusd(t, U[4 * h + 1], s.ld_b(a, e + 128 * h + 32))
    t = s.dpbusd(t, U[4 * h + 2], s.ld_b(a, e + 128 * h + 64))
    return s.dpbusd(t, U[4 * h + 3], s.ld_b(a, e + 128 * h + 96))


@njit(**_INL)
def _sbw_row(i, R, U, c_lo, c_hi, cm, e, acc):
    """_sb_row for wide activations (one scale per 256, so d's 8 lanes are equal): each
    half's 4 sub-blocks add up as integers; c_lo, c_hi the halves' weight scales, cm per 32."""
    a = R[i]
    da = s.f8_ld(R[4 + i], (e >> 5) * 4)  # [8] the same scale
    t = s.f8_mul(s.f8_of_i(_half(U, a, e, 0)), s.f8_mul(da, c_lo))
    t = s.f8_fma(s.f8_of_i(_half(U, a, e, 1)), s.f8_mul(da, c_hi), t)
    t = s.f8_fma(s.f8_ld(R[8 + i], (e >> 5) * 4), cm, t)
    return s.f8_add(acc, t)  # (reassociation folds this add into the fmas: a 3-fma chain on acc, not the bound)


@njit(**_INL)
def _sbw(U, c_lo, c_hi, cm, e, nx, R, c0, c1, c2, c3):
    c0 = _sbw_row(0, R, U, c_lo, c_hi, cm, e, c0)
    if nx > 1:
        c1 = _sbw_row(1, R, U, c_lo, c_hi, cm, e, c1)
        c2 = _sbw_row(2, R, U, c_lo, c_hi, cm, e, c2)
        c3 = _sbw_row(3, R, U, c_lo, c_hi, cm, e, c3)
    return c0, c1, c2, c3


@njit(**_INL)
def _fin(c0, c1, c2, c3):
    return s.f8_hsum(c0), s.f8_hsum(c1), s.f8_hsum(c2), s.f8_hsum(c3)


@njit(**_INL)
def _zeros():
    return s.f8_zero(), s.f8_zero(), s.f8_zero(), s.f8_zero()


_NK = (np.int64(1),) * 8  # no per-16 scales


# -- types ---------------------------------------------------------------------------------------
@njit(**_INL)
def _q8_0(p, off, n_in, R, nx):
    """34 B / 32: f16 d, int8 q[32]; 8 blocks per step (the callers ask n_in % 256 == 0)."""
    o = np.int64(off)
    c0, c1, c2, c3 = _zeros()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 272)
        W = (s.ld_b(p, o + 2), s.ld_b(p, o + 36), s.ld_b(p, o + 70), s.ld_b(p, o + 104),
             s.ld_b(p, o + 138), s.ld_b(p, o + 172), s.ld_b(p, o + 206), s.ld_b(p, o + 240))
        U = (s.b_abs(W[0]), s.b_abs(W[1]), s.b_abs(W[2]), s.b_abs(W[3]),
             s.b_abs(W[4]), s.b_abs(W[5]), s.b_abs(W[6]), s.b_abs(W[7]))
        c = s.f8_of_f16(p, o, 34)
        c0, c1, c2, c3 = _sb(U, W, _NK, 1, c, c, False, 256 * sb, nx, R, c0, c1, c2, c3)
        o += 272
    return _fin(c0, c1, c2, c3)


@njit(**_INL)
def _q4_0(p, off, n_in, R, nx):
    """18 B / 32: f16 d, 16 B nibbles (elements 0-15 low, 16-31 high): w = d (n - 8)."""
    o = np.int64(off)
    c0, c1, c2, c3 = _zeros()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 144)
        U = (s.nib16(p, o + 2), s.nib16(p, o + 20), s.nib16(p, o + 38), s.nib16(p, o + 56),
             s.nib16(p, o + 74), s.nib16(p, o + 92), s.nib16(p, o + 110), s.nib16(p, o + 128))
        c = s.f8_of_f16(p, o, 18)
        cm = s.f8_mul(c, s.f8_splat(np.float32(-8.0)))
        c0, c1, c2, c3 = _sb(U, U, _NK, 0, c, cm, True, 256 * sb, nx, R, c0, c1, c2, c3)
        o += 144
    return _fin(c0, c1, c2, c3)


@njit(**_INL)
def _k4_scales(p, o):
    """Q4_K/Q5_K's 12 bytes at p + o of 6-bit (scale, min) x 8 -> (8 scale bytes, 8 min bytes) as
    uint64 words (ggml's get_scale_min_k4, four lanes at a time in 32-bit words)."""
    w0, w1, w2 = s.u32_at(p, o), s.u32_at(p, o + 4), s.u32_at(p, o + 8)
    sc = (w0 & 0x3F3F3F3F) | (((w2 & 0x0F0F0F0F) | ((w0 >> 2) & 0x30303030)) << 32)
    mn = (w1 & 0x3F3F3F3F) | ((((w2 >> 4) & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030)) << 32)
    return sc, mn


@njit(**_INL)
def _q5_u(c, h, g, hi):
    """Q4_K/Q5_K sub-block 2g + hi of a chunk c of nibbles, with its fifth bits from h (Q5_K)."""
    u = s.b_shr(c, 4) if hi else s.b_and(c, 15)
    return s.b_or(u, s.b_shl(s.b_and(s.b_shr(h, 2 * g + hi), 1), 4))


@njit(**_INL)
def _q45_k(p, off, n_in, R, nx, five):
    """Q4_K (144 B) / Q5_K (176 B: 32 B of fifth bits before the nibbles): chunk g of 32 bytes
    holds sub-block 2g in its low nibbles, 2g + 1 in its high ones; w = d sc n - dmin m."""
    o = np.int64(off)
    c0, c1, c2, c3 = _zeros()
    size = 176 if five else 144
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, size)
        q = o + 48 if five else o + 16
        k0, k1, k2, k3 = s.ld_b(p, q), s.ld_b(p, q + 32), s.ld_b(p, q + 64), s.ld_b(p, q + 96)
        if five:
            h = s.ld_b(p, o + 16)
            U = (_q5_u(k0, h, 0, 0), _q5_u(k0, h, 0, 1), _q5_u(k1, h, 1, 0), _q5_u(k1, h, 1, 1),
                 _q5_u(k2, h, 2, 0), _q5_u(k2, h, 2, 1), _q5_u(k3, h, 3, 0), _q5_u(k3, h, 3, 1))
        else:
            U = (s.b_and(k0, 15), s.b_shr(k0, 4), s.b_and(k1, 15), s.b_shr(k1, 4),
                 s.b_and(k2, 15), s.b_shr(k2, 4), s.b_and(k3, 15), s.b_shr(k3, 4))
        sc, mn = _k4_scales(p, o + 4)
        c = s.f8_mul(s.f8_of_u8x8(sc), s.f8_splat(f16_at(p, o)))
        cm = s.f8_mul(s.f8_of_u8x8(mn), s.f8_splat(-f16_at(p, o + 2)))
        c0, c1, c2, c3 = _sb(U, U, _NK, 0, c, cm, True, 256 * sb, nx, R, c0, c1, c2, c3)
        o += size
    return _fin(c0, c1, c2, c3)


@njit(**_INL)
def _q6_w(p, ql, h, g):
    """Q6_K group g of a 128-half: nibble g // 2 of ql[32 (g % 2) + l] with bits 2g.. of h above
    it, less 32, as signed bytes."""
    la = s.ld_b(p, ql + 32 * (g % 2))
    nib = s.b_and(la, 15) if g < 2 else s.b_shr(la, 4)
    return s.b_sub(s.b_or(nib, s.b_shl(s.b_and(s.b_shr(h, 2 * g), 3), 4)), 32)


@njit(**_INL)
def _q6_half(W, U, a, e, j):
    """hsum4x8_halves of sub-blocks j .. j + 3 (signed weights W, magnitudes U) against a[e:]."""
    return s.hsum4x8_halves((_dp(U, W, _NK, a, e, j, 1), _dp(U, W, _NK, a, e, j + 1, 1),
                             _dp(U, W, _NK, a, e, j + 2, 1), _dp(U, W, _NK, a, e, j + 3, 1)))


@njit(**_INL)
def _q6_row(i, R, U, W, cA, cB, e, acc):
    a, db = R[i], R[4 + i] + (e >> 5) * 4
    acc = s.f8_fma(s.f8_mul(s.f8_of_i(_q6_half(W, U, a, e, 0)), s.f8_ld4x2(db, 0)), cA, acc)
    return s.f8_fma(s.f8_mul(s.f8_of_i(_q6_half(W, U, a, e, 4)), s.f8_ld4x2(db, 16)), cB, acc)


@njit(**_INL)
def _q6_k(p, off, n_in, R, nx):
    """210 B / 256: ql[128], qh[64], int8 scales[16], f16 d. Per 128-element half, element
    32g + l is nibble g // 2 of ql[32 (g % 2) + l] with bits 2g..2g+1 of qh[l] above it, less 32,
    times d * scale 2g + l // 16 (a scale per 16 weights: the sums are taken per 16)."""
    o = np.int64(off)
    c0, c1, c2, c3 = _zeros()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 210)
        h0, h1 = s.ld_b(p, o + 128), s.ld_b(p, o + 160)
        W = (_q6_w(p, o, h0, 0), _q6_w(p, o, h0, 1), _q6_w(p, o, h0, 2), _q6_w(p, o, h0, 3),
             _q6_w(p, o + 64, h1, 0), _q6_w(p, o + 64, h1, 1), _q6_w(p, o + 64, h1, 2), _q6_w(p, o + 64, h1, 3))
        U = (s.b_abs(W[0]), s.b_abs(W[1]), s.b_abs(W[2]), s.b_abs(W[3]),
             s.b_abs(W[4]), s.b_abs(W[5]), s.b_abs(W[6]), s.b_abs(W[7]))
        sa, sc_b = blk.q6_scales(p, o + 192)
        d = s.f8_splat(f16_at(p, o + 208))
        cA, cB = s.f8_mul(sa, d), s.f8_mul(sc_b, d)
        e = 256 * sb
        c0 = _q6_row(0, R, U, W, cA, cB, e, c0)
        if nx > 1:
            c1 = _q6_row(1, R, U, W, cA, cB, e, c1)
            c2 = _q6_row(2, R, U, W, cA, cB, e, c2)
            c3 = _q6_row(3, R, U, W, cA, cB, e, c3)
        o += 210
    return _fin(c0, c1, c2, c3)


@njit(**_INL)
def _q2k_scaled(t, p, o, da, acc):
    """acc + t1 (d da) + t2 (-dmin da): a Q2_K super-block's two integer dots (q2k_dot256) scaled."""
    acc = v.fma(v.to_f(t[0]), v.splat(f16_at(p, o + 80) * da), acc)
    return v.fma(v.to_f(t[1]), v.splat(-f16_at(p, o + 82) * da), acc)


@njit(**_INL)
def _q2_k_row(i, R, p, o, e, acc):
    return _q2k_scaled(s.q2k_dot256(p, o, R[i], e), p, o, s.f32_at(R[4 + i], (e >> 5) * 4), acc)


@njit(**_INL)
def _q2_k(p, off, n_in, R, nx):
    """84 B / 256: 16 scale bytes (low nibble scale, high min, per 16 weights), qs[64] of 2-bit
    codes (as TQ2_0's), f16 d, f16 dmin: w = d sc q - dmin m, a super-block's dot d x sum sc q a
    - dmin x sum m a, two integer dots on 64-byte vectors (q2k_dot256). The one-row kernel
    (_rows1_from_sums) takes the activations' lane sums precomputed once per call, the same
    integers."""
    o = np.int64(off)
    c0, c1, c2, c3 = v.zero(), v.zero(), v.zero(), v.zero()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 84)
        e = 256 * sb
        c0 = _q2_k_row(0, R, p, o, e, c0)
        if nx > 1:
            c1 = _q2_k_row(1, R, p, o, e, c1)
            c2 = _q2_k_row(2, R, p, o, e, c2)
            c3 = _q2_k_row(3, R, p, o, e, c3)
        o += 84
    return v.hsum(c0), v.hsum(c1), v.hsum(c2), v.hsum(c3)


@njit(**_INL)
def _run_row(a, U, sg, cd, r, e, acc):
    """acc + run r (sub-blocks 2 r, 2 r + 1: 64 grid bytes U[r], their 64 sign bits of sg) dotted
    with the activations at a + e + 64 r, each sub-block's 8 lanes scaled by its cd."""
    t = s.dp64_neg(v.izero(), U[r], _run_bits(sg, r), a, e + 64 * r)
    return v.fma(v.to_f(t), s.f8_pair(cd, r), acc)


@njit(**_INL)
def _runs_row(i, R, U, sg, c, e, acc):
    """acc + activation row i's dots with a super-block's four 64-byte runs (_run_row), the
    sub-blocks' weight scales c times the activations' per 32."""
    # (an FMA with a zero addend, which numba's fast-math flags do not reach: as a multiply it was
    # reassociated with c's own, differently in the one-row kernel than in the four-row one)
    cd = s.f8_fma(c, s.f8_ld(R[4 + i], (e >> 5) * 4), s.f8_splat(np.float32(0.0)))
    acc = _run_row(R[i], U, sg, cd, 0, e, acc)
    acc = _run_row(R[i], U, sg, cd, 1, e, acc)
    acc = _run_row(R[i], U, sg, cd, 2, e, acc)
    return _run_row(R[i], U, sg, cd, 3, e, acc)


@njit(**_INL)
def _run_bits(sg, r):
    """Run r's 64 sign bits: sub-blocks 2 r, 2 r + 1's 32 each."""
    return s.i8_lane(sg, 2 * r) | (s.i8_lane(sg, 2 * r + 1) << 32)


@njit(**_INL)
def _runs_k_row(i, R, U, sg, K, c, e, acc):
    """acc + activation row i's integer dot with a super-block's four 64-byte runs, each group of
    16 weights times its integer scale (K, dp64_neg_k), scaled once: c the weights' scale, the
    activations' one per 256 (wide)."""
    a = R[i]
    t = s.dp64_neg_k(v.izero(), U[0], _run_bits(sg, 0), a, e, K, 0)
    t = s.dp64_neg_k(t, U[1], _run_bits(sg, 1), a, e + 64, K, 1)
    t = s.dp64_neg_k(t, U[2], _run_bits(sg, 2), a, e + 128, K, 2)
    t = s.dp64_neg_k(t, U[3], _run_bits(sg, 3), a, e + 192, K, 3)
    return v.fma(v.to_f(t), v.splat(c * s.f32_at(R[4 + i], (e >> 5) * 4)), acc)


@njit(**_INL)
def _runs(U, sg, c, e, nx, R, c0, c1, c2, c3):
    """_runs_row for activation row 0, or rows 0-3 (nx > 1), as _sb does for 32-byte sub-blocks."""
    c0 = _runs_row(0, R, U, sg, c, e, c0)
    if nx > 1:
        c1 = _runs_row(1, R, U, sg, c, e, c1)
        c2 = _runs_row(2, R, U, sg, c, e, c2)
        c3 = _runs_row(3, R, U, sg, c, e, c3)
    return c0, c1, c2, c3


@njit(**_INL)
def _runs_k(U, sg, K, c, e, nx, R, c0, c1, c2, c3):
    """_runs_k_row for activation row 0, or rows 0-3 (nx > 1)."""
    c0 = _runs_k_row(0, R, U, sg, K, c, e, c0)
    if nx > 1:
        c1 = _runs_k_row(1, R, U, sg, K, c, e, c1)
        c2 = _runs_k_row(2, R, U, sg, K, c, e, c2)
        c3 = _runs_k_row(3, R, U, sg, K, c, e, c3)
    return c0, c1, c2, c3


@njit(**_INL)
def _iq2_xxs(p, off, n_in, R, nx):
    """66 B / 256: f16 d, then per sub-block 4 grid indices (bytes) and a u32 of 4 x 7 sign bits
    and a 4-bit scale s: w = d (0.5 + s) / 4 x grid x sign = d / 8 x (2 s + 1) x grid x sign.
    The 8 sub-blocks' grid bytes, signs and scales are unpacked at once (iq2xxs_runs: the code book
    as level words in registers, or gathers), then dotted 64 bytes at a time (_runs_row)."""
    o, grid, words = np.int64(off), addr(GRID64_IQ2_XXS), addr(WORDS_IQ2_XXS)
    c0, c1, c2, c3 = v.zero(), v.zero(), v.zero(), v.zero()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 66)
        U, sg, k = blk.iq2xxs_runs(p, o, grid, words)
        c = s.f8_mul(k, s.f8_splat(f16_at(p, o) * _EIGHTH))
        e = 256 * sb
        c0, c1, c2, c3 = _runs(U, sg, c, e, nx, R, c0, c1, c2, c3)
        o += 66
    return v.hsum(c0), v.hsum(c1), v.hsum(c2), v.hsum(c3)


@njit(**_INL)
def _iq1_s(p, off, n_in, R, nx):
    """50 B / 256: f16 d, qs[32], u16 qh[8]: sub-block ib's 4 groups are grid entries of 8 + 3
    bits (qs[4 ib + l], bits 3l.. of qh[ib]); w = d (2 s + 1) (grid + delta), delta = +-1/8,
    dotted as d (2 s + 1) ((grid + 1) . a) - d / 8 x 8 (1 - delta) (2 s + 1) x sum(a)."""
    if _FAST_GATHER:
        return _iq1_s_runs(p, off, n_in, R, nx)
    o, grid = np.int64(off), addr(GRID64_IQ1_S_P1)
    c0, c1, c2, c3 = _zeros()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 50)
        U, k, m = blk.iq1s_prep(p, o, grid)
        c, cm = _iq1_s_scales(p, o, k, m)
        c0, c1, c2, c3 = _sb(U, U, _NK, 0, c, cm, True, 256 * sb, nx, R, c0, c1, c2, c3)
        o += 50
    return _fin(c0, c1, c2, c3)


@njit(**_INL)
def _iq1_s_scales(p, o, k, m):
    """(c, cm) of the IQ1_S super-block at p + o: its d times k, and -d / 8 times m."""
    d = f16_at(p, o)
    return s.f8_mul(k, s.f8_splat(d)), s.f8_mul(m, s.f8_splat(-(d * _EIGHTH)))


@njit(**_INL)
def _iq1_s_row(i, R, U, c, cm, e, acc):
    """acc + activation row i's dots with an IQ1_S super-block's four 64-byte runs of grid + 1
    (each sub-block's 8 lanes times its c and the activations' d), then its offsets in lanes 0-7
    (cm times the activations' d x sum per 32). One chain of FMAs (llvm.fma: numba's fast-math
    flags reach adds and multiplies, and a block's terms summed apart were reassociated
    differently in the one-row kernel than in the four-row one)."""
    a, unsigned = R[i], s.i8_zero()  # (no sign bits: _run_row's negations fold away)
    cd = s.f8_fma(c, s.f8_ld(R[4 + i], (e >> 5) * 4), s.f8_splat(np.float32(0.0)))  # (as _runs_row's)
    acc = _run_row(a, U, unsigned, cd, 0, e, acc)
    acc = _run_row(a, U, unsigned, cd, 1, e, acc)
    acc = _run_row(a, U, unsigned, cd, 2, e, acc)
    acc = _run_row(a, U, unsigned, cd, 3, e, acc)
    return v.fma(s.f8_wide(s.f8_ld(R[8 + i], (e >> 5) * 4)), s.f8_wide(cm), acc)


@njit(**_INL)
def _iq1_s_runs(p, off, n_in, R, nx):
    """_iq1_s with the code book gathered as four 64-byte runs (iq1s_runs, has_fast_gather)."""
    o, grid = np.int64(off), addr(GRID64_IQ1_S_P1)
    c0, c1, c2, c3 = v.zero(), v.zero(), v.zero(), v.zero()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 50)
        U, k, m = blk.iq1s_runs(p, o, grid)
        c, cm = _iq1_s_scales(p, o, k, m)
        e = 256 * sb
        c0 = _iq1_s_row(0, R, U, c, cm, e, c0)
        if nx > 1:
            c1 = _iq1_s_row(1, R, U, c, cm, e, c1)
            c2 = _iq1_s_row(2, R, U, c, cm, e, c2)
            c3 = _iq1_s_row(3, R, U, c, cm, e, c3)
        o += 50
    return v.hsum(c0), v.hsum(c1), v.hsum(c2), v.hsum(c3)


@njit(**_INL)
def _ternary_row(i, R, p, o, e, sums, acc, tq1):
    """acc + row i's dot with the TQ2_0 (tq1: TQ1_0) block at p + o (elements e .. e + 255), 16
    lanes: the integer sum_k (q_k - 1) a_k (tq2_dot256 / tq1_dot256 from the activations' negated
    lane sums) scaled once by the block's d (after its 64 / 52 code bytes)."""
    t = s.tq1_dot256(sums, p, o, R[i], e) if tq1 else s.tq2_dot256(sums, p, o, R[i], e)
    d = f16_at(p, o + (52 if tq1 else 64))
    return v.fma(v.to_f(t), v.splat(d * s.f32_at(R[4 + i], (e >> 5) * 4)), acc)


@njit(**_INL)
def _neg_sums256(a, e):
    """-(the activations' lane sums) over elements e .. e + 255 in tq2_dot256's lanes."""
    return v.iadd(s.pm_sums128(a, e), s.pm_sums128(a, e + 128))


@njit(**_INL)
def _group_sums_row(a, n_in):
    """The activations at a's sums per 16 (group_sums256: Q2_K's mins), 64 bytes per 256, in a
    64-byte aligned buffer (addr() of it inside the callers' loops keeps it alive)."""
    buf = _aligned_bytes(1, n_in // 4)
    for b in range(n_in // 256):
        v.st_i32(addr(buf), 64 * b, s.group_sums256(a, 256 * b))
    return buf


@njit(**_INL)
def _neg_sums_row(a, n_in, span):
    """The one-row kernels' precomputed start of each block's chain: -(the lane sums of the
    activations at a) per `span` elements (128: pm_dot128's lanes, 256: tq2_dot256's), 64 bytes
    each, in a 64-byte aligned buffer. The callers take addr() of it inside their loops, which
    keeps it alive through them."""
    buf = _aligned_bytes(1, n_in // span * 64)
    for b in range(n_in // span):
        t = s.pm_sums128(a, span * b) if span == 128 else _neg_sums256(a, span * b)
        v.st_i32(addr(buf), 64 * b, t)
    return buf


@njit(**_INL)
def _ternary(p, off, n_in, R, nx, tq1):
    """TQ2_0: 66 B / 256: qs[64] of 2-bit codes, f16 d; element 128 j + 32 l + m is bits 2l.. of
    qs[32 j + m]. TQ1_0 (tq1): 54 B / 256: qs[48], qh[4] of base-3 digits, f16 d. Both w = d (q -
    1), so a block's dot is d x (sum q a - sum a), one integer (tq2_dot256 / tq1_dot256, on
    64-byte vectors). The one-row kernel (_rows1_from_sums) takes the sums of a precomputed once
    per call, the same integers."""
    o, nb = np.int64(off), 54 if tq1 else 66
    c0, c1, c2, c3 = v.zero(), v.zero(), v.zero(), v.zero()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, nb)
        e = 256 * sb
        c0 = _ternary_row(0, R, p, o, e, _neg_sums256(R[0], e), c0, tq1)
        if nx > 1:
            c1 = _ternary_row(1, R, p, o, e, _neg_sums256(R[1], e), c1, tq1)
            c2 = _ternary_row(2, R, p, o, e, _neg_sums256(R[2], e), c2, tq1)
            c3 = _ternary_row(3, R, p, o, e, _neg_sums256(R[3], e), c3, tq1)
        o += nb
    return v.hsum(c0), v.hsum(c1), v.hsum(c2), v.hsum(c3)


@njit(**_INL)
def _q1_0_row(i, R, p, o, e, lo, hi):
    """(lo, hi) + activation row i's integer dots with the two blocks at p + o (elements e ..
    e + 255), each scaled by its d x the activations' wide scale: one accumulator per block of
    the pair, so each FMA chain is one FMA a step (the one-row kernel's two, in the same order)."""
    da = s.f32_at(R[4 + i], (e >> 5) * 4)
    t_lo = s.pm_dot128(s.u64_at(p, o + 2), s.u64_at(p, o + 10), R[i], e)
    t_hi = s.pm_dot128(s.u64_at(p, o + 20), s.u64_at(p, o + 28), R[i], e + 128)
    return (v.fma(v.to_f(t_lo), v.splat(f16_at(p, o) * da), lo),
            v.fma(v.to_f(t_hi), v.splat(f16_at(p, o + 18) * da), hi))


@njit(**_INL)
def _q1_0(p, off, n_in, R, nx):
    """18 B / 128: f16 d, 16 B of bits (weight j: bit j % 8 of byte j // 8): w = d (2 b - 1), so a
    block's dot is d x an integer, the activations added where the bit is set and subtracted
    where not (pm_dot128); two blocks per 256 weights. The one-row kernel (_q1_0_rows1) gets
    the same integers and scale products another way, so both give the same sums."""
    o = np.int64(off)
    c0, c1, c2, c3 = v.zero(), v.zero(), v.zero(), v.zero()
    h0, h1, h2, h3 = v.zero(), v.zero(), v.zero(), v.zero()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 36)
        e = 256 * sb
        c0, h0 = _q1_0_row(0, R, p, o, e, c0, h0)
        if nx > 1:
            c1, h1 = _q1_0_row(1, R, p, o, e, c1, h1)
            c2, h2 = _q1_0_row(2, R, p, o, e, c2, h2)
            c3, h3 = _q1_0_row(3, R, p, o, e, c3, h3)
        o += 36
    return v.hsum(v.add(c0, h0)), v.hsum(v.add(c1, h1)), v.hsum(v.add(c2, h2)), v.hsum(v.add(c3, h3))


@njit(**_INL)
def _q1_0_scales(p, o, nb, das, sc):
    """sc[j] = d_j x das[j] for the nb blocks of the Q1_0 row at p + o: 8 a step (q1_scales8),
    the rest one by one."""
    j = 0
    while j + 8 <= nb:
        s.q1_scales8(p, o + 18 * j, addr(das) + 4 * j, addr(sc) + 4 * j)
        j += 8
    for k in range(j, nb):
        sc[k] = f16_at(p, o + 18 * k) * das[k]


@njit(**_INL)
def _q1_0_rows1(p, off, rb, n, n_in, R, out):
    """int_rows1 for Q1_0. Once per call: the activations' negated lane sums (pm_dot128_from
    adds 2 a where a bit is set to them: no negation in the loop) and each block's activation
    scale; once per row: its blocks' scale products (_q1_0_scales). The loop then takes each
    product as a broadcast operand of its FMA, where a scale taken apart per block cost 5 of a
    step's 18 vector uops (one thread, a 4096-wide matrix from memory: 68 -> 55 us)."""
    sums = _neg_sums_row(R[0], n_in, 128)
    nb = n_in // 128
    das, sc = np.empty(nb, np.float32), np.empty(nb, np.float32)
    for j in range(nb):
        das[j] = s.f32_at(R[4], 16 * j)  # block j's: the wide scale of elements 128 j .. (repeated per 32)
    for i in range(n):
        o = np.int64(off + i * rb)
        _q1_0_scales(p, o, nb, das, sc)
        lo, hi = v.zero(), v.zero()
        for sb in range(n_in // 256):
            s.prefetch_lines(p, o + PREFETCH_BYTES, 36)
            e = 256 * sb
            t_lo = s.pm_dot128_from(v.ld_i32(addr(sums), e // 2), s.u64_at(p, o + 2), s.u64_at(p, o + 10), R[0], e)
            t_hi = s.pm_dot128_from(v.ld_i32(addr(sums), e // 2 + 64), s.u64_at(p, o + 20), s.u64_at(p, o + 28),
                                    R[0], e + 128)
            lo = v.fma(v.to_f(t_lo), v.splat(sc[2 * sb]), lo)
            hi = v.fma(v.to_f(t_hi), v.splat(sc[2 * sb + 1]), hi)
            o += 36
        out[i] = v.hsum(v.add(lo, hi))


@njit(**_INL)
def _rows1_from_sums(qtype, p, off, rb, n, n_in, R, out):
    """int_rows1 for TQ2_0, TQ1_0, Q2_K and Q3_K: activation row 0's (negated) lane sums or group
    sums once per call (_neg_sums_row, _group_sums_row), then each row 256 weights a step."""
    tq2, q2k, q3k = qtype == _TQ2_0, qtype == _Q2_K, qtype == _Q3_K
    sums = _group_sums_row(R[0], n_in) if q2k or q3k else _neg_sums_row(R[0], n_in, 256)
    nb = 66 if tq2 else 84 if q2k else 110 if q3k else 54  # bytes per 256 weights
    for i in range(n):
        o = np.int64(off + i * rb)
        acc = v.zero()
        for sb in range(n_in // 256):
            s.prefetch_lines(p, o + PREFETCH_BYTES, nb)
            e = 256 * sb
            if q2k:
                acc = _q2k_scaled(s.q2k_dot256_from(p, o, R[0], e, addr(sums) + e // 4), p, o,
                                  s.f32_at(R[4], (e >> 5) * 4), acc)
            elif q3k:
                acc = v.fma(v.to_f(s.q3k_dot256_from(p, o, R[0], e, addr(sums) + e // 4)),
                            v.splat(f16_at(p, o + 108) * s.f32_at(R[4], (e >> 5) * 4)), acc)
            else:
                acc = _ternary_row(0, R, p, o, e, v.ld_i32(addr(sums), 64 * sb), acc, not tq2)
            o += nb
        out[i] = v.hsum(acc)


@njit(**_INL)
def _iq2_xs(p, off, n_in, R, nx):
    """74 B / 256: f16 d, u16 qs[32] (per group of 8 a 9-bit grid index and a 7-bit ksigns
    index), scales[8] (a nibble per 16 weights): w = d (0.5 + s) / 4 x grid x sign, dotted as
    d / 8 x ((2 s + 1) per 16 x grid . signed a): unpacked as IQ2_XXS (iq2xs_runs), the scales
    multiplied into the dots' int16 pair sums (_runs_k_row)."""
    o, grid, words = np.int64(off), addr(GRID64_IQ2_XS), addr(WORDS_IQ2_XS)
    c0, c1, c2, c3 = v.zero(), v.zero(), v.zero(), v.zero()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 74)
        U, sg, K = blk.iq2xs_runs(p, o, grid, words)
        c, e = f16_at(p, o) * _EIGHTH, 256 * sb
        c0, c1, c2, c3 = _runs_k(U, sg, K, c, e, nx, R, c0, c1, c2, c3)
        o += 74
    return v.hsum(c0), v.hsum(c1), v.hsum(c2), v.hsum(c3)


@njit(**_INL)
def _iq2_s(p, off, n_in, R, nx):
    """82 B / 256: f16 d, qs[32] and 2 bits of qh[8] per group: a 10-bit grid index, signs[32]
    (8 sign bits per group), scales[8] as IQ2_XS's: w = d (0.5 + s) / 4 x grid x sign."""
    o, grid = np.int64(off), addr(GRID64_IQ2_S)
    c0, c1, c2, c3 = v.zero(), v.zero(), v.zero(), v.zero()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 82)
        U, sg, K = blk.iq2s_runs(p, o, grid)
        c, e = f16_at(p, o) * _EIGHTH, 256 * sb
        c0, c1, c2, c3 = _runs_k(U, sg, K, c, e, nx, R, c0, c1, c2, c3)
        o += 82
    return v.hsum(c0), v.hsum(c1), v.hsum(c2), v.hsum(c3)


@njit(**_INL)
def _iq3_xxs(p, off, n_in, R, nx):
    """98 B / 256: f16 d, qs[64] (an index into a grid of 4 bytes per 4 weights), u32 aux[8]
    (4 x 7-bit ksigns indices, a 4-bit scale): w = d (0.5 + s) / 2 x grid x sign
    = d / 4 x (2 s + 1) x grid x sign, unpacked (iq3xxs_runs) and dotted (_runs_row) as IQ2_XXS."""
    o, grid, words = np.int64(off), addr(GRID32_IQ3_XXS), addr(WORDS_IQ3_XXS)
    c0, c1, c2, c3 = v.zero(), v.zero(), v.zero(), v.zero()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 98)
        U, sg, k = blk.iq3xxs_runs(p, o, grid, words)
        c = s.f8_mul(k, s.f8_splat(f16_at(p, o) * _QUARTER))
        e = 256 * sb
        c0, c1, c2, c3 = _runs(U, sg, c, e, nx, R, c0, c1, c2, c3)
        o += 98
    return v.hsum(c0), v.hsum(c1), v.hsum(c2), v.hsum(c3)


@njit(**_INL)
def _iq3_s(p, off, n_in, R, nx):
    """110 B / 256: f16 d, qs[64] with a bit of qh[8] each (9-bit indices into a grid of 4
    bytes), signs[32], scales[4] (a nibble per sub-block): w = d (1 + 2 s) x grid x sign, unpacked
    (iq3s_runs) and dotted (_runs_row) as IQ2_XXS."""
    o, grid, words = np.int64(off), addr(GRID32_IQ3_S), addr(WORDS_IQ3_S)
    c0, c1, c2, c3 = v.zero(), v.zero(), v.zero(), v.zero()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 110)
        U, sg, k = blk.iq3s_runs(p, o, grid, words)
        c = s.f8_mul(k, s.f8_splat(f16_at(p, o)))
        e = 256 * sb
        c0, c1, c2, c3 = _runs(U, sg, c, e, nx, R, c0, c1, c2, c3)
        o += 110
    return v.hsum(c0), v.hsum(c1), v.hsum(c2), v.hsum(c3)


@njit(**_INL)
def _iq1_m(p, off, n_in, R, nx):
    """56 B / 256: qs[32], qh[16] (per group of 8: 3 more index bits, the sign of its delta),
    u16 sc[4] (3-bit scales per 16 weights, d in their top nibbles): w = d (2 s + 1)
    (grid + delta), delta = +-1/8 per group, dotted as d / 8 x ((2 s + 1) per 16 x
    8 (grid + delta) . a) with the signed codes 8 grid +- 1 (GRID64_IQ1; magnitudes <= 9)."""
    o, grid = np.int64(off), addr(GRID64_IQ1)
    c0, c1, c2, c3 = _zeros()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 56)
        W, K, d = blk.iq1m_prep(p, o, grid)
        U = (s.b_abs(W[0]), s.b_abs(W[1]), s.b_abs(W[2]), s.b_abs(W[3]),
             s.b_abs(W[4]), s.b_abs(W[5]), s.b_abs(W[6]), s.b_abs(W[7]))
        c = s.f8_splat(d * _EIGHTH)
        c0, c1, c2, c3 = _sb(U, W, K, 1, c, c, False, 256 * sb, nx, R, c0, c1, c2, c3)
        o += 56
    return _fin(c0, c1, c2, c3)


@njit(**_INL)
def _q3_k_row(i, R, p, o, e, acc):
    c = f16_at(p, o + 108) * s.f32_at(R[4 + i], (e >> 5) * 4)
    return v.fma(v.to_f(s.q3k_dot256(p, o, R[i], e)), v.splat(c), acc)


@njit(**_INL)
def _q3_k(p, off, n_in, R, nx):
    """110 B / 256: hmask[32], qs[64] (2-bit codes as Q2_K's), 12 bytes of 6-bit scales (one per
    16 weights), f16 d: w = d (sc - 32) (u - 4), u = code + 4 x hmask bit, a super-block's dot one
    integer vector on 64-byte runs (q3k_dot256) times d. The one-row kernel (_rows1_from_sums)
    takes the activations' group sums precomputed once per call, the same integers."""
    o = np.int64(off)
    c0, c1, c2, c3 = v.zero(), v.zero(), v.zero(), v.zero()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 110)
        e = 256 * sb
        c0 = _q3_k_row(0, R, p, o, e, c0)
        if nx > 1:
            c1 = _q3_k_row(1, R, p, o, e, c1)
            c2 = _q3_k_row(2, R, p, o, e, c2)
            c3 = _q3_k_row(3, R, p, o, e, c3)
        o += 110
    return v.hsum(c0), v.hsum(c1), v.hsum(c2), v.hsum(c3)


@njit(**_INL)
def _kv(t, p, o):
    """The IQ4 code book's values of the 32 nibbles at p + o (nib16's order), as signed bytes."""
    return s.b_lut16(t, s.nib16(p, o))


@njit(**_INL)
def _iq4_xs(p, off, n_in, R, nx):
    """136 B / 256: f16 d, u16 scales_h, scales_l[4] (6-bit scales, one per sub-block), qs[128]
    (16 B per sub-block as Q4_0's): w = d (sc - 32) KV[q], KV (|KV| <= 127) looked up 32 codes
    at a time (vpshufb) and dotted signed (psignb)."""
    o, t = np.int64(off), s.ld_b(addr(KV2_IQ4NL), 0)
    c0, c1, c2, c3 = _zeros()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 136)
        W = (_kv(t, p, o + 8), _kv(t, p, o + 24), _kv(t, p, o + 40), _kv(t, p, o + 56),
             _kv(t, p, o + 72), _kv(t, p, o + 88), _kv(t, p, o + 104), _kv(t, p, o + 120))
        U = (s.b_abs(W[0]), s.b_abs(W[1]), s.b_abs(W[2]), s.b_abs(W[3]),
             s.b_abs(W[4]), s.b_abs(W[5]), s.b_abs(W[6]), s.b_abs(W[7]))
        c = s.f8_mul(blk.iq4xs_scales(p, o + 2), s.f8_splat(f16_at(p, o)))
        c0, c1, c2, c3 = _sb(U, W, _NK, 1, c, c, False, 256 * sb, nx, R, c0, c1, c2, c3)
        o += 136
    return _fin(c0, c1, c2, c3)


@njit(**_INL)
def _iq4_nl(p, off, n_in, R, nx):
    """18 B / 32: f16 d, 16 B of nibbles as Q4_0's: w = d KV[q]."""
    o, t = np.int64(off), s.ld_b(addr(KV2_IQ4NL), 0)
    c0, c1, c2, c3 = _zeros()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 144)
        W = (_kv(t, p, o + 2), _kv(t, p, o + 20), _kv(t, p, o + 38), _kv(t, p, o + 56),
             _kv(t, p, o + 74), _kv(t, p, o + 92), _kv(t, p, o + 110), _kv(t, p, o + 128))
        U = (s.b_abs(W[0]), s.b_abs(W[1]), s.b_abs(W[2]), s.b_abs(W[3]),
             s.b_abs(W[4]), s.b_abs(W[5]), s.b_abs(W[6]), s.b_abs(W[7]))
        c = s.f8_of_f16(p, o, 18)
        c0, c1, c2, c3 = _sb(U, W, _NK, 1, c, c, False, 256 * sb, nx, R, c0, c1, c2, c3)
        o += 144
    return _fin(c0, c1, c2, c3)


@njit(**_INL)
def _q5_0_u(p, o):
    """A Q5_0 / Q5_1 block's 32 codes: its nibbles at p + o + 4 (nib16's order) with the fifth
    bits of the u32 at p + o (bit j: element j) on top."""
    return s.b_or(s.nib16(p, o + 4), s.b_shl(s.b_bits(s.u32_at(p, o)), 4))


@njit(**_INL)
def _q4_1_q5(p, off, n_in, R, nx, five, has_min):
    """Q4_1 (20 B / 32: f16 d, f16 m, 16 B of nibbles), Q5_0 (22 B: d, u32 of fifth bits,
    nibbles) and Q5_1 (24 B: d, m, fifth bits, nibbles): w = d n + m (Q4_1, Q5_1) or
    d (n - 16) (Q5_0), the offset m (-16 d) x sum(a)."""
    o = np.int64(off)
    c0, c1, c2, c3 = _zeros()
    size = (24 if has_min else 22) if five else 20
    q = 4 if has_min else 2  # the fifth bits, or (Q4_1) the nibbles
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 8 * size)
        if five:
            U = (_q5_0_u(p, o + q), _q5_0_u(p, o + q + size), _q5_0_u(p, o + q + 2 * size),
                 _q5_0_u(p, o + q + 3 * size), _q5_0_u(p, o + q + 4 * size), _q5_0_u(p, o + q + 5 * size),
                 _q5_0_u(p, o + q + 6 * size), _q5_0_u(p, o + q + 7 * size))
        else:
            U = (s.nib16(p, o + 4), s.nib16(p, o + 24), s.nib16(p, o + 44), s.nib16(p, o + 64),
                 s.nib16(p, o + 84), s.nib16(p, o + 104), s.nib16(p, o + 124), s.nib16(p, o + 144))
        c = s.f8_of_f16(p, o, size)
        cm = s.f8_of_f16(p, o + 2, size) if has_min else s.f8_mul(c, s.f8_splat(np.float32(-16.0)))
        c0, c1, c2, c3 = _sb(U, U, _NK, 0, c, cm, True, 256 * sb, nx, R, c0, c1, c2, c3)
        o += 8 * size
    return _fin(c0, c1, c2, c3)


@njit(**_INL)
def _mxfp4(p, off, n_in, R, nx):
    """17 B / 32: an E8M0 exponent e, 16 B of E2M1 nibbles (nib16's order): w = 2^(e - 128) x
    KV2[n] (the doubled E2M1 values, |KV2| <= 12, looked up with vpshufb, dotted signed)."""
    o, t = np.int64(off), s.ld_b(addr(KV2_E2M1), 0)
    c0, c1, c2, c3 = _zeros()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 136)
        W = (_kv(t, p, o + 1), _kv(t, p, o + 18), _kv(t, p, o + 35), _kv(t, p, o + 52),
             _kv(t, p, o + 69), _kv(t, p, o + 86), _kv(t, p, o + 103), _kv(t, p, o + 120))
        U = (s.b_abs(W[0]), s.b_abs(W[1]), s.b_abs(W[2]), s.b_abs(W[3]),
             s.b_abs(W[4]), s.b_abs(W[5]), s.b_abs(W[6]), s.b_abs(W[7]))
        c = blk.e8m0_halves(p, o, 17)
        c0, c1, c2, c3 = _sb(U, W, _NK, 1, c, c, False, 256 * sb, nx, R, c0, c1, c2, c3)
        o += 136
    return _fin(c0, c1, c2, c3)


@njit(**_INL)
def _nv_w(t, p, o, j):
    """NVFP4 sub-block j (of 256 weights) as signed KV2 codes: the second or first half of
    block j // 2's 32 code bytes."""
    return s.b_lut16(t, blk.nib8x2(p, o + 36 * (j // 2) + 4 + 16 * (j % 2)))


@njit(**_INL)
def _nvfp4(p, off, n_in, R, nx):
    """36 B / 64: 4 UE4M3 scales (one per 16 weights), 32 B of E2M1 nibbles (8 B per 16 weights:
    the low nibbles first): w = UE4M3(s) / 2 x KV2[n]. Float scales per 16 weights: summed per
    16 as Q6_K's (hsum4x8_halves), four blocks per 256."""
    o, t = np.int64(off), s.ld_b(addr(KV2_E2M1), 0)
    c0, c1, c2, c3 = _zeros()
    for sb in range(n_in // 256):
        s.prefetch_lines(p, o + PREFETCH_BYTES, 144)
        W = (_nv_w(t, p, o, 0), _nv_w(t, p, o, 1), _nv_w(t, p, o, 2), _nv_w(t, p, o, 3),
             _nv_w(t, p, o, 4), _nv_w(t, p, o, 5), _nv_w(t, p, o, 6), _nv_w(t, p, o, 7))
        U = (s.b_abs(W[0]), s.b_abs(W[1]), s.b_abs(W[2]), s.b_abs(W[3]),
             s.b_abs(W[4]), s.b_abs(W[5]), s.b_abs(W[6]), s.b_abs(W[7]))
        cA, cB = blk.nvfp4_scales(p, o)
        e = 256 * sb
        c0 = _q6_row(0, R, U, W, cA, cB, e, c0)
        if nx > 1:
            c1 = _q6_row(1, R, U, W, cA, cB, e, c1)
            c2 = _q6_row(2, R, U, W, cA, cB, e, c2)
            c3 = _q6_row(3, R, U, W, cA, cB, e, c3)
        o += 144
    return _fin(c0, c1, c2, c3)


@njit(**_JIT)
def int_dots(qtype, p, off, n_in, R, nx):
    """(W . a0, .., W . a3) for the row W of `qtype` (has_int) at address p + off and the
    quantized activation rows R (see above): nx = 1 computes row 0 alone (the rest 0), any other
    nx all four (the caller repeats a row where it has fewer)."""
    return _int_dot(qtype, p, off, n_in, R, nx)


@njit(**_JIT)
def int_rows1(qtype, p, off, rb, n, n_in, R, out):
    """out[i] = W_i . a0 for the n rows W_i of `qtype` (has_int) at p + off + i rb and the
    activation row 0 of R: a decode step's matrix span in one call. The type's code is inlined
    here with one activation row as a constant, so it keeps no other rows' accumulators, and the
    dispatch on the type is a predicted branch, not a call per row (2.7x int_dots' rate per row
    on 1024-wide Q8_0 rows)."""
    s.prefetch_lines(p, off, min(n * rb, PREFETCH_BYTES))  # (the span's head at once: its misses overlap)
    if qtype == _Q1_0:
        _q1_0_rows1(p, off, rb, n, n_in, R, out)
        return
    if qtype == _TQ2_0 or qtype == _TQ1_0 or qtype == _Q2_K or qtype == _Q3_K:
        _rows1_from_sums(qtype, p, off, rb, n, n_in, R, out)
        return
    for i in range(n):
        out[i] = _int_dot(qtype, p, off + i * rb, n_in, R, 1)[0]


@njit(**_INL)
def _int_dot(qtype, p, off, n_in, R, nx):
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
    if qtype == _Q2_K:
        return _q2_k(p, off, n_in, R, nx)
    if qtype == _IQ2_XXS:
        return _iq2_xxs(p, off, n_in, R, nx)
    if qtype == _IQ1_S:
        return _iq1_s(p, off, n_in, R, nx)
    if qtype == _TQ1_0:
        return _ternary(p, off, n_in, R, nx, True)
    if qtype == _Q1_0:
        return _q1_0(p, off, n_in, R, nx)
    if qtype == _IQ2_XS:
        return _iq2_xs(p, off, n_in, R, nx)
    if qtype == _IQ2_S:
        return _iq2_s(p, off, n_in, R, nx)
    if qtype == _IQ3_XXS:
        return _iq3_xxs(p, off, n_in, R, nx)
    if qtype == _IQ3_S:
        return _iq3_s(p, off, n_in, R, nx)
    if qtype == _IQ1_M:
        return _iq1_m(p, off, n_in, R, nx)
    if qtype == _Q3_K:
        return _q3_k(p, off, n_in, R, nx)
    if qtype == _IQ4_XS:
        return _iq4_xs(p, off, n_in, R, nx)
    if qtype == _IQ4_NL:
        return _iq4_nl(p, off, n_in, R, nx)
    if qtype == _Q4_1:
        return _q4_1_q5(p, off, n_in, R, nx, False, True)
    if qtype == _Q5_0:
        return _q4_1_q5(p, off, n_in, R, nx, True, False)
    if qtype == _Q5_1:
        return _q4_1_q5(p, off, n_in, R, nx, True, True)
    if qtype == _MXFP4:
        return _mxfp4(p, off, n_in, R, nx)
    if qtype == _NVFP4:
        return _nvfp4(p, off, n_in, R, nx)
    return _ternary(p, off, n_in, R, nx, False)


@njit(**_INL)
def act_rows(qa, qd, qs, i0, i1, i2, i3):
    """R for rows i0 .. i3 of the quantized activations (q [N, n], d [N, n/32], ds [N, n/32]), per
    32 or wide as the weights' type takes them (is_wide)."""
    a, d, sm = addr(qa), addr(qd), addr(qs)
    n, nd, ns = np.int64(qa.shape[1]), np.int64(qd.shape[1]) * 4, np.int64(qs.shape[1]) * 4
    return (a + i0 * n, a + i1 * n, a + i2 * n, a + i3 * n, d + i0 * nd, d + i1 * nd, d + i2 * nd, d + i3 * nd,
            sm + i0 * ns, sm + i1 * ns, sm + i2 * ns, sm + i3 * ns)
