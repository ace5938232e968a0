"""Scalar helpers every numba row decoder shares (rows.py and its sibling decoder files):
register bitcasts, the opaque trip count that keeps block loops vectorized, exact float16 and
int8 widening, and the jit options.

A kernel in rows.py inlines decoders from several files while numba's cache checks only
the kernel's own file: `stamp_together` below (imported first by every rows*.py) makes
each of their cached functions carry the hash of all of them.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .jit_cache import stamp_together

stamp_together(__file__, ("rows.py", "rows_q.py", "rows_iq.py", "rows_dot.py", "simd/vectors.py",
                          "rows_int.py", "simd/integer.py", "attention.py",
                          "simd/blocks.py"))  # before the first @njit(cache=True)

# Reassociation lets LLVM vectorize the 32-wide block loops and the dot reductions; no
# nnan/ninf so the f16 decoder's inf/NaN handling stays as written, no afn for exp.
_FM = {"reassoc", "contract", "nsz", "arcp"}
_JIT = {"cache": True, "fastmath": _FM, "nogil": True}
# Decoders whose float arithmetic must round as gguf-py's numpy does (a multiply then an add,
# never fused into one FMA): no fast-math flags at all. Their loops need none to vectorize.
_JIT_EXACT = {"cache": True, "nogil": True}


# -- scalar helpers ---------------------------------------------------------------------------
@intrinsic
def _as_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32 (a register bitcast)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if v.type.width != 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _opaque(typingctx, value):
    """`value`, hidden from the optimizer (an empty inline asm).

    The block loops use it as their trip count: LLVM fully unrolls a constant 32-trip loop into
    scalar code before its loop vectorizer runs, and the SLP vectorizer then cannot reorder the
    byte loads past the float stores (numba gives no no-alias facts); a run-time trip count
    keeps the loop, which the loop vectorizer widens behind a run-time overlap check (3x faster).
    """
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        ty = args[0].type
        return builder.asm(ir.FunctionType(ty, [ty]), "", "=r,0", [args[0]], side_effect=False)

    return value(value), codegen


@intrinsic
def _f32_bits(typingctx, value):
    """The bits of a float32, as an int32."""
    if not isinstance(value, types.Float) or value.bitwidth != 32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(value), codegen


@njit(**_JIT)
def _f16(lo, hi):
    """The float16 stored little-endian in bytes (lo, hi), widened exactly to float32.

    Branch-free in effect (three cheap cases LLVM turns into selects), so F16 rows vectorize;
    the sign is OR-ed into the bits so -0.0 stays -0.0 under the 'nsz' fast-math flag."""
    h = np.int32(lo) | (np.int32(hi) << 8)
    em = h & 0x7FFF  # exponent and mantissa
    if em < 0x400:  # zero or subnormal: man * 2**-24, exact in float32
        bits = _f32_bits(_fi(em) * np.float32(5.9604644775390625e-08))
    elif em >= 0x7C00:  # inf / NaN, payload kept
        bits = (em << 13) | 0x7F800000
    else:  # rebias the exponent: 127 - 15 = 112
        bits = (em << 13) + (112 << 23)
    return _as_f32(bits | ((h & 0x8000) << 16))


@njit(**_JIT)
def _i8(b):
    """A uint8 byte read as int8, as float32."""
    return np.float32(np.int8(b))  # same-width cast: the bits reinterpreted


@njit(**_JIT)
def _fi(v):
    """A small integer as float32. numba widens integer arithmetic to int64; truncating to
    int32 first lets LLVM narrow the vector lanes (it widened 8 bytes to 8 x 64 bits without)."""
    return np.float32(np.int32(v))


# Indices are unsigned (_U): numba adds a negative-index wraparound select to every signed
# index it cannot prove >= 0, which cost a third of the decode time. (Mixing uint64 with int64
# makes a float64 in numba, so every index term goes through _U.)
_U = np.uint64


@njit(**_JIT)
def _e2m1x2(n):
    """An E2M1 code n (sign, 2 exponent bits, 1 mantissa bit) doubled, as float32, from its bits
    (no table: integer selects keep the block loop vectorized; a table lookup made it ~15x slower):
    exponent 0 -> m (0 or 1), else (2 + m) * 2^(e - 1) = the float32 with exponent e + 127."""
    e, m = (n >> 1) & 3, n & 1
    bits = (((e + 127) << 23) | (m << 22)) if e else m * 0x3F800000
    return _as_f32(bits | ((n & 8) << 28))

