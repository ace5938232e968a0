"""CPU kernels: MoE experts' SwiGLU FFN computed on their quantized GGUF blocks.

`swiglu_experts(x, table, rows)` computes, for every expert e of an `ExpertTable` and each of
its token rows x_t (t in rows[e]), `y = down @ (silu(gate @ x_t) * (up @ x_t))`, reading the
blocks where they lie (a read-only arena or a memory map of the file, given as one base array
plus byte offsets): nothing is copied and no dequantized copy of an expert is kept.
`swiglu_expert(x, gate, up, down)` is the same for one expert given as three `QMatrix`.
Both take the family's activation (`act`: "swiglu", or gpt-oss's "swiglu_oai_clamped") and
experts given with biases, (gate, up, down, `Bias`), add them in the same kernels.

The jitted code (row decoders, the block layouts they read, the parallel kernels) is in
`qkernels_rows`; any other type falls back to the torch dequantizer (`dequant.dequantize`) and
a matmul.

Paths, picked per expert by its number of rows n:
  n < DENSE_MIN_ROWS (28)  fused: all such experts of a call share two parallel regions, one
        for gate and up (act(g) * u), one for down, each thread taking one contiguous span of
        (expert, output row) pairs of equal cost; the rows a few KB ahead are prefetched. For
        Q8_0, Q4_0, Q4_K, Q5_K and Q6_K each weight row is read once and dotted with up to four
        activation rows in one pass (rows_dot: codes decoded into 16-lane vector registers,
        multiply-added into accumulators held across the row); the other types decode a row
        into a per-thread float32 buffer (L1) and dot it with each activation row. Each output
        element is computed by one thread in a fixed order, so an expert's result is
        bit-identical run to run, for any thread count, whatever other experts share the call,
        and a token's result does not depend on the other rows of the batch.
  n >= DENSE_MIN_ROWS  dense (prefill): each matrix in turn is decoded by the same row decoders
        into one reused float32 buffer (parallel over rows) and multiplied by torch (BLAS):
        deterministic run to run for a given thread count.
A call whose matrix is under SERIAL_BYTES runs on the calling thread alone (no pool thread is
woken). In the fused path, the INT_TYPES (Q8_0 Q4_0 Q2_K Q4_K Q5_K Q6_K IQ2_XXS IQ1_S TQ2_0 TQ1_0
Q1_0 IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ1_M Q3_K IQ4_XS IQ4_NL Q4_1 Q5_0 Q5_1 MXFP4 NVFP4: every type
with a native kernel but F32 F16 BF16; rows of a multiple of 256 weights) quantize each
activation row to int8 once per call (per 32 values, as llama.cpp's Q8_0) and dot it with the
weight codes in integer arithmetic (rows_int: VNNI vpdpbusd where the CPU has it, AVX2
vpmaddubsw otherwise; 1.1-4x the float path's speed per core):
results then match float64 math on the dequantized weights and the *quantized* activations to
~1e-6 of the output's scale, and the unquantized ones to ~1e-2 (llama.cpp's level), still
deterministic. `set_int8_activations(False)` / MOESTREAM_CPU_EXACT=1 keep float32 activations
for every type: sums are float32, reassociated, so results agree with float64 math on the
dequantized weights to ~1e-6 of the output's scale (the tests allow 1e-5 * max |reference|).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import accumulate

import numba
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ....common.arch import EXPERT_ACTS
from ...experts.source import activate
from .rows import ACT_SWIGLU, ACT_SWIGLU_OAI, NATIVE, dequant_kernel, down_kernel, gate_up_kernel
from .rows_int import INT_TYPES
from .simd.integer import dot_path

# numba's 'omp' threading layer first, also when TBB is installed: 'workqueue' threads sleep on
# a condition variable and took ~0.2 ms per launch here (2x slower experts), and a layer of torch
# ops then experts ran 40 % slower with it than with 'omp'. The decoder package bounds libgomp's
# spinning between regions (GOMP_SPINCOUNT; see decoder/__init__.py). Takes
# effect when numba starts its pool (first parallel kernel); a NUMBA_THREADING_LAYER_PRIORITY or
# NUMBA_THREADING_LAYER set by the user still wins.
_PRIORITY = "omp tbb workqueue"
if os.environ.setdefault("NUMBA_THREADING_LAYER_PRIORITY", _PRIORITY) == _PRIORITY:
    numba.config.THREADING_LAYER_PRIORITY = _PRIORITY.split()

# Rows per expert from which decoding each matrix into a float32 buffer + torch's BLAS beats the
# fused kernel. Measured on 2 cores (fused time / dense time, Q8_0 Q4_K Q6_K): d = ff = 1024:
# n=16 0.77-0.87, n=24 0.82-0.93, n=32 0.95-1.08, n=48 1.17-1.34; d=2048, ff=768: n=16
# 0.70-0.77, n=24 0.86-1.00, n=32 1.05-1.34.
DENSE_MIN_ROWS = 28

# Weight bytes below which a kernel call runs on the calling thread alone (a one-thread region,
# no pool thread woken): waking the pool costs ~10 us idle and a scheduler time slice when a
# peer thread's core is busy (where the decode step's thread tuner then picks one thread); a 96
# KB matrix takes ~10 us on one thread here. Q1_0's q/k/v (221 KB) and output (147 KB) of a
# 1024-wide layer: 30 -> 17 us on two threads; `bench decode --neighbour` idle 150.5 -> 165.8
# tok/s with 384 KB -> 96 KB, beside a busy process 92.5 and 92.2 (Intel VM, 2 cores).
SERIAL_BYTES = 96 << 10

# int8 activations for the INT_TYPES' fused kernels (as llama.cpp: its CPU dots quantize the
# activations to Q8_0 / Q8_K): on by default where the CPU has an integer dot that keeps them at
# memory speed (VNNI, or AVX2's vpmaddubsw); MOESTREAM_CPU_EXACT=1 keeps float32 activations
# (results ~1e-6 of the output's scale from float64 math instead of ~1e-2; the tests that compare
# with transformers use it). `set_int8_activations` changes it for this process.
_INT8 = [os.environ.get("MOESTREAM_CPU_EXACT", "") in ("", "0") and dot_path() in ("vnni", "avx2")]


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
    addr: int = field(init=False, repr=False, compare=False)  # address of data's first byte

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
        object.__setattr__(self, "addr", d.__array_interface__["data"][0])  # for `expert_table`
        object.__setattr__(self, "_ro", _readonly(d))
        object.__setattr__(self, "_qts", np.full((1, 3), int(self.qtype), np.int64))

    @property
    def nbytes(self) -> int:
        return int(self.data.size)

    def readonly(self) -> np.ndarray:
        """A read-only base-class view of the bytes (no copy): one numba signature for all callers."""
        return self._ro


_SIZES = {int(q): size for q, size in GGML_QUANT_SIZES.items()}


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view(np.ndarray)  # also drops np.memmap, which numba would type apart
    v.flags.writeable = False
    return v


def has_kernel(qtype: int) -> bool:
    """Whether `qtype` is decoded natively (other types: torch dequantize, then a matmul)."""
    return qtype in _NATIVE_INTS


_NATIVE_INTS = frozenset(int(q) for q in NATIVE)


def set_threads(n: int) -> None:
    """Threads the kernels use: 1 .. NUMBA_NUM_THREADS (by default, the machine's cores)."""
    numba.set_num_threads(n)


def get_threads() -> int:
    return numba.get_num_threads()


def set_int8_activations(on: bool) -> None:
    """Whether the fused kernels of INT_TYPES quantize activations to int8 (see _INT8)."""
    _INT8[0] = bool(on)


def int8_activations() -> bool:
    return _INT8[0]


def has_int_kernel(qtype: int) -> bool:
    """Whether `qtype`'s fused kernel dots int8 activations (when int8_activations())."""
    return qtype in _INT_INTS


_INT_INTS = frozenset(int(q) for q in INT_TYPES)


def dequantize(m: QMatrix, out: np.ndarray | None = None) -> np.ndarray:
    """m as float32 [n_out, n_in] (into `out` when given), for a type with a native kernel."""
    if not has_kernel(m.qtype):
        raise ValueError(f"no native kernel for {Q(m.qtype).name}; use decoder.dequant.dequantize")
    w = np.empty((m.n_out, m.n_in), np.float32) if out is None else out  # [n_out, n_in]
    if w.shape != (m.n_out, m.n_in) or w.dtype != np.float32 or not w.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 [{m.n_out}, {m.n_in}], got {w.dtype} {w.shape}")
    dequant_kernel(int(m.qtype), m.readonly(), int(m.n_out), int(m.n_in), w)
    return w


Mats = tuple[QMatrix, QMatrix, QMatrix]  # gate, up, down
# An expert's biases (gpt-oss): gate [ff], up [ff], down [d] float32, added before the activation
# (gate, up) and to the output (down). An expert given as a 4-tuple (gate, up, down, Bias) has them.
Bias = tuple[np.ndarray, np.ndarray, np.ndarray]
ACTS: dict[str, int] = {"swiglu": ACT_SWIGLU, "swiglu_oai_clamped": ACT_SWIGLU_OAI}
assert set(ACTS) == set(EXPERT_ACTS), "every expert activation needs a kernel code"


def act_code(act: str) -> int:
    """The kernels' code of an expert activation name (`common.arch.EXPERT_ACTS`)."""
    if act not in ACTS:
        raise ValueError(f"unknown expert activation {act!r} (have: {', '.join(ACTS)})")
    return ACTS[act]


def bias_of(mats: Sequence) -> Bias | None:
    """The expert's biases when it was given as (gate, up, down, bias), else None."""
    return mats[3] if len(mats) > 3 else None


def _check_bias(bias: Bias | None, d: int, ff: int) -> Bias | None:
    if bias is None:
        return None
    shapes = tuple(np.shape(b) for b in bias)
    if len(bias) != 3 or shapes != ((ff,), (ff,), (d,)):
        raise ValueError(f"expert biases must be gate [{ff}], up [{ff}], down [{d}], got {list(shapes)}")
    return bias


@dataclass(frozen=True)
class ExpertTable:
    """Experts' gate/up/down bytes as byte offsets into base arrays (one for all three, or one
    each): what one `swiglu_experts` call reads. Built (and checked) once by `expert_table`."""

    bases: tuple[np.ndarray, np.ndarray, np.ndarray]  # gate's, up's, down's: [bytes] uint8, read-only views
    offsets: np.ndarray  # [E, 3] int64: byte offsets of gate, up, down in their bases
    qtypes: np.ndarray  # [E, 3] int64
    mats: tuple[Mats, ...]  # the experts as given (the dense path and fallback types use them)
    native: np.ndarray  # [E] bool: all three parts have a native kernel
    d: int
    ff: int
    bias_gu: np.ndarray = field(default=None)  # [E, 2, ff] float32 gate/up biases (zeros when none)
    bias_d: np.ndarray = field(default=None)  # [E, d] float32 down biases
    has_bias: bool = False
    all_native: bool = False  # native.all(), kept: a decode call would otherwise pay a numpy call for it

    def take(self, idx: np.ndarray) -> "ExpertTable":
        """The experts `idx` [U] (indices into this table) as a table of their own: a layer's
        table built once, then one call's experts picked from it without re-checking them."""
        bias_gu, bias_d = self.bias_gu, self.bias_d
        if self.has_bias:
            bias_gu, bias_d = _readonly(bias_gu[idx]), _readonly(bias_d[idx])  # [U, 2, ff], [U, d]
        native = self.native[idx]  # [U]
        # (filled in directly: a frozen dataclass's __init__ sets each field through
        # object.__setattr__, which costs more than the three array picks, once per layer call)
        t = object.__new__(ExpertTable)
        t.__dict__.update(bases=self.bases, offsets=self.offsets[idx], qtypes=self.qtypes[idx],
                          mats=tuple(map(self.mats.__getitem__, idx.tolist())), native=native, d=self.d,
                          ff=self.ff, bias_gu=bias_gu, bias_d=bias_d, has_bias=self.has_bias,
                          all_native=self.all_native or bool(native.all()))
        return t


def view_offset(base: np.ndarray, view: np.ndarray | QMatrix) -> int:
    """Byte offset of `view`'s first byte inside `base` (contiguous uint8 arrays; `view` must lie
    within `base`'s bytes, e.g. a slice of it or a np.frombuffer of part of the same mapping)."""
    addr = view.addr if isinstance(view, QMatrix) else view.__array_interface__["data"][0]
    off, size = addr - base.__array_interface__["data"][0], view.nbytes
    if off < 0 or off + size > base.nbytes:
        raise ValueError(f"{size} bytes at offset {off} are not inside the base array of {base.nbytes} bytes")
    return off


def expert_table(base: np.ndarray | Sequence[np.ndarray], experts: Sequence[Mats]) -> ExpertTable:
    """The experts (gate, up, down) whose bytes all lie inside `base` (1-D uint8: a file's memory
    map, an arena mapping), as offsets. All experts must share d and ff. `base` may be three
    arrays, (gate's, up's, down's): a split model's layer can keep them in three files.

    One pass of plain Python over the experts: it runs once per layer, right after kernels that
    have streamed megabytes through the caches, where each numpy call costs several microseconds.
    """
    bases = (base,) * 3 if isinstance(base, np.ndarray) else tuple(base)
    if len(bases) != 3 or not all(isinstance(b, np.ndarray) and b.dtype == np.uint8 and b.ndim == 1
                                  and b.flags.c_contiguous for b in bases):
        raise ValueError("base must be a contiguous 1-D uint8 array, or three (gate's, up's, down's)")
    if not experts:
        raise ValueError("no experts")
    starts, sizes = [b.__array_interface__["data"][0] for b in bases], [b.nbytes for b in bases]
    d, ff = experts[0][0].n_in, experts[0][0].n_out
    offsets, qtypes, native = [], [], []
    biases = [_check_bias(bias_of(m), d, ff) for m in experts]
    if any(b is not None for b in biases) and any(b is None for b in biases):
        raise ValueError("experts of one table must all have biases or all have none")
    for e, mats in enumerate(experts):
        mats = mats[:3]
        _check_chain(*mats)
        if mats[0].n_in != d or mats[0].n_out != ff:
            raise ValueError(f"experts of one table must share d and ff: expert 0 has d={d}, ff={ff}, "
                             f"expert {e} d={mats[0].n_in}, ff={mats[0].n_out}")
        offs = [m.addr - start for m, start in zip(mats, starts)]
        if min(offs) < 0 or any(o + m.nbytes > size for o, m, size in zip(offs, mats, sizes)):
            raise ValueError(f"expert {e}'s bytes (offsets {offs}) are not all inside the base arrays of {sizes} bytes")
        offsets.append(offs)
        qtypes.append([m.qtype for m in mats])
        native.append(all(m.qtype in _NATIVE_INTS for m in mats))
    has_bias = biases[0] is not None
    bias_gu, bias_d = _NO_BIAS_GU, _NO_BIAS_D  # (read-only already: nothing to do per layer)
    if has_bias:
        bias_gu = _readonly(np.stack([np.stack(b[:2]) for b in biases]).astype(np.float32))  # [E, 2, ff]
        bias_d = _readonly(np.stack([b[2] for b in biases]).astype(np.float32))  # [E, d]
    return ExpertTable(tuple(_readonly(b) for b in bases), np.array(offsets, np.int64), np.array(qtypes, np.int64),
                       tuple(tuple(m) for m in experts), np.array(native), int(d), int(ff), bias_gu, bias_d, has_bias,
                       all(native))


class TableRows:
    """A table over one base whose rows are set one at a time and picked per call: an arena's
    experts, each checked (`expert_table`) once when it lands in a slot, not on every layer call
    that uses it. `held[i]` is the caller's key of what row i holds (a slot; -1: nothing)."""

    def __init__(self, base: np.ndarray, n: int):
        self.base = base
        self.held = np.full(n, -1, np.int64)  # [n]
        self._table: ExpertTable | None = None  # n rows, those never set unread

    def set(self, i: int, key: int, mats: Mats) -> None:
        """Row i := the expert `mats` (checked as `expert_table` checks it), held under `key`."""
        self.put(i, key, self.check(mats))

    def check(self, mats: Mats) -> ExpertTable:
        """The expert `mats` as a checked one-row table over this base, for `put`."""
        return expert_table(self.base, [mats])

    def put(self, i: int, key: int, one: ExpertTable) -> None:
        """Row i := the one-row table `one` (from `check` on this base), held under `key`."""
        t = self._table
        if t is None:
            n = self.held.size
            bias_gu = np.zeros((n, 2, one.ff), np.float32) if one.has_bias else one.bias_gu
            bias_d = np.zeros((n, one.d), np.float32) if one.has_bias else one.bias_d
            t = self._table = ExpertTable(one.bases, np.zeros((n, 3), np.int64), np.zeros((n, 3), np.int64),
                                          [one.mats[0]] * n, np.zeros(n, bool), one.d, one.ff, bias_gu, bias_d,
                                          one.has_bias, True)  # (all_native: of the rows set, which take picks from)
        elif (one.d, one.ff, one.has_bias) != (t.d, t.ff, t.has_bias):
            raise ValueError(f"experts of one table must share d, ff and biases: d={t.d}, ff={t.ff}, "
                             f"biases {t.has_bias}; row {i} has d={one.d}, ff={one.ff}, biases {one.has_bias}")
        t.offsets[i], t.qtypes[i], t.native[i], t.mats[i] = one.offsets[0], one.qtypes[0], one.native[0], one.mats[0]
        if t.has_bias:
            t.bias_gu[i], t.bias_d[i] = one.bias_gu[0], one.bias_d[0]
        if t.all_native and not one.all_native:
            self._table = replace(t, all_native=False)
        self.held[i] = key

    def take(self, idx: np.ndarray) -> ExpertTable:
        """The rows `idx` [U] as a table of their own: each must have been set (the caller
        checks `held`; a row never set would describe the base's first bytes)."""
        if self._table is None:
            raise ValueError("no row was set")
        return self._table.take(idx)


# stand-ins for experts without biases: one numba signature either way, never read
_NO_BIAS_GU = _readonly(np.zeros((1, 2, 1), np.float32))
_NO_BIAS_D = _readonly(np.zeros((1, 1), np.float32))


def swiglu_experts(x: np.ndarray, table: ExpertTable, rows: Sequence[np.ndarray],
                   act: str = "swiglu") -> list[np.ndarray]:
    """For each expert e of `table`: y_e = down_e @ (silu(gate_e @ x_t) * (up_e @ x_t)) for the
    rows t in rows[e] (int indices into x [N, d] float32). Returns [y_e [len(rows[e]), d]].
    `act` names the activation (`ACTS`); experts with biases add them (see `Bias`).

    The fused experts (native types, fewer than DENSE_MIN_ROWS rows) share two parallel regions;
    each y_e is bit-identical to `swiglu_expert(x[rows[e]], *table.mats[e])`, whatever the
    other experts of the call.
    """
    if len(rows) != len(table.mats):
        raise ValueError(f"{len(table.mats)} experts but {len(rows)} row lists")
    idx = [np.asarray(r, dtype=np.int64).reshape(-1) for r in rows]
    row_ptr = np.array([0, *accumulate(r.size for r in idx)], np.int64)  # [E + 1]
    ys = swiglu_rows(x, table, row_ptr, np.concatenate(idx or [_NO_ROWS]), act)  # [R, d]
    return [ys[a:b] for a, b in zip(row_ptr[:-1].tolist(), row_ptr[1:].tolist())]


def swiglu_rows(x: np.ndarray, table: ExpertTable, row_ptr: np.ndarray, rows: np.ndarray,
                act: str = "swiglu") -> np.ndarray:
    """`swiglu_experts` with the rows given as the kernels take them: expert e of `table` gets
    the rows rows[row_ptr[e]:row_ptr[e + 1]] of x [N, d]; y [R, d] in the same order (the layer's
    one call, with no per-expert lists)."""
    x = _check_x(x, table.d)  # [N, d]
    n_exp = len(table.mats)
    if row_ptr.shape != (n_exp + 1,) or row_ptr[0] != 0 or row_ptr[-1] != rows.size:
        raise ValueError(f"row_ptr must be [{n_exp + 1}] from 0 to {rows.size}, got {row_ptr.tolist()}")
    if not rows_within(rows, x.shape[0]):
        raise ValueError(f"row indices must lie in [0, {x.shape[0]})")
    code = act_code(act)
    if table.all_native and rows.size < DENSE_MIN_ROWS:  # (so is every expert's count: decode)
        return _run_fused(x, table, row_ptr, rows, code)  # [R, d]
    counts = np.diff(row_ptr)  # [E]
    fused = table.native & (counts < DENSE_MIN_ROWS)  # [E]
    if fused.all():
        return _run_fused(x, table, row_ptr, rows, code)  # [R, d]
    on_fused = np.repeat(fused, counts)  # [R]
    ys = np.empty((rows.size, table.d), np.float32)  # [R, d]
    fused_ptr = np.concatenate([[0], np.cumsum(np.where(fused, counts, 0))]).astype(np.int64)  # [E + 1]
    ys[on_fused] = _run_fused(x, table, fused_ptr, rows[on_fused], code)
    for e in np.flatnonzero(~fused & (counts > 0)).tolist():  # prefill-sized experts, other types
        a, b, mats = int(row_ptr[e]), int(row_ptr[e + 1]), table.mats[e]
        ys[a:b] = swiglu_expert(x[rows[a:b]], *mats[:3], bias=bias_of(mats), act=act)
    return ys


_NO_ROWS = np.zeros(0, np.int64)


def _run_fused(x: np.ndarray, table: ExpertTable, row_ptr: np.ndarray, row_idx: np.ndarray, act: int) -> np.ndarray:
    """The two parallel regions over every expert with rows in row_ptr: y [R, d]."""
    n_rows = int(row_ptr[-1])
    y = np.empty((n_rows, table.d), np.float32)  # [R, d]
    if n_rows:
        (gbase, ubase, dbase), offs, qts = table.bases, table.offsets, table.qtypes
        threads = _threads_for(len(table.mats) * table.mats[0][0].nbytes)  # (experts without rows are rare)
        h = np.empty((n_rows, table.ff), np.float32)  # [R, ff]
        with _pool(threads):
            gate_up_kernel(gbase, ubase, offs, qts, _readonly(x), row_ptr, row_idx, table.ff, table.d, h, threads,
                           table.bias_gu, table.has_bias, act, _INT8[0])
            down_kernel(dbase, offs, qts, _readonly(h), row_ptr, table.d, table.ff, y, threads, table.bias_d,
                        table.has_bias, _INT8[0])
    return y


def _threads_for(nbytes: int) -> int:
    """Threads for a kernel call reading ~nbytes of one matrix's weights: 1 below SERIAL_BYTES."""
    return 1 if nbytes < SERIAL_BYTES else numba.get_num_threads()



@contextmanager
def _pool(threads: int):
    """numba's threads for this thread's next parallel region: with one, the region runs on the
    caller alone and wakes no pool thread (numba's per-thread count, restored after)."""
    if threads != 1:  # the caller's own count (from _threads_for): nothing to change
        yield
        return
    prev = numba.get_num_threads()
    if threads == prev:
        yield
        return
    numba.set_num_threads(threads)
    try:
        yield
    finally:
        numba.set_num_threads(prev)


def _gate_up(gdata, udata, offs, qts, x, row_ptr, row_idx, ff, d, h, threads, bias, has_bias, act) -> None:
    with _pool(threads):
        gate_up_kernel(gdata, udata, offs, qts, x, row_ptr, row_idx, ff, d, h, threads, bias, has_bias, act, _INT8[0])


def _down(ddata, offs, qts, h, row_ptr, n_out, n_in, y, threads, bias, has_bias) -> None:
    with _pool(threads):
        down_kernel(ddata, offs, qts, h, row_ptr, n_out, n_in, y, threads, bias, has_bias, _INT8[0])


def swiglu_expert(x: np.ndarray, gate: QMatrix, up: QMatrix, down: QMatrix,
                  out: np.ndarray | None = None, scale: np.ndarray | None = None,
                  bias: Bias | None = None, act: str = "swiglu") -> np.ndarray:
    """y = down @ (silu(gate @ x_t) * (up @ x_t)) for each row x_t of x [n, d] float32 (another
    activation with `act`; with `bias`, gate/up/down biases added as `Bias` says).

    Returns y [n, d] float32; when `out` [n, d] float32 is given, does `out += scale[:, None] * y`
    instead (scale [n] float32; ones when None) and returns `out`.
    """
    _check_chain(gate, up, down)
    d, ff = int(gate.n_in), int(gate.n_out)
    code, bias = act_code(act), _check_bias(bias, d, ff)
    x = _check_x(x, d)  # [n, d]
    n = x.shape[0]
    sc = _check_out(out, scale, n, d)  # [n]
    if n == 0:
        return out if out is not None else np.zeros((0, d), np.float32)
    if n >= DENSE_MIN_ROWS or not all(has_kernel(m.qtype) for m in (gate, up, down)):
        return _dense(x, gate, up, down, out, sc, bias, act)
    if bias is not None:
        bias_gu = _readonly(np.ascontiguousarray(np.stack(bias[:2])[None], dtype=np.float32))  # [1, 2, ff]
        bias_d = _readonly(np.ascontiguousarray(bias[2][None], dtype=np.float32))  # [1, d]
    else:
        bias_gu, bias_d = _NO_BIAS_GU, _NO_BIAS_D
    # the multi-expert kernels with one expert, each part its own base at offset 0; plain ints
    # and read-only inputs throughout, so each kernel has exactly one numba signature
    qts = np.array([[int(gate.qtype), int(up.qtype), int(down.qtype)]], np.int64)  # [1, 3]
    row_ptr = np.array([0, n], np.int64)
    h = np.empty((n, ff), np.float32)  # [n, ff]
    threads = _threads_for(gate.nbytes)
    _gate_up(gate.readonly(), up.readonly(), _ZERO_OFFS, qts, _readonly(x), row_ptr, _arange(n), ff, d, h,
             threads, bias_gu, bias is not None, code)
    y = np.empty((n, d), np.float32)  # [n, d]
    _down(down.readonly(), _ZERO_OFFS, qts, _readonly(h), row_ptr, d, ff, y, threads, bias_d, bias is not None)
    if out is None:
        return y
    out += sc[:, None] * y
    return out


def linear(x: np.ndarray, m: QMatrix) -> np.ndarray:
    """x [n, n_in] float32 @ m.T -> [n, n_out] float32: a dense weight kept as its GGUF blocks.

    The same two paths as the experts: rows decoded in registers for few rows (bit-identical
    for any thread count and batch), decode into a buffer + BLAS from DENSE_MIN_ROWS rows."""
    x = _check_x(x, int(m.n_in))  # [n, n_in]
    n = x.shape[0]
    if n >= DENSE_MIN_ROWS or not has_kernel(m.qtype):
        with _quiet_readonly():
            return torch.nn.functional.linear(torch.from_numpy(x), _dense_weight(m)).numpy()  # [n, n_out]
    y = np.empty((n, m.n_out), np.float32)  # [n, n_out]
    _down(m._ro, _ZERO_OFFS, m._qts, _readonly(x), _row_ptr(n), m.n_out, m.n_in, y, _threads_for(m.nbytes),
          _NO_BIAS_D, False)
    return y


_ZERO_OFFS = np.zeros((1, 3), np.int64)  # one expert, each part at the start of its own array


def _arange(n: int) -> np.ndarray:
    return _ARANGE[:n] if n <= _ARANGE.size else np.arange(n, dtype=np.int64)


_ARANGE = np.arange(DENSE_MIN_ROWS, dtype=np.int64)
_ROW_PTRS = [np.array([0, n], np.int64) for n in range(64)]  # one expert of n rows (linear's n < DENSE_MIN_ROWS)


def _row_ptr(n: int) -> np.ndarray:
    return _ROW_PTRS[n] if n < len(_ROW_PTRS) else np.array([0, n], np.int64)


def _check_chain(gate: QMatrix, up: QMatrix, down: QMatrix) -> None:
    if gate.n_out != up.n_out or gate.n_in != up.n_in or down.n_in != gate.n_out or down.n_out != gate.n_in:
        raise ValueError(f"expert shapes do not chain: gate [{gate.n_out} x {gate.n_in}], "
                         f"up [{up.n_out} x {up.n_in}], down [{down.n_out} x {down.n_in}]")


@numba.njit(cache=True, nogil=True)
def rows_within(rows: np.ndarray, n: int) -> bool:
    """Whether every index of rows lies in [0, n) (the kernels index activations unchecked; one
    compiled loop costs less than numpy's min and max on a decode step's few rows)."""
    for i in range(rows.size):
        if rows[i] < 0 or rows[i] >= n:
            return False
    return True


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
    from ..dequant.blocks import dequantize as torch_dequantize

    with _quiet_readonly():
        data = torch.from_numpy(m.data.view(np.ndarray))  # shares the bytes; only read
    return torch_dequantize(data, Q(m.qtype), (m.n_in, m.n_out))  # [n_out, n_in]


def _dense(x: np.ndarray, gate: QMatrix, up: QMatrix, down: QMatrix, out: np.ndarray | None, scale: np.ndarray,
           bias: Bias | None = None, act: str = "swiglu") -> np.ndarray:
    """Each matrix decoded in turn into one buffer, then BLAS: one matrix of scratch at a time."""
    linear = torch.nn.functional.linear
    with _quiet_readonly():
        xt = torch.from_numpy(x)  # [n, d]
        bg, bu, bd = (None, None, None) if bias is None else (torch.from_numpy(np.asarray(b, np.float32)) for b in bias)
    g = linear(xt, _dense_weight(gate), bg)  # [n, ff]
    u = linear(xt, _dense_weight(up), bu)  # [n, ff]
    h = activate(g, u, act)  # [n, ff]
    y = linear(h, _dense_weight(down), bd)  # [n, d]
    if out is None:
        return y.numpy()
    torch.from_numpy(out).add_(y.mul_(torch.from_numpy(scale)[:, None]))
    return out
