"""The numba side of `qkernels`: row decoders (one row of GGUF blocks -> float32), dot
products, and the parallel expert kernels built on them.

The shared scalar helpers are in rows_base.py, the decoders of the other types in sibling
files (rows_q.py: Q4_1 Q5_0 Q5_1 Q2_K Q3_K IQ4_NL IQ4_XS TQ1_0 TQ2_0 Q1_0 NVFP4;
rows_iq.py: the grid types IQ1_S .. IQ3_S). numba's on-disk cache checks only the source
file of the function it compiled, so `jit_cache` stamps every rows*.py function with the
hash of all of them (else a kernel cached here would keep stale decoders inlined from a sibling).

Block layouts (gguf-py `gguf/quants.py`, ggml's block structs; f16 scales are decoded with
integer bit manipulation, subnormals included):
  Q8_0  34 B / 32:   f16 d, int8 q[32]                        w = d * q
  Q4_0  18 B / 32:   f16 d, 16 B nibbles (low nibbles = 0..15)  w = d * (q - 8)
  Q4_K  144 B / 256: f16 d, f16 dmin, 12 B of 6-bit (scale, min) x 8, 128 B nibbles
                     (32 B per pair of sub-blocks: low nibbles first)   w = d*sc*q - dmin*m
  Q5_K  176 B / 256: as Q4_K plus 32 B of high bits (bit j of byte l -> sub-block j, element l)
  Q6_K  210 B / 256: 128 B low nibbles, 64 B high 2-bit pairs, int8 scales[16], f16 d
                     w = d * sc * (q - 32)
  MXFP4 17 B / 32:   u8 e (E8M0 exponent), 16 B nibbles (as Q4_0: low nibbles = 0..15)
                     w = 2^(e-128) * E2M1x2[q]   (E2M1 values doubled, so the scale is halved)
  F32, F16, BF16:    plain row-major values.

Expert activations (`ACTS`): 0 = SwiGLU silu(g) * u; 1 = gpt-oss's clamped SwiGLU
(g = min(g, limit), u = clamp(u, -limit, limit), g * sigmoid(alpha * g) * (u + 1)). Experts
with biases add them to g, u (before the activation) and to the down output.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ....common.arch import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from . import rows_iq as _iq
from . import rows_q as rq
from .rows_base import _JIT, _JIT_EXACT, _U, _as_f32, _e2m1x2, _f16, _fi, _i8, _opaque
from .rows_dot import fused_dots, has_fused
from .rows_int import act_rows, has_int, int_dots, int_rows1, is_wide, quantize_acts
from .simd.vectors import addr, bits_f, hsum, iadd, ishl, lane, ld_f32, to_i
from .simd.vectors import add as vadd
from .simd.vectors import div as vdiv
from .simd.vectors import fma as vfma
from .simd.vectors import fmax as vmax
from .simd.vectors import fmin as vmin
from .simd.vectors import mul as vmul
from .simd.vectors import rint as vrint
from .simd.vectors import splat as vsplat
from .simd.vectors import st_f32 as vst
from .simd.vectors import sub as vsub
from .simd.vectors import zero as vz

# Every type decode_row handles (one `elif` each there; its row decoder here or in a sibling file)
NATIVE = (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4, Q.F32, Q.F16, Q.BF16,
          Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0, Q.Q1_0, Q.NVFP4,
          Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M)
# plain ints, so numba folds them as constants inside the kernels
_Q8_0, _Q4_0, _Q4_K, _Q5_K, _Q6_K = int(Q.Q8_0), int(Q.Q4_0), int(Q.Q4_K), int(Q.Q5_K), int(Q.Q6_K)
_MXFP4 = int(Q.MXFP4)
_Q4_1, _Q5_0, _Q5_1, _Q2_K, _Q3_K = int(Q.Q4_1), int(Q.Q5_0), int(Q.Q5_1), int(Q.Q2_K), int(Q.Q3_K)
_IQ4_NL, _IQ4_XS, _TQ1_0, _TQ2_0 = int(Q.IQ4_NL), int(Q.IQ4_XS), int(Q.TQ1_0), int(Q.TQ2_0)
_Q1_0, _NVFP4 = int(Q.Q1_0), int(Q.NVFP4)
# expert activation codes (the kernels' `act` argument); qkernels.ACTS maps the names
ACT_SWIGLU, ACT_SWIGLU_OAI = 0, 1
_OAI_ALPHA, _OAI_LIMIT = np.float32(SWIGLU_OAI_ALPHA), np.float32(SWIGLU_OAI_LIMIT)
_F32, _F16, _BF16 = int(Q.F32), int(Q.F16), int(Q.BF16)


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Hint the CPU to load the cache line holding arr[idx] (llvm.prefetch: read, keep in all
    levels). The hardware prefetcher alone left the kernels at a third of the memory bandwidth
    on weights not in cache: each row is a short stream, and the next row is not asked for until
    this one is decoded."""
    if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        i8p = ir.IntType(8).as_pointer()
        p = builder.bitcast(builder.gep(a.data, [args[1]]), i8p)
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [p, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


# -- row decoders: one weight row -> w[:n_in] float32 -----------------------------------------
@njit(**_JIT)
def _row_q8_0(data, off, n_in, w):
    lanes = _opaque(_U(32))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 32):
        d = _f16(data[o], data[o + _U(1)])
        q = o + _U(2)  # 32 int8 codes
        for k in range(lanes):
            w[e + k] = d * _i8(data[q + k])
        o += _U(34)
        e += _U(32)


@njit(**_JIT)
def _row_q4_0(data, off, n_in, w):
    lanes = _opaque(_U(16))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 32):
        d = _f16(data[o], data[o + _U(1)])
        q = o + _U(2)  # 16 bytes: elements 0-15 in the low nibbles, 16-31 in the high ones
        for k in range(lanes):
            c = np.int32(data[q + k])
            w[e + k] = d * _fi((c & 0xF) - 8)
            w[e + _U(16) + k] = d * _fi((c >> 4) - 8)
        o += _U(18)
        e += _U(32)


@njit(**_JIT)
def _k4_scales(data, s, d, dmin, scales):
    """Q4_K/Q5_K: the 12 bytes at data[s:] hold 6-bit (scale, min) x 8 -> scales[j] = d * scale,
    scales[8 + j] = dmin * min (ggml's get_scale_min_k4)."""
    for j in range(8):
        if j < 4:
            sc = np.int32(data[s + _U(j)]) & 63
            mn = np.int32(data[s + _U(j + 4)]) & 63
        else:
            hi = np.int32(data[s + _U(j + 4)])
            sc = (hi & 0xF) | ((np.int32(data[s + _U(j - 4)]) >> 6) << 4)
            mn = (hi >> 4) | ((np.int32(data[s + _U(j)]) >> 6) << 4)
        scales[j] = d * np.float32(sc)
        scales[8 + j] = dmin * np.float32(mn)


@njit(**_JIT)
def _row_q4_k(data, off, n_in, w):
    lanes = _opaque(_U(32))
    o, e = _U(off), _U(0)
    sc = np.empty(16, np.float32)  # d * scale [8], dmin * min [8]
    for _ in range(n_in // 256):
        _k4_scales(data, o + _U(4), _f16(data[o], data[o + _U(1)]), _f16(data[o + _U(2)], data[o + _U(3)]), sc)
        q = o + _U(16)  # 4 x 32 B; byte k of chunk g: low nibble -> sub-block 2g, high -> 2g+1
        for k in range(lanes):  # one pass over the super-block: constant shifts only
            c0, c1 = np.int32(data[q + k]), np.int32(data[q + _U(32) + k])
            c2, c3 = np.int32(data[q + _U(64) + k]), np.int32(data[q + _U(96) + k])
            w[e + k] = sc[0] * _fi(c0 & 0xF) - sc[8]
            w[e + _U(32) + k] = sc[1] * _fi(c0 >> 4) - sc[9]
            w[e + _U(64) + k] = sc[2] * _fi(c1 & 0xF) - sc[10]
            w[e + _U(96) + k] = sc[3] * _fi(c1 >> 4) - sc[11]
            w[e + _U(128) + k] = sc[4] * _fi(c2 & 0xF) - sc[12]
            w[e + _U(160) + k] = sc[5] * _fi(c2 >> 4) - sc[13]
            w[e + _U(192) + k] = sc[6] * _fi(c3 & 0xF) - sc[14]
            w[e + _U(224) + k] = sc[7] * _fi(c3 >> 4) - sc[15]
        o += _U(144)
        e += _U(256)


@njit(**_JIT)
def _row_q5_k(data, off, n_in, w):
    """As Q4_K, plus 32 B of fifth bits between the scales and the nibbles (bit j of byte k:
    sub-block j, element k). The fifth bit is added as a float (exact): combined as integers,
    LLVM kept 64-bit vector lanes (vcvtqq2ps: 25 % slower here, scalar on AVX2)."""
    lanes = _opaque(_U(32))
    o, e = _U(off), _U(0)
    sc = np.empty(16, np.float32)
    for _ in range(n_in // 256):
        _k4_scales(data, o + _U(4), _f16(data[o], data[o + _U(1)]), _f16(data[o + _U(2)], data[o + _U(3)]), sc)
        qh, q = o + _U(16), o + _U(48)
        for k in range(lanes):
            h = np.int32(data[qh + k])
            c0, c1 = np.int32(data[q + k]), np.int32(data[q + _U(32) + k])
            c2, c3 = np.int32(data[q + _U(64) + k]), np.int32(data[q + _U(96) + k])
            w[e + k] = sc[0] * (_fi(c0 & 0xF) + _fi(h & 1) * np.float32(16)) - sc[8]
            w[e + _U(32) + k] = sc[1] * (_fi(c0 >> 4) + _fi(h & 2) * np.float32(8)) - sc[9]
            w[e + _U(64) + k] = sc[2] * (_fi(c1 & 0xF) + _fi(h & 4) * np.float32(4)) - sc[10]
            w[e + _U(96) + k] = sc[3] * (_fi(c1 >> 4) + _fi(h & 8) * np.float32(2)) - sc[11]
            w[e + _U(128) + k] = sc[4] * (_fi(c2 & 0xF) + _fi(h & 16)) - sc[12]
            w[e + _U(160) + k] = sc[5] * (_fi(c2 >> 4) + _fi(h & 32) * np.float32(0.5)) - sc[13]
            w[e + _U(192) + k] = sc[6] * (_fi(c3 & 0xF) + _fi(h & 64) * np.float32(0.25)) - sc[14]
            w[e + _U(224) + k] = sc[7] * (_fi(c3 >> 4) + _fi(h & 128) * np.float32(0.125)) - sc[15]
        o += _U(176)
        e += _U(256)


@njit(**_JIT)
def _row_q6_k(data, off, n_in, w):
    """Per 128-element half: element 32g + l is nibble g // 2 of ql[32 * (g % 2) + l] with bits
    2g..2g+1 of qh[l] above it, scaled by int8 scale 2g + l // 16 (ggml's dequantize_row_q6_K)."""
    lanes = _opaque(_U(16))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 256):
        d = _f16(data[o + _U(208)], data[o + _U(209)])
        for half in range(2):
            ql, qh = o + _U(64 * half), o + _U(128 + 32 * half)
            for s in range(2):  # elements l = 16s .. 16s + 15 of each 32-element group
                sc = o + _U(192 + 8 * half + s)
                d0, d1 = d * _i8(data[sc]), d * _i8(data[sc + _U(2)])
                d2, d3 = d * _i8(data[sc + _U(4)]), d * _i8(data[sc + _U(6)])
                a, b, hh, y = ql + _U(16 * s), ql + _U(32 + 16 * s), qh + _U(16 * s), e + _U(16 * s)
                for k in range(lanes):
                    la, lb, h = np.int32(data[a + k]), np.int32(data[b + k]), np.int32(data[hh + k])
                    # high bits added as floats (exact), to keep 32-bit lanes (see _row_q5_k)
                    w[y + k] = d0 * (_fi((la & 0xF) - 32) + _fi(h & 3) * np.float32(16))
                    w[y + _U(32) + k] = d1 * (_fi((lb & 0xF) - 32) + _fi(h & 12) * np.float32(4))
                    w[y + _U(64) + k] = d2 * (_fi((la >> 4) - 32) + _fi(h & 48))
                    w[y + _U(96) + k] = d3 * (_fi((lb >> 4) - 32) + _fi(h & 192) * np.float32(0.25))
            e += _U(128)
        o += _U(210)


@njit(**_JIT)
def _e8m0_half(e):
    """2^(e - 128) as float32 for an E8M0 exponent byte (ggml's ggml_e8m0_to_fp32_half: e < 2
    gives the subnormals 2^-128 and 2^-127)."""
    if e < 2:
        return _as_f32(np.int32(0x00200000) << e)
    return _as_f32((e - 1) << 23)


@njit(**_JIT)
def _row_mxfp4(data, off, n_in, w):
    lanes = _opaque(_U(16))
    o, e = _U(off), _U(0)
    for _ in range(n_in // 32):
        d = _e8m0_half(np.int32(data[o]))
        q = o + _U(1)  # 16 bytes: elements 0-15 in the low nibbles, 16-31 in the high ones
        for k in range(lanes):
            c = np.int32(data[q + k])
            w[e + k] = d * _e2m1x2(c & 0xF)
            w[e + _U(16) + k] = d * _e2m1x2(c >> 4)
        o += _U(17)
        e += _U(32)


@njit(**_JIT)
def _row_float(data, off, n_in, w, qtype):
    """F32, F16 or BF16 values, assembled from their little-endian bytes."""
    o = _U(off)
    if qtype == _F32:
        for k in range(_U(n_in)):
            b = o + _U(4) * k
            w[k] = _as_f32(np.int32(data[b]) | (np.int32(data[b + _U(1)]) << 8)
                           | (np.int32(data[b + _U(2)]) << 16) | (np.int32(data[b + _U(3)]) << 24))
    elif qtype == _BF16:  # the high half of a float32
        for k in range(_U(n_in)):
            b = o + _U(2) * k
            w[k] = _as_f32((np.int32(data[b]) << 16) | (np.int32(data[b + _U(1)]) << 24))
    else:
        for k in range(_U(n_in)):
            b = o + _U(2) * k
            w[k] = _f16(data[b], data[b + _U(1)])


# ggml type code -> (values, bytes) per block, for every type gguf-py knows (a numba constant)
_BLOCK = np.ones(max(int(q) for q in GGML_QUANT_SIZES) + 1, np.int64)
_TYPE_SIZE = np.ones_like(_BLOCK)
for _q, (_b, _t) in GGML_QUANT_SIZES.items():
    _BLOCK[int(_q)], _TYPE_SIZE[int(_q)] = _b, _t


@njit(**_JIT)
def row_bytes(qtype, n_in):
    """Bytes of one row of `n_in` values of `qtype`."""
    return n_in // _BLOCK[qtype] * _TYPE_SIZE[qtype]


@njit(**_JIT)
def decode_row(qtype, data, off, n_in, w):
    """The row of `qtype` stored at data[off:] -> w[:n_in] float32."""
    if qtype == _Q8_0:
        _row_q8_0(data, off, n_in, w)
    elif qtype == _Q4_0:
        _row_q4_0(data, off, n_in, w)
    elif qtype == _Q4_K:
        _row_q4_k(data, off, n_in, w)
    elif qtype == _Q5_K:
        _row_q5_k(data, off, n_in, w)
    elif qtype == _Q6_K:
        _row_q6_k(data, off, n_in, w)
    elif qtype == _MXFP4:
        _row_mxfp4(data, off, n_in, w)
    elif qtype == _Q4_1:
        rq._row_q4_1(data, off, n_in, w)
    elif qtype == _Q5_0:
        rq._row_q5_0(data, off, n_in, w)
    elif qtype == _Q5_1:
        rq._row_q5_1(data, off, n_in, w)
    elif qtype == _Q2_K:
        rq._row_q2_k(data, off, n_in, w)
    elif qtype == _Q3_K:
        rq._row_q3_k(data, off, n_in, w)
    elif qtype == _IQ4_NL:
        rq._row_iq4_nl(data, off, n_in, w)
    elif qtype == _IQ4_XS:
        rq._row_iq4_xs(data, off, n_in, w)
    elif qtype == _TQ1_0:
        rq._row_tq1_0(data, off, n_in, w)
    elif qtype == _TQ2_0:
        rq._row_tq2_0(data, off, n_in, w)
    elif qtype == _Q1_0:
        rq._row_q1_0(data, off, n_in, w)
    elif qtype == _NVFP4:
        rq._row_nvfp4(data, off, n_in, w)
    elif _iq.is_grid(qtype):
        _iq.decode_grid_row(qtype, data, off, n_in, w)
    else:
        _row_float(data, off, n_in, w, qtype)


@njit(**_JIT)
def prefetch_row(data, off, nbytes):
    """Ask for the cache lines of data[off:off + nbytes] (bounds: the caller's)."""
    for c in range(0, nbytes, 64):
        _prefetch(data, _U(off + c))


# -- dot products of one decoded row with activation rows ---------------------------------------
# dot4 is dot four times over: each sum is written out as explicit 16-lane vectors (two
# accumulators, even and odd blocks of 16, a fixed tree at the end) plus a tail summed in order
# without fast-math, so a row's sum is bit-identical whether it was computed in a group of four
# or alone on any CPU (left to LLVM's vectorizer, the two loops were unrolled differently on
# AVX2), while the decoded row is loaded once per four activation rows.
@njit(**_JIT_EXACT)
def _tail(w, x, k0, n):
    acc = np.float32(0.0)
    for k in range(k0, n):
        acc += w[k] * x[k]
    return acc


@njit(**_JIT)
def dot(w, x, n):
    pw, px, m = addr(w), addr(x), n - n % 32
    a, b = vz(), vz()
    for k in range(0, m, 32):
        a = vfma(ld_f32(pw, k), ld_f32(px, k), a)
        b = vfma(ld_f32(pw, k + 16), ld_f32(px, k + 16), b)
    if m + 16 <= n:
        a = vfma(ld_f32(pw, m), ld_f32(px, m), a)
        m += 16
    return hsum(vadd(a, b)) + _tail(w, x, m, n)


@njit(**_JIT)
def dot4(w, x0, x1, x2, x3, n):
    pw, p0, p1, p2, p3, m = addr(w), addr(x0), addr(x1), addr(x2), addr(x3), n - n % 32
    a0, a1, a2, a3, b0, b1, b2, b3 = vz(), vz(), vz(), vz(), vz(), vz(), vz(), vz()
    for k in range(0, m, 32):
        wk, wl = ld_f32(pw, k), ld_f32(pw, k + 16)
        a0, b0 = vfma(wk, ld_f32(p0, k), a0), vfma(wl, ld_f32(p0, k + 16), b0)
        a1, b1 = vfma(wk, ld_f32(p1, k), a1), vfma(wl, ld_f32(p1, k + 16), b1)
        a2, b2 = vfma(wk, ld_f32(p2, k), a2), vfma(wl, ld_f32(p2, k + 16), b2)
        a3, b3 = vfma(wk, ld_f32(p3, k), a3), vfma(wl, ld_f32(p3, k + 16), b3)
    if m + 16 <= n:
        wk = ld_f32(pw, m)
        a0, a1, a2, a3 = vfma(wk, ld_f32(p0, m), a0), vfma(wk, ld_f32(p1, m), a1), \
            vfma(wk, ld_f32(p2, m), a2), vfma(wk, ld_f32(p3, m), a3)
        m += 16
    return (hsum(vadd(a0, b0)) + _tail(w, x0, m, n), hsum(vadd(a1, b1)) + _tail(w, x1, m, n),
            hsum(vadd(a2, b2)) + _tail(w, x2, m, n), hsum(vadd(a3, b3)) + _tail(w, x3, m, n))


# -- parallel kernels ---------------------------------------------------------------------------
# Each thread takes one contiguous span of (expert, output row) pairs, in expert order, of about
# equal cost: a row costs _ROW_COST + n_e units (decoding it, then one dot per activation row).
# Spans keep each thread's reads sequential (prefetched _PREFETCH_BYTES ahead) and balance
# experts with different row counts; which thread computes an output never changes how.
_ROW_COST = 6  # decoding a weight row, in dots of it with one activation row (measured: 5-7)
_PREFETCH_BYTES = 4096


# exp's constants (Cephes' expf): ln 2 in two parts (the first exact in 9 bits, so n ln2_hi is
# exact) and the minimax polynomial of (exp(r) - 1 - r) / r^2 on |r| <= ln 2 / 2
_LOG2E, _LN2_HI, _LN2_LO = np.float32(1.44269504088896341), np.float32(0.693359375), np.float32(-2.12194440e-4)
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)
_EXP_LO, _EXP_HI, _ONE = np.float32(-88.0), np.float32(89.0), np.float32(1.0)


@njit(**_JIT)
def exp16(x):
    """exp of 16 float32 lanes, within 3 ulp (x clamped to [-88, 89]: 0 below -88, inf from ~88.4,
    so silu(g) is -0.0 for g below -88.4, as with libm's expf). Explicit vector operations, no
    fast-math: each lane rounds the same whatever the lane or the caller (libm's expf is a call
    per element: ~3 us per 1024 of an expert's outputs)."""
    x = vmin(vmax(x, vsplat(_EXP_LO)), vsplat(_EXP_HI))
    n = vrint(vmul(x, vsplat(_LOG2E)))
    r = vfma(n, vsplat(-_LN2_LO), vfma(n, vsplat(-_LN2_HI), x))  # x - n ln 2
    p = vfma(vfma(vsplat(_P0), r, vsplat(_P1)), r, vsplat(_P2))
    p = vfma(vfma(vfma(p, r, vsplat(_P3)), r, vsplat(_P4)), r, vsplat(_P5))
    e = vadd(vfma(p, vmul(r, r), r), vsplat(_ONE))  # exp(r)
    return vmul(e, bits_f(ishl(iadd(to_i(n), 127), 23)))  # x 2^n


@njit(**_JIT)
def _act16(g, u, act):
    """The expert activation (ACT_* codes) of 16 gate and up lanes."""
    if act == ACT_SWIGLU_OAI:
        g = vmin(g, vsplat(_OAI_LIMIT))
        u = vmin(vmax(u, vsplat(-_OAI_LIMIT)), vsplat(_OAI_LIMIT))
        return vmul(vdiv(g, vadd(vsplat(_ONE), exp16(vmul(vsplat(-_OAI_ALPHA), g)))), vadd(u, vsplat(_ONE)))
    return vmul(vdiv(g, vadd(vsplat(_ONE), exp16(vsub(vz(), g)))), u)


@njit(**_JIT)
def _act(g, u, act):
    """The expert activation of gate g and up u (ACT_* codes): _act16's lane, so an output
    comes out the same from the many-row loop as from the one-row span's vectors."""
    return lane(_act16(vsplat(g), vsplat(u), act), 0)


@njit(inline="always", **_JIT)
def _act_span(rg, ru, n, h, r, j0, act):
    """h[r, j0 + k] = act(rg[k], ru[k]) for k < n, 16 at a time (the last vector's spare lanes
    are computed from rg, ru's spare room and not stored)."""
    pg, pu, ph = addr(rg), addr(ru), addr(h) + (np.int64(r) * h.shape[1] + j0) * 4  # (h: C-contiguous)
    k = 0
    while k + 16 <= n:
        vst(ph, k, _act16(ld_f32(pg, k), ld_f32(pu, k), act))
        k += 16
    if k < n:
        t = _act16(ld_f32(pg, k), ld_f32(pu, k), act)
        for m in range(n - k):
            h[r, j0 + k + m] = lane(t, m)


@njit(inline="always", **_JIT)
def _store(res, k, nx, d0, d1, d2, d3):
    res[k] = d0
    if nx > 1:
        res[k + 1] = d1
    if nx > 2:
        res[k + 2] = d2
    if nx > 3:
        res[k + 3] = d3


@njit(inline="always", **_JIT)  # inlined: called per weight row with arrays (an NRT pair each otherwise)
def _row_dots(q, data, off, n_in, x, row_idx, r0, r1, res, wbuf, acts, use_int):
    """res[r - r0] = (the weight row of type q at data[off:]) . x[row_idx[r]] for r in r0 .. r1 - 1.

    With use_int, the int types (rows_int) dot the row with x's int8-quantized rows `acts`
    (quantize_acts(x)); the FUSED types take the single-pass float dots (rows_dot); four
    activation rows per pass over the weight bytes either way (a group of 2-3 repeats its first
    row). The others decode the row into wbuf [n_in] once, then dot4 / dot."""
    r = r0
    if use_int and has_int(q) and n_in % 256 == 0:  # (the int dots step 256 weights at a time)
        p = addr(data)
        while r < r1:
            nx = min(4, r1 - r)
            i0 = row_idx[r]
            i1 = row_idx[r + 1] if nx > 1 else i0
            i2 = row_idx[r + 2] if nx > 2 else i0
            i3 = row_idx[r + 3] if nx > 3 else i0
            d0, d1, d2, d3 = int_dots(q, p, off, n_in, _acts_rows(acts, q, i0, i1, i2, i3), nx)
            _store(res, r - r0, nx, d0, d1, d2, d3)
            r += nx
        return
    if has_fused(q):
        p, xa, stride = addr(data), addr(x), np.int64(x.shape[1]) * 4  # x: C-contiguous float32 rows
        while r < r1:
            nx = min(4, r1 - r)
            x0 = xa + row_idx[r] * stride
            x1 = xa + row_idx[r + 1] * stride if nx > 1 else x0
            x2 = xa + row_idx[r + 2] * stride if nx > 2 else x0
            x3 = xa + row_idx[r + 3] * stride if nx > 3 else x0
            d0, d1, d2, d3 = fused_dots(q, p, off, n_in, x0, x1, x2, x3, nx)
            _store(res, r - r0, nx, d0, d1, d2, d3)
            r += nx
        return
    decode_row(q, data, off, n_in, wbuf)
    while r + 4 <= r1:
        x0, x1, x2, x3 = x[row_idx[r]], x[row_idx[r + 1]], x[row_idx[r + 2]], x[row_idx[r + 3]]
        res[r - r0], res[r - r0 + 1], res[r - r0 + 2], res[r - r0 + 3] = dot4(wbuf, x0, x1, x2, x3, n_in)
        r += 4
    for k in range(r, r1):
        res[k - r0] = dot(wbuf, x[row_idx[k]], n_in)


@njit(inline="always", **_JIT)
def _one_row_int(row_ptr, e, qa, qb, n_in, use_int):
    """Expert e has one activation row and its matrices qa, qb take the int8 dots: its span of
    weight rows goes to int_rows1 in one call per matrix."""
    return use_int and row_ptr[e + 1] - row_ptr[e] == 1 and has_int(qa) and has_int(qb) and n_in % 256 == 0


@njit(inline="always", **_JIT)
def _acts_rows(acts, q, i0, i1, i2, i3):
    """R (rows_int) for weights of type q: rows i0 .. i3 of the activations (_acts) it takes."""
    if is_wide(q):
        return act_rows(acts[3], acts[4], acts[5], i0, i1, i2, i3)
    return act_rows(acts[0], acts[1], acts[2], i0, i1, i2, i3)


@njit(inline="always", **_JIT)
def _row_acts(acts, q, i):
    """R (rows_int) for weights of type q with activation row i of `acts` in every place."""
    return _acts_rows(acts, q, i, i, i, i)


@njit(**_JIT)
def _acts(x, qts, c0, c1, row_ptr, use_int):
    """x's rows quantized to int8 (quantize_acts), per 32 (q, d, ds) and wide (qw, dw, dsw: for the
    is_wide types), each when use_int and some expert with rows has an int type of that kind in
    columns c0 .. c1 of qts; else empty arrays of the same types. Each type takes its own kind
    whatever else is in the call, so a token's result never depends on the experts beside it."""
    fine = wide = False
    if use_int and x.shape[1] % 256 == 0:
        for e in range(qts.shape[0]):
            if row_ptr[e + 1] > row_ptr[e]:
                for c in range(c0, c1 + 1):
                    if has_int(qts[e, c]):
                        w = is_wide(qts[e, c])
                        fine, wide = fine or not w, wide or w
    q, d, ds = quantize_acts(x if fine else x[:0], False)
    qw, dw, dsw = quantize_acts(x if wide else x[:0], True)
    return q, d, ds, qw, dw, dsw


@njit(**_JIT)
def _max_rows(row_ptr):
    n = 1
    for e in range(row_ptr.size - 1):
        n = max(n, row_ptr[e + 1] - row_ptr[e])
    return n


@njit(**_JIT)
def _total_cost(row_ptr, n_out):
    total = 0
    for e in range(row_ptr.size - 1):
        n = row_ptr[e + 1] - row_ptr[e]
        total += n_out * (_ROW_COST + n) if n else 0
    return total


@njit(**_JIT)
def _span(row_ptr, e, n_out, start, lo, hi):
    """(j0, j1, end): the rows j0 .. j1 - 1 of expert e whose cost starts (at start + j * cost)
    within [lo, hi), and where expert e's cost ends."""
    n = row_ptr[e + 1] - row_ptr[e]
    if n == 0:
        return 0, 0, start
    cost = _ROW_COST + n
    j0 = min(n_out, max(0, (lo - start + cost - 1) // cost))
    j1 = min(n_out, max(0, (hi - start + cost - 1) // cost))
    return j0, j1, start + n_out * cost


@njit(inline="always", **_JIT)
def _gate_up_span(w, n_workers, gdata, udata, offs, qts, x, row_ptr, row_idx, ff, d, h, bias, has_bias, act,
                  acts, use_int):
    """Worker w of n_workers: its span of gate_up_kernel's (expert, output row) pairs."""
    total = _total_cost(row_ptr, ff)
    lo, hi = total * np.int64(w) // n_workers, total * (np.int64(w) + 1) // n_workers
    wbuf = np.empty(max(d, 16), np.float32)  # [d] a decoded row (types without a fused dot)
    rg = np.empty(max(_max_rows(row_ptr), ff) + 16, np.float32)  # [n_e] gate rows' dots with the expert's rows
    ru = np.empty_like(rg)  # [n_e] up's; or [j1 - j0] a one-row expert's span of rows
    start = 0
    for e in range(offs.shape[0]):
        j0, j1, start_next = _span(row_ptr, e, ff, start, lo, hi)
        gq, uq, go, uo = qts[e, 0], qts[e, 1], offs[e, 0], offs[e, 1]
        gb, ub = row_bytes(gq, d), row_bytes(uq, d)
        r0 = row_ptr[e]
        if j1 > j0 and _one_row_int(row_ptr, e, gq, uq, d, use_int):  # a decode step's expert: whole spans
            int_rows1(gq, addr(gdata), go + j0 * gb, gb, j1 - j0, d, _row_acts(acts, gq, row_idx[r0]), rg)
            int_rows1(uq, addr(udata), uo + j0 * ub, ub, j1 - j0, d, _row_acts(acts, uq, row_idx[r0]), ru)
            for j in range(j0, j1):  # (+ 0.0 without biases too: the many-row loop's -0.0 -> 0.0)
                rg[j - j0] += bias[e, 0, j] if has_bias else np.float32(0.0)
                ru[j - j0] += bias[e, 1, j] if has_bias else np.float32(0.0)
            _act_span(rg, ru, j1 - j0, h, r0, j0, act)
            start = start_next
            continue
        ahead = max(1, _PREFETCH_BYTES // (gb + ub))
        for j in range(j0, min(j1, j0 + ahead)):  # the span's first rows
            prefetch_row(gdata, go + j * gb, gb)
            prefetch_row(udata, uo + j * ub, ub)
        for j in range(j0, j1):
            if j + ahead < j1:
                prefetch_row(gdata, go + (j + ahead) * gb, gb)
                prefetch_row(udata, uo + (j + ahead) * ub, ub)
            r0, r1 = row_ptr[e], row_ptr[e + 1]
            _row_dots(gq, gdata, go + j * gb, d, x, row_idx, r0, r1, rg, wbuf, acts, use_int)
            _row_dots(uq, udata, uo + j * ub, d, x, row_idx, r0, r1, ru, wbuf, acts, use_int)
            bg = bias[e, 0, j] if has_bias else np.float32(0.0)
            bu = bias[e, 1, j] if has_bias else np.float32(0.0)
            for r in range(r0, r1):
                h[r, j] = _act(rg[r - r0] + bg, ru[r - r0] + bu, act)
        start = start_next


@njit(parallel=True, **_JIT)
def gate_up_kernel(gdata, udata, offs, qts, x, row_ptr, row_idx, ff, d, h, n_workers, bias, has_bias, act, use_int):
    """h[r] = act(gate_e @ x[row_idx[r]] + bias[e, 0], up_e @ x[row_idx[r]] + bias[e, 1]) for r in
    row_ptr[e] .. row_ptr[e + 1] - 1: expert e's gate and up at byte offsets offs[e, 0], offs[e, 1]
    of gdata, udata, types qts[e, 0], qts[e, 1]. x [N, d], h [R, ff], bias [E, 2, ff] (read only
    with has_bias; zero otherwise), act an ACT_* code; n_workers: numba's threads; use_int: the
    int types dot int8-quantized x (rows_int), quantized once here for all experts."""
    acts = _acts(x, qts, 0, 1, row_ptr, use_int)
    for w in prange(n_workers):
        _gate_up_span(w, n_workers, gdata, udata, offs, qts, x, row_ptr, row_idx, ff, d, h, bias, has_bias, act,
                      acts, use_int)


@njit(inline="always", **_JIT)
def _down_span(w, n_workers, ddata, offs, qts, h, row_ptr, n_out, n_in, y, bias, has_bias, acts, use_int):
    """Worker w of n_workers: its span of down_kernel's (expert, output row) pairs."""
    total = _total_cost(row_ptr, n_out)
    lo, hi = total * np.int64(w) // n_workers, total * (np.int64(w) + 1) // n_workers
    wbuf = np.empty(max(n_in, 16), np.float32)  # [n_in] a decoded row (types without a fused dot)
    res = np.empty(max(_max_rows(row_ptr), n_out), np.float32)  # [n_e], or a one-row expert's span
    ident = np.arange(h.shape[0])  # h's rows are the experts' rows in order
    start = 0
    for e in range(offs.shape[0]):
        j0, j1, start_next = _span(row_ptr, e, n_out, start, lo, hi)
        q, o = qts[e, 2], offs[e, 2]
        b = row_bytes(q, n_in)
        r0 = row_ptr[e]
        if j1 > j0 and _one_row_int(row_ptr, e, q, q, n_in, use_int):  # a decode step's expert: one call
            int_rows1(q, addr(ddata), o + j0 * b, b, j1 - j0, n_in, _row_acts(acts, q, r0), res)
            for j in range(j0, j1):
                y[r0, j] = res[j - j0] + (bias[e, j] if has_bias else np.float32(0.0))
            start = start_next
            continue
        ahead = max(1, _PREFETCH_BYTES // b)
        for j in range(j0, min(j1, j0 + ahead)):
            prefetch_row(ddata, o + j * b, b)
        for j in range(j0, j1):
            if j + ahead < j1:
                prefetch_row(ddata, o + (j + ahead) * b, b)
            r0, r1 = row_ptr[e], row_ptr[e + 1]
            _row_dots(q, ddata, o + j * b, n_in, h, ident, r0, r1, res, wbuf, acts, use_int)
            bj = bias[e, j] if has_bias else np.float32(0.0)
            for r in range(r0, r1):
                y[r, j] = res[r - r0] + bj
        start = start_next


@njit(parallel=True, **_JIT)
def down_kernel(ddata, offs, qts, h, row_ptr, n_out, n_in, y, n_workers, bias, has_bias, use_int):
    """y[r] = down_e @ h[r] + bias[e] for r in row_ptr[e] .. row_ptr[e + 1] - 1: expert e's down at
    byte offset offs[e, 2] of ddata, type qts[e, 2]. h [R, n_in], y [R, n_out], bias [E, n_out]
    (read only with has_bias); use_int as gate_up_kernel's."""
    acts = _acts(h, qts, 2, 2, row_ptr, use_int)
    for w in prange(n_workers):
        _down_span(w, n_workers, ddata, offs, qts, h, row_ptr, n_out, n_in, y, bias, has_bias, acts, use_int)


@njit(parallel=True, **_JIT)
def dequant_kernel(qtype, data, n_out, n_in, w):
    """The whole matrix -> w [n_out, n_in] float32 (the dense path's buffer)."""
    b = row_bytes(qtype, n_in)
    for j in prange(n_out):
        decode_row(qtype, data, np.int64(j) * b, n_in, w[j])  # prange's j is unsigned




@njit(parallel=True, **_JIT)
def stream_read(data, n_workers):
    """XOR of data's 8-byte words (a sized multiple of 8), each worker reading one contiguous
    slice: a streaming read of the bytes, the memory-bandwidth bound the kernels are held to."""
    words = data.size // 8
    acc = np.zeros(n_workers, np.uint64)
    for w in prange(n_workers):
        lo, hi = words * np.int64(w) // n_workers, words * (np.int64(w) + 1) // n_workers
        v = data[lo * 8:hi * 8].view(np.uint64)
        s = np.uint64(0)
        for i in range(v.size):
            s ^= v[i]
        acc[w] = s
    return acc
