"""numba row decoders for the grid ("i-quant") types: one row of GGUF blocks -> float32.

Dispatched from `rows.decode_row` / `row_bytes` (whose kernels inline them; `jit_cache`
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
Signs are applied to the integer grid values before the one float multiply, which is exact:
the same bits as gguf-py's (db * g) * (+-1).

The code books are gguf-py's (`init_grid`: ggml's iq*_grid tables), as numpy constants numba
freezes into the kernels: 8 grid bytes per index, so a group of 8 weights is one uint64 lookup.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .rows_base import _JIT, _U, _f16, _fi, _i8, _opaque


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

# plain ints, so numba folds them as constants
_IQ2_XXS, _IQ2_XS, _IQ2_S = int(Q.IQ2_XXS), int(Q.IQ2_XS), int(Q.IQ2_S)
_IQ3_XXS, _IQ3_S, _IQ1_S, _IQ1_M = int(Q.IQ3_XXS), int(Q.IQ3_S), int(Q.IQ1_S), int(Q.IQ1_M)
_QUARTER, _HALF = np.float32(0.25), np.float32(0.5)
# The small helpers are inlined into numba's IR: left to LLVM, some stayed calls.
_INLINE = {**_JIT, "inline": "always"}


# -- helpers --------------------------------------------------------------------------------------
# A sub-block is decoded in two steps: its 4 groups of 8 signed int8 codes are assembled as four
# uint64 words in 32 bytes of stack (one table row, a sign mask and three integer ops per group),
# then one 32-lane loop scales them, the shape of Q8_0's decoder. Stack memory cannot alias the
# output, so that loop vectorizes without overlap checks; doing the groups one 8-lane loop at a
# time cost ~1.6x more per weight in the expert kernels.
_ONES = np.uint64(0x0101010101010101)
GRID64_IQ2_XXS = GRID_IQ2_XXS.view(np.uint64)  # [256] one group of 8 grid bytes per word
GRID64_IQ2_XS = GRID_IQ2_XS.view(np.uint64)  # [512]
GRID64_IQ2_S = GRID_IQ2_S.view(np.uint64)  # [1024]
GRID32_IQ3_XXS = GRID_IQ3_XXS.view(np.uint32)  # [256] 4 grid bytes per word
GRID32_IQ3_S = GRID_IQ3_S.view(np.uint32)  # [512]
SIGN64 = SIGN_MASK.view(np.uint64)  # [256] byte k = 0xFF where bit k of the index is set
KSIGN64 = SIGN64[KSIGNS]  # [128] the same, from a 7-bit ksigns index (one lookup, not two)
# IQ1: 8 * (grid + delta) as int8 codes (8g + 1 for delta +1/8, 8g - 1 for -1/8), scaled by dl / 8:
# the same real number as gguf-py's dl * (g + delta), rounded once, so the same bits
GRID64_IQ1 = np.stack([8 * GRID_IQ1_S.astype(np.int16) + 1, 8 * GRID_IQ1_S.astype(np.int16) - 1]
                      ).astype(np.int8).reshape(2, -1).view(np.uint64).reshape(-1)  # [2 * 2048]: +delta, -delta
_EIGHTH = np.float32(0.125)


@intrinsic
def _scratch(typingctx):
    """32 bytes of stack in the calling function, as 4 uint64 words."""
    def codegen(context, builder, signature, args):
        return cgutils.alloca_once(builder, ir.IntType(64), size=4)

    return types.CPointer(types.uint64)(), codegen


@intrinsic
def _bytes(typingctx, ptr):
    """A uint64 pointer as a uint8 pointer."""
    if not isinstance(ptr, types.CPointer):
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(8).as_pointer())

    return types.CPointer(types.uint8)(ptr), codegen


def _load_le(width: int):
    """An intrinsic (array, index) -> the little-endian uint`width` at array[index:], as int64:
    one unaligned load (numba's byte-by-byte assembly stayed 2-4 byte loads, shifts and ors)."""

    @intrinsic
    def load(typingctx, arr, idx):
        if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            a = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.bitcast(builder.gep(a.data, [args[1]]), ir.IntType(width).as_pointer())
            value = builder.load(ptr, align=1)
            return builder.zext(value, ir.IntType(64))

        return types.int64(arr, idx), codegen

    return load


_u16, _u32 = _load_le(16), _load_le(32)  # x86 and ARM64 are little-endian, as GGUF is


@njit(**_INLINE)
def _signed(g, m):
    """8 grid bytes g (each >= 1) negated where the mask bytes m are 0xFF: (g ^ m) + 1 per byte,
    which never carries into the next byte."""
    return (g ^ m) + (m & _ONES)


@njit(**_INLINE)
def _pair(grid32, i0, i1):
    """Two 4-byte grid entries as one word of 8 grid bytes."""
    return np.uint64(grid32[_U(i0)]) | (np.uint64(grid32[_U(i1)]) << np.uint64(32))


@njit(**_INLINE)
def _scale32(w, e, codes, db0, db1):
    """w[e:e+16] = db0 * codes[0:16], w[e+16:e+32] = db1 * codes[16:32] (int8 codes)."""
    lanes = _opaque(_U(8))  # one vector iteration of 4 x 8 lanes
    for k in range(lanes):
        w[e + k] = db0 * _i8(codes[k])
        w[e + _U(8) + k] = db0 * _i8(codes[_U(8) + k])
        w[e + _U(16) + k] = db1 * _i8(codes[_U(16) + k])
        w[e + _U(24) + k] = db1 * _i8(codes[_U(24) + k])


# -- row decoders -------------------------------------------------------------------------------
@njit(**_JIT)
def _row_iq2_xxs(data, off, n_in, w):
    p = _scratch()
    words, codes = carray(p, (4,)), carray(_bytes(p), (32,))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16(data[o], data[o + _U(1)])
        for ib in range(8):
            q = o + _U(2 + 8 * ib)  # 4 grid bytes, then aux
            aux = _u32(data, q + _U(4))
            for l in range(4):
                m = KSIGN64[(aux >> (7 * l)) & 127]
                words[l] = _signed(GRID64_IQ2_XXS[data[q + _U(l)]], m)
            db = d * (_HALF + _fi(aux >> 28)) * _QUARTER
            _scale32(w, e, codes, db, db)
            e += _U(32)
        o += _U(66)


@njit(**_JIT)
def _row_iq2_xs(data, off, n_in, w):
    p = _scratch()
    words, codes = carray(p, (4,)), carray(_bytes(p), (32,))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16(data[o], data[o + _U(1)])
        for ib in range(8):
            for l in range(4):
                v = _u16(data, o + _U(2 + 8 * ib + 2 * l))
                words[l] = _signed(GRID64_IQ2_XS[v & 511], KSIGN64[v >> 9])
            sc = np.int32(data[o + _U(66 + ib)])
            db0 = d * (_HALF + _fi(sc & 15)) * _QUARTER  # weights 0-15 of the sub-block
            db1 = d * (_HALF + _fi(sc >> 4)) * _QUARTER  # weights 16-31
            _scale32(w, e, codes, db0, db1)
            e += _U(32)
        o += _U(74)


@njit(**_JIT)
def _row_iq2_s(data, off, n_in, w):
    p = _scratch()
    words, codes = carray(p, (4,)), carray(_bytes(p), (32,))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16(data[o], data[o + _U(1)])
        for ib in range(8):
            qh = np.int64(data[o + _U(66 + ib)])
            for l in range(4):
                i = _U(4 * ib + l)
                g = np.int64(data[o + _U(2) + i]) | (((qh >> (2 * l)) & 3) << 8)
                words[l] = _signed(GRID64_IQ2_S[g], SIGN64[data[o + _U(34) + i]])
            sc = np.int32(data[o + _U(74 + ib)])
            db0 = d * (_HALF + _fi(sc & 15)) * _QUARTER
            db1 = d * (_HALF + _fi(sc >> 4)) * _QUARTER
            _scale32(w, e, codes, db0, db1)
            e += _U(32)
        o += _U(82)


@njit(**_JIT)
def _row_iq3_xxs(data, off, n_in, w):
    p = _scratch()
    words, codes = carray(p, (4,)), carray(_bytes(p), (32,))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16(data[o], data[o + _U(1)])
        for ib in range(8):
            aux = _u32(data, o + _U(66 + 4 * ib))
            q = o + _U(2 + 8 * ib)
            for l in range(4):
                g = _pair(GRID32_IQ3_XXS, data[q + _U(2 * l)], data[q + _U(2 * l + 1)])
                words[l] = _signed(g, KSIGN64[(aux >> (7 * l)) & 127])
            db = d * (_HALF + _fi(aux >> 28)) * _HALF
            _scale32(w, e, codes, db, db)
            e += _U(32)
        o += _U(98)


@njit(**_JIT)
def _row_iq3_s(data, off, n_in, w):
    p = _scratch()
    words, codes = carray(p, (4,)), carray(_bytes(p), (32,))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16(data[o], data[o + _U(1)])
        for ib in range(8):
            qh = np.int64(data[o + _U(66 + ib)])
            q = o + _U(2 + 8 * ib)
            for l in range(4):
                i0 = np.int64(data[q + _U(2 * l)]) | (((qh >> (2 * l)) & 1) << 8)
                i1 = np.int64(data[q + _U(2 * l + 1)]) | (((qh >> (2 * l + 1)) & 1) << 8)
                words[l] = _signed(_pair(GRID32_IQ3_S, i0, i1), SIGN64[data[o + _U(74 + 4 * ib + l)]])
            sc = (np.int32(data[o + _U(106 + ib // 2)]) >> (4 * (ib % 2))) & 15
            db = d * _fi(1 + 2 * sc)
            _scale32(w, e, codes, db, db)
            e += _U(32)
        o += _U(110)


@njit(**_JIT)
def _row_iq1_s(data, off, n_in, w):
    p = _scratch()
    words, codes = carray(p, (4,)), carray(_bytes(p), (32,))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16(data[o], data[o + _U(1)])
        for ib in range(8):
            h = _u16(data, o + _U(34 + 2 * ib))
            half = (h >> 15) * 2048  # the -delta half of the table
            for l in range(4):
                words[l] = GRID64_IQ1[half + (np.int64(data[o + _U(2 + 4 * ib + l)]) | (((h >> (3 * l)) & 7) << 8))]
            dl = d * _fi(2 * ((h >> 12) & 7) + 1) * _EIGHTH
            _scale32(w, e, codes, dl, dl)
            e += _U(32)
        o += _U(50)


@njit(**_JIT)
def _row_iq1_m(data, off, n_in, w):
    p = _scratch()
    words, codes = carray(p, (4,)), carray(_bytes(p), (32,))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        s0, s1, s2, s3 = _u16(data, o + _U(48)), _u16(data, o + _U(50)), _u16(data, o + _U(52)), _u16(data, o + _U(54))
        bits = (s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000)  # the f16 d
        d = _f16(bits & 0xFF, bits >> 8)
        for ib in range(8):
            nibbles = _u16(data, o + _U(32 + 2 * ib))  # per group: 3 index bits, the delta's sign
            for l in range(4):
                hh = nibbles >> (4 * l)
                g = np.int64(data[o + _U(4 * ib + l)]) | ((hh & 7) << 8)
                words[l] = GRID64_IQ1[((hh >> 3) & 1) * 2048 + g]
            s = _u16(data, o + _U(48 + 2 * (ib // 2))) >> (6 * (ib % 2))
            dl0 = d * _fi(2 * (s & 7) + 1) * _EIGHTH  # weights 0-15 of the sub-block
            dl1 = d * _fi(2 * ((s >> 3) & 7) + 1) * _EIGHTH  # weights 16-31
            _scale32(w, e, codes, dl0, dl1)
            e += _U(32)
        o += _U(56)


# -- dispatch (called from rows) --------------------------------------------------------------
@njit(**_JIT)
def is_grid(qtype):
    return qtype in (_IQ2_XXS, _IQ2_XS, _IQ2_S, _IQ3_XXS, _IQ3_S, _IQ1_S, _IQ1_M)


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
