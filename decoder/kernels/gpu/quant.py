"""GGUF block decoding inside Triton kernels: any weight element from its raw bytes, in registers.

`decode(mat, rows, k0, row_bytes, lut, QT, G)` returns float32 weights [BN, G, 32] of the
matrix whose bytes start at `mat` (a pointer to uint8; rows of `row_bytes` bytes, ggml order: a
row is `n_in` values, the block of column c is c // block): columns k0 .. k0 + 32 G as G groups
of 32 elements. Every format here scales groups of 32 elements or parts of one (16, 8), so a tile
loads each group's scale bytes once ([BN, G, 1]) and each element's code byte once ([BN, G, 32]):
gathers that hit L1, no shared-memory staging, no dequantized copy anywhere. The per-type block
decoders and their layouts are in `blocks.py` and `grids.py`; `lut` is the type's
table (`lut()`): a value table (float32 [16]) or a grid (int8 rows), or zeros.
"""

from __future__ import annotations

import functools
import os

import gguf.quants
import numpy as np
import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from . import blocks as tb
from . import grids as tg

# The types the kernels decode; any other falls back to the torch dequantizer (`blocks.py`).
KERNEL_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.IQ4_XS, Q.MXFP4, Q.F32, Q.F16, Q.BF16,
                Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.TQ1_0, Q.TQ2_0, Q.Q1_0, Q.NVFP4,
                Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S)
_KINT = frozenset(int(q) for q in KERNEL_TYPES)

# 16-entry value tables, passed to the kernels as a float32 tensor
_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl
_E2M1X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # E2M1 values doubled
_LUTS = {Q.IQ4_XS: _IQ4NL, Q.IQ4_NL: _IQ4NL, Q.MXFP4: _E2M1X2, Q.NVFP4: _E2M1X2}
# grid types: gguf-py's grid of each (rows of 8 or 4 small integers), passed as int8
_GRIDS = (Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S)


def has_kernel(qtype: int) -> bool:
    return int(qtype) in _KINT


def lut(qtype: int, device: torch.device | str) -> torch.Tensor:
    """The table `decode` gathers from for `qtype` on `device`: float32 [16] values, an int8 grid
    [rows * width] for the grid types, float32 zeros [16] for types without a table. Made once
    per type and device (read-only), so a launch copies nothing to the device."""
    return _lut(Q(qtype), torch.device(device))


@functools.cache
def _lut(q: Q, device: torch.device) -> torch.Tensor:
    if q in _GRIDS:
        return torch.from_numpy(grid_table(q)).to(device)  # [rows * width]
    return torch.tensor(_LUTS.get(q, (0,) * 16), dtype=torch.float32, device=device)  # [16]


@functools.cache
def grid_table(qtype: Q) -> np.ndarray:
    """gguf-py's grid of a grid type, flattened to int8 [rows * width] (its values are small
    integers: -1..1 for IQ1, up to 62 for IQ3_XXS, so int8 holds them exactly)."""
    cls = getattr(gguf.quants, Q(qtype).name)
    cls.init_grid()
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(-1)  # [rows * width]
    table = grid.astype(np.int8)
    assert np.array_equal(table.astype(np.float32), grid), f"{Q(qtype).name} grid is not small integers"
    return table


def block_of(qtype: int) -> tuple[int, int]:
    """(elements per block, bytes per block)."""
    return GGML_QUANT_SIZES[Q(qtype)]


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (TRITON_INTERPRET=1: numpy on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def col_tile(n_in: int, most: int = 64) -> int:
    """Columns per tile: the largest power of two <= `most` dividing the row length (every block
    size here divides 32 or is a multiple of 64). Rows are whole tiles: no column masks."""
    bk = most
    while bk > 32 and n_in % bk:
        bk //= 2
    if n_in % bk:
        raise ValueError(f"row length {n_in} is not a multiple of 32")
    return bk


# Tile sizes: on a GPU, small tiles (many programs for a matrix-vector product); under the
# interpreter, where each program costs Python overhead, big ones.
# On a GPU: 256 columns = 8 groups per row in a tile, so a thread holds several elements of one
# group and loads its scales once (sm_90 PTX of the Q4_K dequantizer: 21 instructions and 1.2
# byte loads per element, against 76 and 8 with 64 columns). Not timed on a GPU yet (none was
# available): `.ci/gpu_check.sh` sweeps these.
TILE_ROWS, TILE_COLS = (128, 256) if interpreted() else (16, 256)
NUM_WARPS = 4


@triton.jit
def _block(row, colg, QK: tl.constexpr, TS: tl.constexpr):
    """(pointer to the block of the group starting at column colg [1, G, 1], group index in it)."""
    return row + (colg // QK) * TS, (colg % QK) // 32


@triton.jit
def _quant(row, colg, l, lut, QT: tl.constexpr):
    """Elements [BN, G, 32] of a block type QT (rows `row` [BN, 1, 1], groups at columns colg):
    its block decoder at (block size, bytes) literals; `lut` is its table (`lut()`)."""
    # one assignment per constexpr branch, one return: only the taken branch is compiled
    if QT == 8:  # Q8_0
        blk, gi = _block(row, colg, 32, 34)
        w = tb._q8_0(blk, gi, l)
    elif QT == 2:  # Q4_0
        blk, gi = _block(row, colg, 32, 18)
        w = tb._q4_0(blk, gi, l)
    elif QT == 3:  # Q4_1
        blk, gi = _block(row, colg, 32, 20)
        w = tb._q4_1(blk, gi, l)
    elif QT == 6:  # Q5_0
        blk, gi = _block(row, colg, 32, 22)
        w = tb._q5_0(blk, gi, l)
    elif QT == 7:  # Q5_1
        blk, gi = _block(row, colg, 32, 24)
        w = tb._q5_1(blk, gi, l)
    elif QT == 20:  # IQ4_NL
        blk, gi = _block(row, colg, 32, 18)
        w = tb._iq4_nl(blk, gi, l, lut)
    elif QT == 39:  # MXFP4
        blk, gi = _block(row, colg, 32, 17)
        w = tb._mxfp4(blk, gi, l, lut)
    elif QT == 40:  # NVFP4
        blk, gi = _block(row, colg, 64, 36)
        w = tb._nvfp4(blk, gi, l, lut)
    elif QT == 41:  # Q1_0
        blk, gi = _block(row, colg, 128, 18)
        w = tb._q1_0(blk, gi, l)
    elif QT == 34:  # TQ1_0
        blk, gi = _block(row, colg, 256, 54)
        w = tb._tq1_0(blk, gi, l)
    elif QT == 35:  # TQ2_0
        blk, gi = _block(row, colg, 256, 66)
        w = tb._tq2_0(blk, gi, l)
    elif QT == 10:  # Q2_K
        blk, gi = _block(row, colg, 256, 84)
        w = tb._q2_k(blk, gi, l)
    elif QT == 11:  # Q3_K
        blk, gi = _block(row, colg, 256, 110)
        w = tb._q3_k(blk, gi, l)
    elif QT == 12:  # Q4_K
        blk, gi = _block(row, colg, 256, 144)
        w = tb._q4_k(blk, gi, l)
    elif QT == 13:  # Q5_K
        blk, gi = _block(row, colg, 256, 176)
        w = tb._q5_k(blk, gi, l)
    elif QT == 14:  # Q6_K
        blk, gi = _block(row, colg, 256, 210)
        w = tb._q6_k(blk, gi, l)
    elif QT == 23:  # IQ4_XS
        blk, gi = _block(row, colg, 256, 136)
        w = tb._iq4_xs(blk, gi, l, lut)
    elif QT == 16:  # IQ2_XXS
        blk, gi = _block(row, colg, 256, 66)
        w = tg._iq2_xxs(blk, gi, l, lut)
    elif QT == 17:  # IQ2_XS
        blk, gi = _block(row, colg, 256, 74)
        w = tg._iq2_xs(blk, gi, l, lut)
    elif QT == 22:  # IQ2_S
        blk, gi = _block(row, colg, 256, 82)
        w = tg._iq2_s(blk, gi, l, lut)
    elif QT == 18:  # IQ3_XXS
        blk, gi = _block(row, colg, 256, 98)
        w = tg._iq3_xxs(blk, gi, l, lut)
    elif QT == 21:  # IQ3_S
        blk, gi = _block(row, colg, 256, 110)
        w = tg._iq3_s(blk, gi, l, lut)
    elif QT == 19:  # IQ1_S
        blk, gi = _block(row, colg, 256, 50)
        w = tg._iq1_s(blk, gi, l, lut)
    else:  # IQ1_M (29): the host only launches types in KERNEL_TYPES
        blk, gi = _block(row, colg, 256, 56)
        w = tg._iq1_m(blk, gi, l, lut)
    return w


@triton.jit
def decode(mat, rows, k0, row_bytes, lut, QT: tl.constexpr, G: tl.constexpr):
    """float32 weights [BN, G, 32]: rows [BN, 1, 1] (int64) of the matrix at `mat`, columns
    k0 .. k0 + 32 G (element [r, g, l] is column k0 + 32 g + l)."""
    row = mat + rows * row_bytes  # [BN, 1, 1]
    l = tl.arange(0, 32)[None, None, :]  # [1, 1, 32]
    colg = k0 + 32 * tl.arange(0, G)[None, :, None]  # [1, G, 1]
    if QT == 0:  # F32
        w = tb._f32(row + (colg + l) * 4)
    elif QT == 1:  # F16
        w = tb._f16(row + (colg + l) * 2)
    elif QT == 30:  # BF16
        w = tb._bf16(row + (colg + l) * 2)
    else:
        w = _quant(row, colg, l, lut, QT)
    return w


@triton.jit
def _dequant_kernel(src, out, lut, n_out, n_in, row_bytes, QT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)[:, None, None]  # [BN, 1, 1]
    k0 = tl.program_id(1) * BK
    cols = k0 + 32 * tl.arange(0, BK // 32)[None, :, None] + tl.arange(0, 32)[None, None, :]  # [1, G, 32]
    mask = rows < n_out
    safe = tl.where(mask, rows, 0).to(tl.int64)  # masked rows read row 0: always in bounds
    w = decode(src, safe, k0, row_bytes, lut, QT, BK // 32)  # [BN, G, 32]
    tl.store(out + rows.to(tl.int64) * n_in + cols, w.to(out.dtype.element_ty), mask=mask)


def dequantize(raw: torch.Tensor, qtype: int, n_out: int, n_in: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[n_out, n_in] in `dtype` from one matrix's GGUF bytes `raw` (uint8, contiguous, on the
    compute device): one launch. For a type without a kernel, a ValueError."""
    if not has_kernel(qtype):
        raise ValueError(f"no Triton kernel for {Q(qtype).name}")
    block, size = block_of(qtype)
    row_bytes = n_in // block * size
    if raw.dtype != torch.uint8 or raw.numel() != n_out * row_bytes or n_in % block:
        raise ValueError(f"{Q(qtype).name} [{n_out} x {n_in}] needs {n_out * row_bytes} uint8 bytes, "
                         f"got {raw.numel()} {raw.dtype}")
    out = torch.empty(n_out, n_in, dtype=dtype, device=raw.device)  # [n_out, n_in]
    bn, bk = TILE_ROWS, col_tile(n_in, TILE_COLS)
    grid = (triton.cdiv(n_out, bn), n_in // bk)
    _dequant_kernel[grid](raw.contiguous(), out, lut(qtype, raw.device), n_out, n_in, row_bytes,
                          QT=int(qtype), BN=bn, BK=bk, num_warps=NUM_WARPS, enable_fp_fusion=False)  # no FMA: bit-exact
    return out


# float16 scale fields of each type (byte offsets in its block) and their size in random blocks
_SCALES = {Q.Q8_0: ((0,), 2e-3), Q.Q4_0: ((0,), 2e-3), Q.Q4_1: ((0, 2), 2e-3), Q.Q5_0: ((0,), 2e-3),
           Q.Q5_1: ((0, 2), 2e-3), Q.IQ4_NL: ((0,), 2e-3), Q.Q1_0: ((0,), 2e-2), Q.TQ1_0: ((52,), 2e-2),
           Q.TQ2_0: ((64,), 2e-2), Q.Q2_K: ((80, 82), 2e-3), Q.Q3_K: ((108,), 2e-4), Q.Q4_K: ((0, 2), 2e-4),
           Q.Q5_K: ((0, 2), 2e-4), Q.Q6_K: ((208,), 2e-4), Q.IQ4_XS: ((0,), 2e-4),
           **dict.fromkeys((Q.IQ1_S, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S), ((0,), 1e-3))}


def random_blocks(qtype: int, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """[n_out * row_bytes] uint8 of random valid blocks for tests and benchmarks: random code
    bytes (every bit pattern), scale fields set to small finite values."""
    block, size = block_of(qtype)
    n_blocks = n_out * n_in // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    q = Q(qtype)
    if q in (Q.F32, Q.F16, Q.BF16):
        dt = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.float32}[q]
        vals = (rng.standard_normal(n_blocks) * 0.05).astype(dt)
        if q is Q.BF16:
            vals = (vals.view(np.uint32) >> 16).astype(np.uint16)
        return np.ascontiguousarray(vals).view(np.uint8).reshape(-1)
    if q is Q.MXFP4:
        raw[:, 0] = rng.integers(118, 124, n_blocks)  # 2^-10 .. 2^-5
    elif q is Q.NVFP4:
        raw[:, :4] = rng.integers(0, 0x20, (n_blocks, 4))  # UE4M3 0 .. 0.06 (halved): zero, subnormals, normals
    elif q is Q.IQ1_M:  # d's 16 bits: the top nibbles of the u16 words at 48, 50, 52, 54
        bits = _random_f16(rng, n_blocks, 1e-3).view(np.uint16)
        for i in range(4):
            nib = ((bits >> (4 * i)) & 15).astype(np.uint8)
            raw[:, 49 + 2 * i] = (raw[:, 49 + 2 * i] & 0x0F) | (nib << 4)
    else:
        offsets, scale = _SCALES.get(q, ((0,), 2e-4))
        for off in offsets:
            raw[:, off:off + 2] = _random_f16(rng, n_blocks, scale).view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)


def _random_f16(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    return (rng.uniform(0.5, 1.0, n) * scale).astype(np.float16)  # [n]
