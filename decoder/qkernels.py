"""CPU kernels: an MoE expert's SwiGLU FFN computed on its quantized GGUF blocks.

`swiglu_expert(x, gate, up, down)` computes `y = down @ (silu(gate @ x_t) * (up @ x_t))` for every
row x_t of `x` [n, d], reading each `QMatrix`'s bytes where they lie (a read-only arena slot or a
memory map of the file): nothing is copied and no dequantized copy of the expert is kept.

Block layouts decoded natively (gguf-py `gguf/quants.py`, ggml's block structs; f16 scales are
decoded with integer bit manipulation, subnormals included):
  Q8_0  34 B / 32:   f16 d, int8 q[32]                        w = d * q
  Q4_0  18 B / 32:   f16 d, 16 B nibbles (low nibbles = 0..15)  w = d * (q - 8)
  Q4_K  144 B / 256: f16 d, f16 dmin, 12 B of 6-bit (scale, min) x 8, 128 B nibbles
                     (32 B per pair of sub-blocks: low nibbles first)   w = d*sc*q - dmin*m
  Q5_K  176 B / 256: as Q4_K plus 32 B of high bits (bit j of byte l -> sub-block j, element l)
  Q6_K  210 B / 256: 128 B low nibbles, 64 B high 2-bit pairs, int8 scales[16], f16 d
                     w = d * sc * (q - 32)
  F32, F16, BF16:    plain row-major values.
Any other type falls back to the torch dequantizer (`dequant.dequantize`) and a matmul.

Paths, picked by the number of rows n:
  n < DENSE_MIN_ROWS (20)  fused: a weight row is decoded into a per-thread float32 row buffer
        (L1) and dotted with each of the n activation rows, so each block is decoded once; gate
        and up share one parallel region (silu(g) * u), down a second one. Output rows are split
        over threads, each computed by one thread in a fixed order: results are bit-identical
        run to run, for any thread count, and a token's result does not depend on the other
        rows of the batch.
  n >= DENSE_MIN_ROWS  dense (prefill): each matrix in turn is decoded by the same row decoders
        into one reused float32 buffer (parallel over rows) and multiplied by torch (BLAS):
        deterministic run to run for a given thread count.
Activations stay float32 (never quantized); sums are float32, reassociated (vectorized), so
results agree with float64 math on the dequantized weights to ~1e-6 of the output's scale
(the tests allow 1e-5 * max |reference|).
"""

from __future__ import annotations

import os
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import numba
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# numba's 'omp' threading layer first, also when TBB is installed: its threads spin briefly
# between regions, so the two launches per expert start in microseconds; 'workqueue' threads
# sleep on a condition variable and took ~0.2 ms per launch here (2x slower experts), and a
# layer of torch ops then experts ran 40 % slower with it than with 'omp' (which stayed within
# 5 % of the two parts timed apart). Takes effect when numba starts its pool (first parallel
# kernel); a NUMBA_THREADING_LAYER_PRIORITY or NUMBA_THREADING_LAYER set by the user still wins.
_PRIORITY = "omp tbb workqueue"
if os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", _PRIORITY) == _PRIORITY:
    numba.config.THREADING_LAYER_PRIORITY = _PRIORITY.split()

# Rows per expert from which decoding each matrix into a float32 buffer + torch's BLAS beats the
# fused kernel. Measured on 2 cores (fused time / dense time, Q8_0 Q4_K Q6_K): d = ff = 1024:
# n=8 0.74-0.85, n=16 0.87-0.89, n=20 0.92-1.08, n=24 0.93-1.21; d=2048, ff=768 (Q8_0, Q4_K):
# n=16 0.90-0.98, n=20 0.99, n=24 1.24-1.37.
DENSE_MIN_ROWS = 20

# Reassociation lets LLVM vectorize the 32-wide block loops and the dot reductions; no
# nnan/ninf so the f16 decoder's inf/NaN handling stays as written, no afn for exp.
_FM = {"reassoc", "contract", "nsz", "arcp"}
_JIT = {"cache": True, "fastmath": _FM, "nogil": True}
_ROWS_PER_TASK = 8  # output rows per parallel task: one pair of row buffers per task

_NATIVE = (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F32, Q.F16, Q.BF16)
# plain ints, so numba folds them as constants inside the kernels
_Q8_0, _Q4_0, _Q4_K, _Q5_K, _Q6_K = int(Q.Q8_0), int(Q.Q4_0), int(Q.Q4_K), int(Q.Q5_K), int(Q.Q6_K)
_F32, _F16, _BF16 = int(Q.F32), int(Q.F16), int(Q.BF16)


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


# -- row decoders: one weight row -> w[:n_in] float32 -----------------------------------------
# Indices are unsigned (_U): numba adds a negative-index wraparound select to every signed
# index it cannot prove >= 0, which cost a third of the decode time. (Mixing uint64 with int64
# makes a float64 in numba, so every index term goes through _U.)
_U = np.uint64


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


@njit(**_JIT)
def _decode_row(qtype, data, row, n_in, row_bytes, w):
    """Row `row` of a matrix of `qtype` stored in `data` -> w[:n_in] float32."""
    off = row * row_bytes
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
    else:
        _row_float(data, off, n_in, w, qtype)


# -- parallel kernels -------------------------------------------------------------------------
@njit(**_JIT)
def _dot(w, x, n):
    acc = np.float32(0.0)
    for k in range(n):
        acc += w[k] * x[k]
    return acc


@njit(parallel=True, **_JIT)
def _gate_up_kernel(x, gq, gdata, uq, udata, n_out, n_in, h):
    """h[i, j] = silu(gate_j . x_i) * (up_j . x_i): x [n, n_in], h [n, n_out]."""
    n = x.shape[0]
    g_bytes, u_bytes = gdata.size // n_out, udata.size // n_out
    for t in prange((n_out + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        wg = np.empty(n_in, np.float32)  # [n_in] decoded gate row
        wu = np.empty(n_in, np.float32)  # [n_in] decoded up row
        for j in range(t * _ROWS_PER_TASK, min(n_out, (t + 1) * _ROWS_PER_TASK)):
            _decode_row(gq, gdata, j, n_in, g_bytes, wg)
            _decode_row(uq, udata, j, n_in, u_bytes, wu)
            for i in range(n):
                g = _dot(wg, x[i], n_in)
                u = _dot(wu, x[i], n_in)
                h[i, j] = g / (np.float32(1.0) + np.exp(-g)) * u


@njit(parallel=True, **_JIT)
def _down_kernel(h, dq, ddata, n_out, n_in, out, scale, accumulate):
    """out[i, j] (+)= scale[i] * (down_j . h_i): h [n, n_in], out [n, n_out]."""
    n = h.shape[0]
    d_bytes = ddata.size // n_out
    for t in prange((n_out + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
        w = np.empty(n_in, np.float32)  # [n_in] decoded down row
        for j in range(t * _ROWS_PER_TASK, min(n_out, (t + 1) * _ROWS_PER_TASK)):
            _decode_row(dq, ddata, j, n_in, d_bytes, w)
            for i in range(n):
                y = _dot(w, h[i], n_in)
                if accumulate:
                    out[i, j] += scale[i] * y
                else:
                    out[i, j] = y


@njit(parallel=True, **_JIT)
def _dequant_kernel(qtype, data, n_out, n_in, w):
    """The whole matrix -> w [n_out, n_in] float32 (the dense path's buffer)."""
    row_bytes = data.size // n_out
    for j in prange(n_out):
        _decode_row(qtype, data, np.int64(j), n_in, row_bytes, w[j])  # prange's j is unsigned


# -- Python side ------------------------------------------------------------------------------
@dataclass(frozen=True)
class QMatrix:
    """One weight matrix as its GGUF bytes: `n_out` rows of `n_in` values (ggml ne0 = n_in).

    `data` is never copied or written: it may be a read-only view of an arena slot or a file map.
    """

    data: np.ndarray  # [n_out * row_bytes] uint8
    qtype: int
    n_out: int
    n_in: int

    def __post_init__(self) -> None:
        d = self.data
        if not isinstance(d, np.ndarray) or d.dtype != np.uint8 or d.ndim != 1 or not d.flags.c_contiguous:
            raise ValueError(f"QMatrix data must be a contiguous 1-D uint8 array, got "
                             f"{getattr(d, 'dtype', type(d).__name__)} of shape {getattr(d, 'shape', '?')}")
        if int(self.qtype) not in _SIZES:
            raise ValueError(f"QMatrix: unknown quant type {self.qtype!r}")
        name, (block, type_size) = Q(self.qtype).name, _SIZES[int(self.qtype)]
        if self.n_out <= 0 or self.n_in <= 0 or self.n_in % block:
            raise ValueError(f"QMatrix {name}: n_out={self.n_out}, n_in={self.n_in}: both must be "
                             f"positive and n_in a multiple of the block size {block}")
        want = self.n_out * (self.n_in // block) * type_size
        if d.size != want:
            raise ValueError(f"QMatrix {name} [{self.n_out} x {self.n_in}]: expected {self.n_out} rows x "
                             f"{self.n_in // block} blocks x {type_size} B = {want} bytes, got {d.size}")

    @property
    def nbytes(self) -> int:
        return int(self.data.size)

    def readonly(self) -> np.ndarray:
        """A read-only base-class view of the bytes (no copy): one numba signature for all callers."""
        return _readonly(self.data)


_SIZES = {int(q): size for q, size in GGML_QUANT_SIZES.items()}


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view(np.ndarray)  # also drops np.memmap, which numba would type apart
    v.flags.writeable = False
    return v


def has_kernel(qtype: int) -> bool:
    """Whether `qtype` is decoded natively (other types: torch dequantize, then a matmul)."""
    return qtype in _NATIVE


def set_threads(n: int) -> None:
    """Threads the kernels use: 1 .. NUMBA_NUM_THREADS (by default, the machine's cores)."""
    numba.set_num_threads(n)


def get_threads() -> int:
    return numba.get_num_threads()


def dequantize(m: QMatrix, out: np.ndarray | None = None) -> np.ndarray:
    """m as float32 [n_out, n_in] (into `out` when given), for a type with a native kernel."""
    if not has_kernel(m.qtype):
        raise ValueError(f"no native kernel for {Q(m.qtype).name}; use decoder.dequant.dequantize")
    w = np.empty((m.n_out, m.n_in), np.float32) if out is None else out  # [n_out, n_in]
    if w.shape != (m.n_out, m.n_in) or w.dtype != np.float32 or not w.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 [{m.n_out}, {m.n_in}], got {w.dtype} {w.shape}")
    _dequant_kernel(int(m.qtype), m.readonly(), int(m.n_out), int(m.n_in), w)
    return w


def swiglu_expert(x: np.ndarray, gate: QMatrix, up: QMatrix, down: QMatrix,
                  out: np.ndarray | None = None, scale: np.ndarray | None = None) -> np.ndarray:
    """y = down @ (silu(gate @ x_t) * (up @ x_t)) for each row x_t of x [n, d] float32.

    Returns y [n, d] float32; when `out` [n, d] float32 is given, does `out += scale[:, None] * y`
    instead (scale [n] float32; ones when None) and returns `out`.
    """
    _check_chain(gate, up, down)
    d, ff = int(gate.n_in), int(gate.n_out)
    x = _check_x(x, d)  # [n, d]
    n = x.shape[0]
    sc = _check_out(out, scale, n, d)  # [n]
    if n == 0:
        return out if out is not None else np.zeros((0, d), np.float32)
    if n >= DENSE_MIN_ROWS or not all(has_kernel(m.qtype) for m in (gate, up, down)):
        return _dense(x, gate, up, down, out, sc)
    # plain ints and read-only inputs throughout: each kernel has exactly one numba signature
    h = np.empty((n, ff), np.float32)  # [n, ff]
    _gate_up_kernel(_readonly(x), int(gate.qtype), gate.readonly(), int(up.qtype), up.readonly(), ff, d, h)
    y = out if out is not None else np.empty((n, d), np.float32)  # [n, d]
    _down_kernel(_readonly(h), int(down.qtype), down.readonly(), d, ff, y, _readonly(sc), out is not None)
    return y


def linear(x: np.ndarray, m: QMatrix) -> np.ndarray:
    """x [n, n_in] float32 @ m.T -> [n, n_out] float32: a dense weight kept as its GGUF blocks.

    The same two paths as the experts: rows decoded in registers for few rows (bit-identical
    for any thread count and batch), decode into a buffer + BLAS from DENSE_MIN_ROWS rows."""
    x = _check_x(x, int(m.n_in))  # [n, n_in]
    n = x.shape[0]
    if n >= DENSE_MIN_ROWS or not has_kernel(m.qtype):
        with _quiet_readonly():
            return torch.nn.functional.linear(torch.from_numpy(x), _dense_weight(m)).numpy()  # [n, n_out]
    y = np.empty((n, int(m.n_out)), np.float32)  # [n, n_out]
    _down_kernel(_readonly(x), int(m.qtype), m.readonly(), int(m.n_out), int(m.n_in), y, _readonly(_ONES[:n]), False)
    return y


_ONES = np.ones(DENSE_MIN_ROWS, np.float32)  # the unused scale of `linear`'s kernel call


def _check_chain(gate: QMatrix, up: QMatrix, down: QMatrix) -> None:
    if gate.n_out != up.n_out or gate.n_in != up.n_in or down.n_in != gate.n_out or down.n_out != gate.n_in:
        raise ValueError(f"expert shapes do not chain: gate [{gate.n_out} x {gate.n_in}], "
                         f"up [{up.n_out} x {up.n_in}], down [{down.n_out} x {down.n_in}]")


def _check_x(x: np.ndarray, d: int) -> np.ndarray:
    if x.ndim != 2 or x.shape[1] != d:
        raise ValueError(f"x must be [n, {d}], got shape {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)  # no copy when already float32, C order


def _check_out(out: np.ndarray | None, scale: np.ndarray | None, n: int, d: int) -> np.ndarray:
    """The per-row scale [n] float32 of the accumulating form (ones without one)."""
    if out is not None and (out.shape != (n, d) or out.dtype != np.float32
                            or not out.flags.c_contiguous or not out.flags.writeable):
        raise ValueError(f"out must be a writable C-contiguous float32 [{n}, {d}], got {out.dtype} {out.shape}")
    sc = np.ones(n, np.float32) if scale is None else np.ascontiguousarray(scale, dtype=np.float32)
    if sc.shape != (n,):
        raise ValueError(f"scale must be [{n}], got shape {sc.shape}")
    return sc


# -- dense path (prefill, and types without a native kernel) ----------------------------------
_scratch = threading.local()


def _buffer(size: int) -> np.ndarray:
    """This thread's reused float32 scratch of `size` elements (grown, never shrunk)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < size:
        buf = _scratch.buf = np.empty(size, np.float32)
    return buf[:size]


@contextmanager
def _quiet_readonly():
    """torch.from_numpy warns on read-only arrays; these tensors are only ever read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        yield


def _dense_weight(m: QMatrix) -> torch.Tensor:
    """m as float32 [n_out, n_in]: decoded into the reused buffer, or by torch for other types."""
    if has_kernel(m.qtype):
        return torch.from_numpy(dequantize(m, _buffer(m.n_out * m.n_in).reshape(m.n_out, m.n_in)))
    from .dequant import dequantize as torch_dequantize

    with _quiet_readonly():
        data = torch.from_numpy(m.data.view(np.ndarray))  # shares the bytes; only read
    return torch_dequantize(data, Q(m.qtype), (m.n_in, m.n_out))  # [n_out, n_in]


def _dense(x: np.ndarray, gate: QMatrix, up: QMatrix, down: QMatrix,
           out: np.ndarray | None, scale: np.ndarray) -> np.ndarray:
    """Each matrix decoded in turn into one buffer, then BLAS: one matrix of scratch at a time."""
    linear = torch.nn.functional.linear
    with _quiet_readonly():
        xt = torch.from_numpy(x)  # [n, d]
    g = linear(xt, _dense_weight(gate))  # [n, ff]
    u = linear(xt, _dense_weight(up))  # [n, ff]
    h = torch.nn.functional.silu(g).mul_(u)  # [n, ff]
    y = linear(h, _dense_weight(down))  # [n, d]
    if out is None:
        return y.numpy()
    torch.from_numpy(out).add_(y.mul_(torch.from_numpy(scale)[:, None]))
    return out
