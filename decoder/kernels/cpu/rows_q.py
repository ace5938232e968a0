"""Numba row decoders for the legacy, K, non-linear, ternary, 1-bit and NVFP4 types that
rows.py dispatches to: `_row_<type>(data, off, n_in, w)` turns the row of GGUF blocks at
data[off:] into w[:n_in] float32, bit for bit as gguf-py's numpy `dequantize_blocks` computes
it (f16 scales widened exactly, then the same float32 operations in the same order, no FMA:
`_JIT_EXACT`). Layouts (byte offsets in a block; gguf-py `gguf/quants.py`, ggml-common.h):

  Q4_1    20 B / 32   d f16 @0, m f16 @2, qs[16] @4 (elements 0-15 low nibbles)  w = d*q + m
  Q5_0    22 B / 32   d @0, qh u32 @2 (bit j: 5th bit of element j), qs[16] @6  w = d*(q - 16)
  Q5_1    24 B / 32   d @0, m @2, qh @4, qs @8                                   w = d*q + m
  Q2_K    84 B / 256  scales[16] @0 (lo nibble sc, hi m), qs[64] @16, d @80, dmin @82
                      element 128h + 32s + l = (qs[32h + l] >> 2s) & 3     w = d*sc*q - dmin*m
  Q3_K   110 B / 256  hmask[32] @0, qs[64] @32, 6-bit scales[12] @96, d @108; element e as Q2_K,
                      minus 4 where bit e // 32 of hmask[e % 32] is clear   w = d*(sc - 32)*q
  IQ4_NL  18 B / 32   d @0, qs[16] @2 (as Q4_0)                              w = d*KV[q]
  IQ4_XS 136 B / 256  d @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8 (16 B per 32)
                                                                       w = d*(sc - 32)*KV[q]
  TQ1_0   54 B / 256  qs[48] @0, qh[4] @48, d @52: base-3 digits, digit p of byte b is
                      ((b * 3^p mod 256) * 3) >> 8                           w = d*(digit - 1)
  TQ2_0   66 B / 256  qs[64] @0 (as Q2_K's codes), d @64                     w = d*(q - 1)
  Q1_0    18 B / 128  d @0, qs[16] @2: bit j % 8 of qs[j // 8]               w = bit ? d : -d
  NVFP4   36 B / 64   d[4] UE4M3 @0 (one per 16), qs[32] @4 (8 B per 16: low nibbles first)
                                                                    w = UE4M3(d)/2 * E2M1x2[q]
Q1_0 is ggml type 41 (llama.cpp ggml/src/ggml-common.h `block_q1_0`, ggml/src/ggml-quants.c
`dequantize_row_q1_0`); gguf-py has no dequantizer for it. NVFP4 follows gguf-py's `NVFP4` and
ggml's `block_nvfp4` / `dequantize_row_nvfp4` (ggml_ue4m3_to_fp32 in ggml-impl.h).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .rows_base import _JIT_EXACT, _U, _as_f32, _f16, _f32_bits, _fi, _opaque

# IQ4_NL / IQ4_XS code book (ggml's kvalues_iq4nl)
_KV_IQ4NL = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), np.float32)


@njit(**_JIT_EXACT)
def _f16_at(data, o):
    return _f16(data[o], data[o + _U(1)])


@njit(**_JIT_EXACT)
def _u32_at(data, o):
    return (np.int64(data[o]) | (np.int64(data[o + _U(1)]) << 8) | (np.int64(data[o + _U(2)]) << 16)
            | (np.int64(data[o + _U(3)]) << 24))


@njit(**_JIT_EXACT)
def _row_q4_1(data, off, n_in, w):
    lanes = _opaque(_U(16))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 32):
        d, m, q = _f16_at(data, o), _f16_at(data, o + _U(2)), o + _U(4)
        for k in range(lanes):
            c = np.int32(data[q + k])
            w[e + k] = d * _fi(c & 0xF) + m
            w[e + _U(16) + k] = d * _fi(c >> 4) + m
        o += _U(20)
        e += _U(32)


@njit(**_JIT_EXACT)
def _q5_block(data, q, qh, d, m, has_min, w, e, lanes):
    """One Q5_0 / Q5_1 block's 32 values: nibbles at data[q:], fifth bits in the u32 qh."""
    for k in range(lanes):
        c = np.int32(data[q + k])
        lo = (c & 0xF) | (np.int32((qh >> np.int64(k)) & 1) << 4)
        hi = (c >> 4) | (np.int32((qh >> (np.int64(k) + 16)) & 1) << 4)
        if has_min:
            w[e + k] = d * _fi(lo) + m
            w[e + _U(16) + k] = d * _fi(hi) + m
        else:
            w[e + k] = d * _fi(lo - 16)
            w[e + _U(16) + k] = d * _fi(hi - 16)


@njit(**_JIT_EXACT)
def _row_q5_0(data, off, n_in, w):
    lanes = _opaque(_U(16))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 32):
        _q5_block(data, o + _U(6), _u32_at(data, o + _U(2)), _f16_at(data, o), np.float32(0), False, w, e, lanes)
        o += _U(22)
        e += _U(32)


@njit(**_JIT_EXACT)
def _row_q5_1(data, off, n_in, w):
    lanes = _opaque(_U(16))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 32):
        _q5_block(data, o + _U(8), _u32_at(data, o + _U(4)), _f16_at(data, o), _f16_at(data, o + _U(2)), True,
                  w, e, lanes)
        o += _U(24)
        e += _U(32)


# The K decoders keep each group's scales in scalars: a per-row np.empty scale array (a heap
# allocation per decoded row) cost them ~8 %.
@njit(**_JIT_EXACT)
def _q2_k_scale(data, s, d, dmin):
    """(d * sc, dmin * m) of the Q2_K scale byte at data[s]: sc in the low nibble, m in the high."""
    sc = np.int32(data[s])
    return d * _fi(sc & 0xF), dmin * _fi(sc >> 4)


@njit(**_JIT_EXACT)
def _row_q2_k(data, off, n_in, w):
    """Sub-block i (16 values) = elements 16i ..: scale byte i. Group (h, t) is the 16-lane pass
    over bytes 32h + 16t + k: element 128h + 32s + 16t + k, sub-block 8h + 2s + t."""
    lanes = _opaque(_U(16))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d, dmin = _f16_at(data, o + _U(80)), _f16_at(data, o + _U(82))
        for h in range(2):
            for t in range(2):
                q, y, i = o + _U(16 + 32 * h + 16 * t), e + _U(128 * h + 16 * t), o + _U(8 * h + t)
                d0, m0 = _q2_k_scale(data, i, d, dmin)
                d1, m1 = _q2_k_scale(data, i + _U(2), d, dmin)
                d2, m2 = _q2_k_scale(data, i + _U(4), d, dmin)
                d3, m3 = _q2_k_scale(data, i + _U(6), d, dmin)
                for k in range(lanes):
                    c = np.int32(data[q + k])
                    w[y + k] = d0 * _fi(c & 3) - m0
                    w[y + _U(32) + k] = d1 * _fi((c >> 2) & 3) - m1
                    w[y + _U(64) + k] = d2 * _fi((c >> 4) & 3) - m2
                    w[y + _U(96) + k] = d3 * _fi(c >> 6) - m3
        o += _U(84)
        e += _U(256)


@njit(**_JIT_EXACT)
def _q3_k_scale(data, s, i, d):
    """d * (6-bit scale i - 32) of the 12 scale bytes at data[s:]: the low nibble from byte i % 8
    (low half for i < 8), the high 2 bits from byte 8 + i % 4 (bits 2 * (i // 4))."""
    lo = (np.int32(data[s + _U(i % 8)]) >> (4 * (i // 8))) & 0xF
    hi = (np.int32(data[s + _U(8 + i % 4)]) >> (2 * (i // 4))) & 3
    return d * _fi((lo | (hi << 4)) - 32)


@njit(**_JIT_EXACT)
def _q3_k_group(data, q, m, y, d0, d1, d2, d3, hs, w, lanes):
    """One 16-lane group (as Q2_K's): codes at data[q:], mask bytes at data[m:] whose bits
    hs .. hs + 3 are the group's (hs a constant at each call, so the shift stays vectorized)."""
    for k in range(lanes):
        c, b = np.int32(data[q + k]), np.int32(data[m + k]) >> hs
        w[y + k] = d0 * _fi((c & 3) - ((~b & 1) << 2))
        w[y + _U(32) + k] = d1 * _fi(((c >> 2) & 3) - ((~b & 2) << 1))
        w[y + _U(64) + k] = d2 * _fi(((c >> 4) & 3) - (~b & 4))
        w[y + _U(96) + k] = d3 * _fi((c >> 6) - ((~b & 8) >> 1))


@njit(**_JIT_EXACT)
def _row_q3_k(data, off, n_in, w):
    lanes = _opaque(_U(16))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d, s = _f16_at(data, o + _U(108)), o + _U(96)
        for t in range(2):  # h = 0 then h = 1 (mask bits 4..7) as two calls: constant shifts
            m = o + _U(16 * t)
            _q3_k_group(data, o + _U(32 + 16 * t), m, e + _U(16 * t), _q3_k_scale(data, s, t, d),
                        _q3_k_scale(data, s, t + 2, d), _q3_k_scale(data, s, t + 4, d),
                        _q3_k_scale(data, s, t + 6, d), 0, w, lanes)
            _q3_k_group(data, o + _U(64 + 16 * t), m, e + _U(128 + 16 * t), _q3_k_scale(data, s, 8 + t, d),
                        _q3_k_scale(data, s, 10 + t, d), _q3_k_scale(data, s, 12 + t, d),
                        _q3_k_scale(data, s, 14 + t, d), 4, w, lanes)
        o += _U(110)
        e += _U(256)


@njit(**_JIT_EXACT)
def _row_iq4_nl(data, off, n_in, w):
    lanes = _opaque(_U(16))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 32):
        d, q = _f16_at(data, o), o + _U(2)
        for k in range(lanes):
            c = data[q + k]
            w[e + k] = d * _KV_IQ4NL[c & 0xF]
            w[e + _U(16) + k] = d * _KV_IQ4NL[c >> 4]
        o += _U(18)
        e += _U(32)


@njit(**_JIT_EXACT)
def _row_iq4_xs(data, off, n_in, w):
    lanes = _opaque(_U(16))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d, sh = _f16_at(data, o), np.int32(data[o + _U(2)]) | (np.int32(data[o + _U(3)]) << 8)
        for j in range(8):
            lo = (np.int32(data[o + _U(4 + j // 2)]) >> (4 * (j % 2))) & 0xF
            dl = d * _fi((lo | (((sh >> (2 * j)) & 3) << 4)) - 32)
            q, y = o + _U(8 + 16 * j), e + _U(32 * j)
            for k in range(lanes):
                c = data[q + k]
                w[y + k] = dl * _KV_IQ4NL[c & 0xF]
                w[y + _U(16) + k] = dl * _KV_IQ4NL[c >> 4]
        o += _U(136)
        e += _U(256)


@njit(**_JIT_EXACT)
def _trit(x):
    """(digit - 1 as float32, x for the next digit) for x = b * 3^p mod 256 of a TQ1_0 byte b:
    its digit p is (x * 3) >> 8 (gguf-py's formula, stepped: no vector multiply, 8 % faster)."""
    t = x * 3
    return _fi((t >> 8) - 1), t & 0xFF


@njit(**_JIT_EXACT)
def _row_tq1_0(data, off, n_in, w):
    """Elements 0-159: digit p of qs[l] (l < 32) at 32p + l; 160-239: digit p of qs[32 + l]
    (l < 16) at 160 + 16p + l; 240-255: digit p of qh[l] (l < 4, p < 4) at 240 + 4p + l."""
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16_at(data, o + _U(52))
        for k in range(_opaque(_U(32))):
            v0, x = _trit(np.int32(data[o + k]))
            v1, x = _trit(x)
            v2, x = _trit(x)
            v3, x = _trit(x)
            v4, x = _trit(x)
            w[e + k], w[e + _U(32) + k], w[e + _U(64) + k] = d * v0, d * v1, d * v2
            w[e + _U(96) + k], w[e + _U(128) + k] = d * v3, d * v4
        y = e + _U(160)
        for k in range(_opaque(_U(16))):
            v0, x = _trit(np.int32(data[o + _U(32) + k]))
            v1, x = _trit(x)
            v2, x = _trit(x)
            v3, x = _trit(x)
            v4, x = _trit(x)
            w[y + k], w[y + _U(16) + k], w[y + _U(32) + k] = d * v0, d * v1, d * v2
            w[y + _U(48) + k], w[y + _U(64) + k] = d * v3, d * v4
        for k in range(4):
            x = np.int32(data[o + _U(48 + k)])
            for p in range(4):
                v, x = _trit(x)
                w[e + _U(240 + 4 * p + k)] = d * v
        o += _U(54)
        e += _U(256)


@njit(**_JIT_EXACT)
def _row_tq2_0(data, off, n_in, w):
    lanes = _opaque(_U(32))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16_at(data, o + _U(64))
        for h in range(2):
            q, y = o + _U(32 * h), e + _U(128 * h)
            for k in range(lanes):
                c = np.int32(data[q + k])
                w[y + k] = d * _fi((c & 3) - 1)
                w[y + _U(32) + k] = d * _fi(((c >> 2) & 3) - 1)
                w[y + _U(64) + k] = d * _fi(((c >> 4) & 3) - 1)
                w[y + _U(96) + k] = d * _fi((c >> 6) - 1)
        o += _U(66)
        e += _U(256)


@njit(**_JIT_EXACT)
def _row_q1_0(data, off, n_in, w):
    """ggml's dequantize_row_q1_0 (ggml/src/ggml-quants.c): a set bit is +d, a clear one -d.
    The 128 bits are read as four little-endian 32-bit words and a clear bit flips d's sign bit
    (integer lanes only: selecting per bit from byte loads ran at half of Q4_K's speed)."""
    lanes = _opaque(_U(32))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 128):
        dbits = _f32_bits(_f16_at(data, o))
        for i in range(4):
            word = np.int32(_u32_at(data, o + _U(2 + 4 * i)))  # bit j: weight 32i + j
            y = e + _U(32 * i)
            for j in range(lanes):
                w[y + j] = _as_f32(dbits ^ ((~(word >> np.int32(j)) & 1) << 31))
        o += _U(18)
        e += _U(128)


@njit(**_JIT_EXACT)
def _ue4m3_half(x):
    """An unsigned E4M3 scale byte (bias 7) halved, as float32 (ggml_ue4m3_to_fp32 * 0.5 as
    gguf-py's NVFP4.ue4m3_to_fp32): 0 and 0x7F (NaN) give 0; the top bit is ignored."""
    ex, man = (x >> 3) & 0xF, x & 7
    if x == 0 or x == 0x7F:
        return np.float32(0.0)
    if ex == 0:  # subnormal: man * 2^-9, halved
        return _fi(man) * np.float32(2.0 ** -10)
    return _as_f32(((ex + 119) << 23) | (man << 20))  # (1 + man/8) * 2^(ex - 7) / 2


@njit(**_JIT_EXACT)
def _e2m1x2_pos0(n):
    """_e2m1x2, but code 8 is +0 as in gguf-py's table (its bits say -0; set in integers, since
    adding 0.0 was folded away)."""
    e, m = (n >> 1) & 3, n & 1
    bits = (((e + 127) << 23) | (m << 22)) if e else m * 0x3F800000
    return _as_f32(bits | (((n & 8) << 28) if n & 7 else 0))


@njit(**_JIT_EXACT)
def _row_nvfp4(data, off, n_in, w):
    lanes = _opaque(_U(8))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 64):
        for s in range(4):
            d = _ue4m3_half(np.int32(data[o + _U(s)]))
            q, y = o + _U(4 + 8 * s), e + _U(16 * s)
            for k in range(lanes):
                c = np.int32(data[q + k])
                w[y + k] = d * _e2m1x2_pos0(c & 0xF)
                w[y + _U(8) + k] = d * _e2m1x2_pos0(c >> 4)
        o += _U(36)
        e += _U(64)
