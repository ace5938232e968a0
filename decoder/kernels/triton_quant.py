"""GGUF block decoding inside Triton kernels: any weight element from its raw bytes, in registers.

`decode(mat, rows, k0, row_bytes, lut, QT, G)` returns float32 weights [BN, G, 32] of the
matrix whose bytes start at `mat` (a pointer to uint8; rows of `row_bytes` bytes, ggml order: a
row is `n_in` values, the block of column c is c // block): columns k0 .. k0 + 32 G as G groups
of 32 elements. Every format here scales groups of 32 (Q6_K: 16) elements, so a tile loads each
group's scale bytes once ([BN, G, 1]) and each element's code byte once ([BN, G, 32]): gathers
that hit L1, no shared-memory staging, no dequantized copy anywhere. The arithmetic repeats gguf-py's
numpy reference (`gguf.quants`): scales widened from float16 first, (d * scale) * q - (dmin * m).

Block layouts (bytes; `d`, `dmin` float16 little-endian; ggml's `block_*` structs):

    Q8_0   34: d | int8 q[32]
    Q4_0   18: d | u8 qs[16]        q = nibble - 8; low nibbles are elements 0-15, high 16-31
    MXFP4  17: e8m0 e | u8 qs[16]   v = 2^(e-128) * E2M1x2[nibble] (same nibble order as Q4_0)
    IQ4_XS 136: d | u16 scales_h | u8 scales_l[4] | u8 qs[128]   sub-block scale ls - 32 (6 bits)
    Q4_K  144: d | dmin | scales[12] | qs[128]    8 sub-blocks of 32, 6-bit scale and min each
    Q5_K  176: d | dmin | scales[12] | qh[32] | qs[128]           bit i of qh[l] is element 32i+l's 5th
    Q6_K  210: ql[128] | qh[64] | int8 scales[16] | d            16 sub-blocks of 16
    F32 4, F16 2, BF16 2: one element
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

# The types the kernels decode; any other falls back to the torch dequantizer (`dequant.py`).
KERNEL_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.IQ4_XS, Q.MXFP4, Q.F32, Q.F16, Q.BF16)
_KINT = frozenset(int(q) for q in KERNEL_TYPES)

# 16-entry value tables, passed to the kernels as a float32 tensor (types without one get zeros)
_LUTS = {
    Q.IQ4_XS: (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),  # kvalues_iq4nl
    Q.MXFP4: (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12),  # E2M1 values doubled
}


def has_kernel(qtype: int) -> bool:
    return int(qtype) in _KINT


def lut(qtype: int, device: torch.device) -> torch.Tensor:
    """The value table `decode` gathers from for `qtype`: float32 [16] on `device`."""
    return torch.tensor(_LUTS.get(Q(qtype), (0,) * 16), dtype=torch.float32, device=device)  # [16]


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
# available): `.dev/gpu_check.sh` sweeps these.
TILE_ROWS, TILE_COLS = (128, 256) if interpreted() else (16, 256)
NUM_WARPS = 4


# -- jitted helpers ---------------------------------------------------------------------------
@triton.jit
def _f16(p):
    """float16 at byte pointer(s) p (any alignment), widened to float32."""
    lo = tl.load(p).to(tl.uint16)
    hi = tl.load(p + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _u8(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _nib16(qs, l):
    """Q4_0-order nibble of element l (0..31) of a 16-byte code array: low nibbles first."""
    byte = _u8(qs + (l % 16))
    return tl.where(l < 16, byte & 15, byte >> 4)


# Each block decoder takes blk [BN, G, 1] (byte pointer to the block holding a 32-element group),
# gi [1, G, 1] (the group's index inside its block) and l [1, 1, 32] (the element's index in
# the group), and returns float32 [BN, G, 32]. Scales are loaded per group, codes per element.
@triton.jit
def _q8_0(blk, gi, l):
    return _f16(blk) * tl.load(blk + 2 + l).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _q4_0(blk, gi, l):
    return _f16(blk) * (_nib16(blk + 2, l) - 8).to(tl.float32)


@triton.jit
def _mxfp4(blk, gi, l, lut):
    e = _u8(blk).to(tl.uint32)
    # ggml_e8m0_to_fp32_half: 2^(e-128), subnormal for e < 2
    bits = tl.where(e < 2, (e * 0 + 0x00200000) << e, (e - 1) << 23)
    return bits.to(tl.float32, bitcast=True) * tl.load(lut + _nib16(blk + 1, l))


@triton.jit
def _iq4_xs(blk, gi, l, lut):
    sl = (_u8(blk + 4 + gi // 2) >> (4 * (gi % 2))) & 15
    sh = ((_u8(blk + 2) | (_u8(blk + 3) << 8)) >> (2 * gi)) & 3
    dl = _f16(blk) * ((sl | (sh << 4)) - 32).to(tl.float32)  # [BN, G, 1]
    return dl * tl.load(lut + _nib16(blk + 8 + 16 * gi, l))


@triton.jit
def _k_scale_min(sc, sub):
    """Q4_K/Q5_K 6-bit scale and min of sub-block `sub` (0..7) from the 12 bytes at sc."""
    a = _u8(sc + sub)  # sub < 4: scale; sub >= 4: high bits of the min
    b = _u8(sc + sub + 4)  # sub < 4: min; sub >= 4: low nibbles of scale and min
    c = _u8(sc + tl.where(sub >= 4, sub - 4, sub))  # sub >= 4: high bits of the scale
    scale = tl.where(sub < 4, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(sub < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
    return scale.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q4_k(blk, gi, l):
    scale, mn = _k_scale_min(blk + 4, gi)  # [BN, G, 1]
    byte = _u8(blk + 16 + 32 * (gi // 2) + l)  # groups 2c and 2c+1 share 32 bytes: low, high nibbles
    q = tl.where((gi % 2) == 0, byte & 15, byte >> 4).to(tl.float32)
    return (_f16(blk) * scale) * q - (_f16(blk + 2) * mn)


@triton.jit
def _q5_k(blk, gi, l):
    scale, mn = _k_scale_min(blk + 4, gi)
    byte = _u8(blk + 48 + 32 * (gi // 2) + l)
    low = tl.where((gi % 2) == 0, byte & 15, byte >> 4)
    high = (_u8(blk + 16 + l) >> gi) & 1  # bit gi of qh[l]
    return (_f16(blk) * scale) * (low | (high << 4)).to(tl.float32) - (_f16(blk + 2) * mn)


@triton.jit
def _q6_k(blk, gi, l):
    h = gi // 4  # 128-element half
    s = gi % 4  # 32-element quarter of it
    low = (_u8(blk + 64 * h + 32 * (s % 2) + l) >> (4 * (s // 2))) & 15
    high = (_u8(blk + 128 + 32 * h + l) >> (2 * s)) & 3
    q = ((low | (high << 4)) - 32).to(tl.float32)
    sc0 = tl.load(blk + 192 + 2 * gi).to(tl.int8, bitcast=True).to(tl.float32)  # 16 elements per scale
    sc1 = tl.load(blk + 193 + 2 * gi).to(tl.int8, bitcast=True).to(tl.float32)
    return (_f16(blk + 208) * tl.where(l < 16, sc0, sc1)) * q


@triton.jit
def _f32(p):
    b0 = _u8(p).to(tl.uint32)
    b1 = _u8(p + 1).to(tl.uint32)
    b2 = _u8(p + 2).to(tl.uint32)
    b3 = _u8(p + 3).to(tl.uint32)
    return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _bf16(p):
    bits = (_u8(p) | (_u8(p + 1) << 8)).to(tl.uint32)
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _block(row, colg, QK: tl.constexpr, TS: tl.constexpr):
    """(pointer to the block of the group starting at column colg [1, G, 1], group index in it)."""
    return row + (colg // QK) * TS, (colg % QK) // 32


@triton.jit
def decode(mat, rows, k0, row_bytes, lut, QT: tl.constexpr, G: tl.constexpr):
    """float32 weights [BN, G, 32]: rows [BN, 1, 1] (int64) of the matrix at `mat`, columns
    k0 .. k0 + 32 G (element [r, g, l] is column k0 + 32 g + l)."""
    row = mat + rows * row_bytes  # [BN, 1, 1]
    l = tl.arange(0, 32)[None, None, :]  # [1, 1, 32]
    colg = k0 + 32 * tl.arange(0, G)[None, :, None]  # [1, G, 1]
    # one assignment per constexpr branch, one return: only the taken branch is compiled
    if QT == 0:  # F32
        w = _f32(row + (colg + l) * 4)
    elif QT == 1:  # F16
        w = _f16(row + (colg + l) * 2)
    elif QT == 30:  # BF16
        w = _bf16(row + (colg + l) * 2)
    elif QT == 8:  # Q8_0
        blk, gi = _block(row, colg, 32, 34)
        w = _q8_0(blk, gi, l)
    elif QT == 2:  # Q4_0
        blk, gi = _block(row, colg, 32, 18)
        w = _q4_0(blk, gi, l)
    elif QT == 39:  # MXFP4
        blk, gi = _block(row, colg, 32, 17)
        w = _mxfp4(blk, gi, l, lut)
    elif QT == 23:  # IQ4_XS
        blk, gi = _block(row, colg, 256, 136)
        w = _iq4_xs(blk, gi, l, lut)
    elif QT == 12:  # Q4_K
        blk, gi = _block(row, colg, 256, 144)
        w = _q4_k(blk, gi, l)
    elif QT == 13:  # Q5_K
        blk, gi = _block(row, colg, 256, 176)
        w = _q5_k(blk, gi, l)
    else:  # Q6_K (14): the host only launches types in KERNEL_TYPES
        blk, gi = _block(row, colg, 256, 210)
        w = _q6_k(blk, gi, l)
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
        return raw.reshape(-1)
    fields = {Q.Q6_K: (208,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2)}.get(q, (0,))
    for off in fields:
        d = (rng.uniform(0.5, 1.0, n_blocks) * (2e-3 if q in (Q.Q8_0, Q.Q4_0) else 2e-4)).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(-1)
