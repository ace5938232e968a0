"""numba row decoders for the grid ("i-quant") types: one row of GGUF blocks -> float32.

Dispatched from `cpu_rows.decode_row` / `row_bytes` (whose kernels inline them; `jit_cache`
makes numba's cache see this file). Every type is a 256-weight super-block of 8 sub-blocks of 32
weights, each weight group of 8 (or 4) one index into a code book ("grid") of small integers,
with sign bits and a scale. Layouts (ggml-common.h `block_iq*`; little-endian; d = f16):

  type     bytes  layout                                         per sub-block ib (32 weights)
  IQ2_XXS  66     d | u32 pairs [8] (4 grid bytes, aux)         aux: 4 x 7-bit sign index, scale 28..31
  IQ2_XS   74     d | u16 qs[32] | u8 scales[8]                 qs: 9-bit grid index, 7-bit sign index
  IQ2_S    82     d | qs[32] | signs[32] | qh[8] | scales[8]    index = qs | 2 bits of qh << 8
  IQ3_XXS  98     d | qs[64] | u32 aux[8]                       4-weight grid; aux as IQ2_XXS's
  IQ3_S    110    d | qs[64] | qh[8] | signs[32] | scales[4]    index = qs | 1 bit of qh << 8
  IQ1_S    50     d | qs[32] | u16 qh[8]                        qh: 4 x 3 index bits, scale, delta sign
  IQ1_M    56     qs[32] | qh[16] | u16 sc[4]                   d split over the top nibbles of sc

Weights (gguf-py `gguf/quants.py`, ggml-quants.c `dequantize_row_iq*`, same float32 order):
  IQ2_*   (d * (0.5 + s) * 0.25) * grid * sign      s: 4-bit scale (per 32 or per 16 weights)
  IQ3_XXS (d * (0.5 + s) * 0.5) * grid * sign
  IQ3_S   (d * (1 + 2 s)) * grid * sign
  IQ1_*   (d * (2 s + 1)) * (grid + delta), delta = +-0.125      grid values in {-1, 0, 1}
Sign indices of 7 bits expand through ksigns (the 8th bit makes the count of minus signs even).
A sign is applied to the integer grid value ((g ^ m) - m, m = 0 or -1) before the one float
multiply, which is exact: the result is the same bits as gguf-py's (db * g) * (+-1).

The code books are gguf-py's (`init_grid`: ggml's iq*_grid tables), as numpy constants numba
freezes into the kernels: 8 grid bytes per index, so a weight group is one 8-byte row.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq
from numba import njit

from .cpu_rows import _JIT, _U, _f16, _fi, _opaque


def _grid(cls: type, dtype: type) -> np.ndarray:
    """gguf-py's code book of `cls`, flattened: [n_entries * entry_len] of the grid's integers."""
    cls.init_grid()
    g = np.asarray(cls.grid, dtype=np.float32).reshape(-1)
    out = g.astype(dtype)
    assert np.array_equal(out.astype(np.float32), g), cls.__name__  # small integers: exact
    return out


GRID_IQ2_XXS = _grid(gq.IQ2_XXS, np.uint8)  # [256 * 8]  values 8, 25, 43
GRID_IQ2_XS = _grid(gq.IQ2_XS, np.uint8)  # [512 * 8]
GRID_IQ2_S = _grid(gq.IQ2_S, np.uint8)  # [1024 * 8]
GRID_IQ3_XXS = _grid(gq.IQ3_XXS, np.uint8)  # [256 * 4]  values 4 .. 62
GRID_IQ3_S = _grid(gq.IQ3_S, np.uint8)  # [512 * 4]   odd values 1 .. 15
GRID_IQ1_S = _grid(gq.IQ1_S, np.int8)  # [2048 * 8]  values -1, 0, 1 (IQ1_M shares it)
KSIGNS = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).copy()  # [128] 7 sign bits -> 8
# SIGN_MASK[8 * b + k] = -1 where bit k of byte b is set, else 0
SIGN_MASK = -((np.arange(256)[:, None] >> np.arange(8)) & 1).astype(np.int8).reshape(-1)  # [256 * 8]
IQ1_DELTA = np.float32(gq.IQ1_S.delta)  # 0.125

GRID_TYPES = (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M)
# plain ints, so numba folds them as constants
_IQ2_XXS, _IQ2_XS, _IQ2_S = int(Q.IQ2_XXS), int(Q.IQ2_XS), int(Q.IQ2_S)
_IQ3_XXS, _IQ3_S, _IQ1_S, _IQ1_M = int(Q.IQ3_XXS), int(Q.IQ3_S), int(Q.IQ1_S), int(Q.IQ1_M)
_QUARTER, _HALF = np.float32(0.25), np.float32(0.5)
# The per-group helpers are inlined into numba's IR: left to LLVM, some stayed calls (an array
# struct built and passed per 8 weights).
_INLINE = {**_JIT, "inline": "always"}


# -- helpers --------------------------------------------------------------------------------------
@njit(**_INLINE)
def _u16(data, p):
    return np.int64(data[p]) | (np.int64(data[p + _U(1)]) << 8)


@njit(**_INLINE)
def _u32(data, p):
    return _u16(data, p) | (_u16(data, p + _U(2)) << 16)


@njit(**_INLINE)
def _signed8(w, e, grid, g, sign_byte, db):
    """w[e:e+8] = db * (+-grid[g:g+8]), minus where bit k of sign_byte is set."""
    lanes = _opaque(_U(8))
    m0 = _U(sign_byte) * _U(8)
    for k in range(lanes):
        v, m = np.int32(grid[g + k]), np.int32(SIGN_MASK[m0 + k])
        w[e + k] = db * _fi((v ^ m) - m)


@njit(**_INLINE)
def _signed4x2(w, e, grid, g0, g1, sign_byte, db):
    """The 4-weight grids: entries g0 then g1 (offsets into grid) signed by one byte."""
    lanes = _opaque(_U(4))
    m0 = _U(sign_byte) * _U(8)
    for k in range(lanes):
        v, m = np.int32(grid[g0 + k]), np.int32(SIGN_MASK[m0 + k])
        w[e + k] = db * _fi((v ^ m) - m)
        v, m = np.int32(grid[g1 + k]), np.int32(SIGN_MASK[m0 + _U(4) + k])
        w[e + _U(4) + k] = db * _fi((v ^ m) - m)


@njit(**_INLINE)
def _shifted8(w, e, g, delta, dl):
    """IQ1: w[e:e+8] = dl * (grid1[g:g+8] + delta)."""
    lanes = _opaque(_U(8))
    for k in range(lanes):
        w[e + k] = dl * (_fi(GRID_IQ1_S[g + k]) + delta)


# -- row decoders -------------------------------------------------------------------------------
@njit(**_JIT)
def _row_iq2_xxs(data, off, n_in, w):
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16(data[o], data[o + _U(1)])
        for ib in range(8):
            q = o + _U(2 + 8 * ib)  # 4 grid bytes, then aux
            aux = _u32(data, q + _U(4))
            db = d * (_HALF + _fi(aux >> 28)) * _QUARTER
            for l in range(4):
                g = _U(data[q + _U(l)]) * _U(8)
                _signed8(w, e, GRID_IQ2_XXS, g, KSIGNS[(aux >> (7 * l)) & 127], db)
                e += _U(8)
        o += _U(66)


@njit(**_JIT)
def _row_iq2_xs(data, off, n_in, w):
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16(data[o], data[o + _U(1)])
        for ib in range(8):
            sc = np.int32(data[o + _U(66 + ib)])
            db0 = d * (_HALF + _fi(sc & 15)) * _QUARTER  # weights 0-15 of the sub-block
            db1 = d * (_HALF + _fi(sc >> 4)) * _QUARTER  # weights 16-31
            for l in range(4):
                v = _u16(data, o + _U(2 + 8 * ib + 2 * l))
                _signed8(w, e, GRID_IQ2_XS, _U(v & 511) * _U(8), KSIGNS[v >> 9], db0 if l < 2 else db1)
                e += _U(8)
        o += _U(74)


@njit(**_JIT)
def _row_iq2_s(data, off, n_in, w):
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16(data[o], data[o + _U(1)])
        for ib in range(8):
            qh, sc = np.int64(data[o + _U(66 + ib)]), np.int32(data[o + _U(74 + ib)])
            db0 = d * (_HALF + _fi(sc & 15)) * _QUARTER
            db1 = d * (_HALF + _fi(sc >> 4)) * _QUARTER
            for l in range(4):
                i = _U(4 * ib + l)
                g = (np.int64(data[o + _U(2) + i]) | (((qh >> (2 * l)) & 3) << 8)) * 8
                _signed8(w, e, GRID_IQ2_S, _U(g), data[o + _U(34) + i], db0 if l < 2 else db1)
                e += _U(8)
        o += _U(82)


@njit(**_JIT)
def _row_iq3_xxs(data, off, n_in, w):
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16(data[o], data[o + _U(1)])
        for ib in range(8):
            aux = _u32(data, o + _U(66 + 4 * ib))
            db = d * (_HALF + _fi(aux >> 28)) * _HALF
            q = o + _U(2 + 8 * ib)
            for l in range(4):
                g0, g1 = _U(data[q + _U(2 * l)]) * _U(4), _U(data[q + _U(2 * l + 1)]) * _U(4)
                _signed4x2(w, e, GRID_IQ3_XXS, g0, g1, KSIGNS[(aux >> (7 * l)) & 127], db)
                e += _U(8)
        o += _U(98)


@njit(**_JIT)
def _row_iq3_s(data, off, n_in, w):
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16(data[o], data[o + _U(1)])
        for ib in range(8):
            sc = (np.int32(data[o + _U(106 + ib // 2)]) >> (4 * (ib % 2))) & 15
            db = d * _fi(1 + 2 * sc)
            qh = np.int64(data[o + _U(66 + ib)])
            q = o + _U(2 + 8 * ib)
            for l in range(4):
                g0 = (np.int64(data[q + _U(2 * l)]) | (((qh >> (2 * l)) & 1) << 8)) * 4
                g1 = (np.int64(data[q + _U(2 * l + 1)]) | (((qh >> (2 * l + 1)) & 1) << 8)) * 4
                _signed4x2(w, e, GRID_IQ3_S, _U(g0), _U(g1), data[o + _U(74 + 4 * ib + l)], db)
                e += _U(8)
        o += _U(110)


@njit(**_JIT)
def _row_iq1_s(data, off, n_in, w):
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16(data[o], data[o + _U(1)])
        for ib in range(8):
            h = _u16(data, o + _U(34 + 2 * ib))
            dl = d * _fi(2 * ((h >> 12) & 7) + 1)
            delta = -IQ1_DELTA if h & 0x8000 else IQ1_DELTA
            for l in range(4):
                g = (np.int64(data[o + _U(2 + 4 * ib + l)]) | (((h >> (3 * l)) & 7) << 8)) * 8
                _shifted8(w, e, _U(g), delta, dl)
                e += _U(8)
        o += _U(50)


@njit(**_JIT)
def _row_iq1_m(data, off, n_in, w):
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        s0, s1, s2, s3 = _u16(data, o + _U(48)), _u16(data, o + _U(50)), _u16(data, o + _U(52)), _u16(data, o + _U(54))
        bits = (s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000)  # the f16 d
        d = _f16(bits & 0xFF, bits >> 8)
        for ib in range(8):
            s = _u16(data, o + _U(48 + 2 * (ib // 2))) >> (6 * (ib % 2))
            dl0 = d * _fi(2 * (s & 7) + 1)  # weights 0-15 of the sub-block
            dl1 = d * _fi(2 * ((s >> 3) & 7) + 1)  # weights 16-31
            for l in range(4):
                hh = np.int64(data[o + _U(32 + 2 * ib + l // 2)]) >> (4 * (l % 2))  # this group's nibble
                g = (np.int64(data[o + _U(4 * ib + l)]) | ((hh & 7) << 8)) * 8
                _shifted8(w, e, _U(g), -IQ1_DELTA if hh & 8 else IQ1_DELTA, dl0 if l < 2 else dl1)
                e += _U(8)
        o += _U(56)


# -- dispatch (called from cpu_rows) --------------------------------------------------------------
@njit(**_JIT)
def is_grid(qtype):
    return qtype in (_IQ2_XXS, _IQ2_XS, _IQ2_S, _IQ3_XXS, _IQ3_S, _IQ1_S, _IQ1_M)


@njit(**_JIT)
def grid_row_bytes(qtype, n_in):
    """Bytes of one row of `n_in` values of a grid type."""
    size = 66
    if qtype == _IQ2_XS:
        size = 74
    elif qtype == _IQ2_S:
        size = 82
    elif qtype == _IQ3_XXS:
        size = 98
    elif qtype == _IQ3_S:
        size = 110
    elif qtype == _IQ1_S:
        size = 50
    elif qtype == _IQ1_M:
        size = 56
    return n_in // 256 * size


@njit(**_JIT)
def decode_grid_row(qtype, data, off, n_in, w):
    """The grid-type row at data[off:] -> w[:n_in] float32."""
    if qtype == _IQ2_XXS:
        _row_iq2_xxs(data, off, n_in, w)
    elif qtype == _IQ2_XS:
        _row_iq2_xs(data, off, n_in, w)
    elif qtype == _IQ2_S:
        _row_iq2_s(data, off, n_in, w)
    elif qtype == _IQ3_XXS:
        _row_iq3_xxs(data, off, n_in, w)
    elif qtype == _IQ3_S:
        _row_iq3_s(data, off, n_in, w)
    elif qtype == _IQ1_S:
        _row_iq1_s(data, off, n_in, w)
    else:
        _row_iq1_m(data, off, n_in, w)
