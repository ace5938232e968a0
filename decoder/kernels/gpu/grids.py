"""Triton block decoders of the grid quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S):
each code picks a row of 8 (IQ3: 4) values from a fixed grid, gguf-py's tables (`gguf.quants`),
which reach the kernel as a small int8 device tensor (`grid`: rows back to back, made by
`quant.grid_table`).
Conventions as in `blocks` (blk [BN, G, 1], gi [1, G, 1], l [1, 1, 32] -> [BN, G, 32]).

Block layouts (bytes, 256 elements; `d` float16; ggml-common.h's `block_iq*`):

    IQ2_XXS  66: d | 8 x (grid idx u8[4] | u32 signs 4x7 bits, scale 4 bits)
    IQ2_XS   74: d | u16 qs[32] (9-bit grid idx, 7-bit signs) | scales[8] (4 bits per 16 elements)
    IQ2_S    82: d | qs[32] | signs[32] | qh[8] (2 high idx bits each) | scales[8]
    IQ3_XXS  98: d | qs[64] (grid idx, 4 values each) | 8 x u32 (signs 4x7 bits, scale 4 bits)
    IQ3_S   110: d | qs[64] | qh[8] (1 high idx bit each) | signs[32] | scales[4] (4 bits per 32)
    IQ1_S    50: d | qs[32] | u16 qh[8] (3 high idx bits x 4, scale 3 bits, delta sign)
    IQ1_M    56: qs[32] | qh[16] (3 high idx bits + delta sign per 8) | scales[8] (3 bits per 16;
                 d's 16 bits are the top nibbles of the four u16 words)

A 7-bit sign index stands for ggml's `ksigns_iq2xs` byte: the 7 sign bits plus their parity as
the 8th (an even number of minus signs), computed here instead of looked up.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .blocks import _by16, _f16, _f16_bits, _u8, _u16, _u32

IQ1_DELTA: tl.constexpr = tl.constexpr(0.125)  # ggml IQ1S_DELTA, IQ1M_DELTA


@triton.jit
def _ksign(s7, b):
    """Bit b (0..7) of ksigns_iq2xs[s7], 1 meaning minus: for b < 7 sign bit b, for b = 7 the
    parity of all seven; both are the parity of s7 & mask, mask depending on the lane only."""
    x = s7 & tl.where(b == 7, 0x7F, 1 << b)
    x = x ^ (x >> 4)
    return (tl.full(x.shape, 0x6996, tl.int32) >> (x & 15)) & 1  # 0x6996: bit n is the parity of n


@triton.jit
def _signed(w, minus):
    return tl.where(minus != 0, -w, w)


@triton.jit
def _grid8(grid, idx, l):
    """Element l % 8 of 8-wide grid row idx, as float32."""
    return tl.load(grid + idx * 8 + l % 8).to(tl.float32)


@triton.jit
def _iq2_xxs(blk, gi, l, grid):
    grp = blk + 2 + 8 * gi  # [BN, G, 1]: 8 bytes per 32 elements
    aux = _u32(grp + 4)
    db = (_f16(blk) * (0.5 + (aux >> 28).to(tl.float32))) * 0.25  # [BN, G, 1]
    w = db * _grid8(grid, _u8(grp + l // 8), l)
    s7 = ((aux >> (7 * (l // 8))) & 127).to(tl.int32)
    return _signed(w, _ksign(s7, l % 8))


@triton.jit
def _iq2_xs(blk, gi, l, grid):
    v = _u16(blk + 2 + 2 * (4 * gi + l // 8))  # [BN, G, 32]: 9-bit grid index, 7-bit sign index
    sc = (_u8(blk + 66 + gi) >> (4 * (l // 16))) & 15
    db = (_f16(blk) * (0.5 + sc.to(tl.float32))) * 0.25
    w = db * _grid8(grid, v & 511, l)
    return _signed(w, _ksign(v >> 9, l % 8))


@triton.jit
def _iq2_s(blk, gi, l, grid):
    k = 4 * gi + l // 8  # [1, G, 32]: 8-element unit
    idx = _u8(blk + 2 + k) | (((_u8(blk + 66 + gi) >> (2 * (l // 8))) & 3) << 8)
    sc = (_u8(blk + 74 + gi) >> (4 * (l // 16))) & 15
    db = (_f16(blk) * (0.5 + sc.to(tl.float32))) * 0.25
    w = db * _grid8(grid, idx, l)
    return _signed(w, (_u8(blk + 34 + k) >> (l % 8)) & 1)


@triton.jit
def _iq3_xxs(blk, gi, l, grid):
    aux = _u32(blk + 66 + 4 * gi)  # [BN, G, 1]
    db = (_f16(blk) * (0.5 + (aux >> 28).to(tl.float32))) * 0.5
    idx = _u8(blk + 2 + 8 * gi + l // 4)  # 4 values per grid row
    w = db * tl.load(grid + idx * 4 + l % 4).to(tl.float32)
    s7 = ((aux >> (7 * (l // 8))) & 127).to(tl.int32)
    return _signed(w, _ksign(s7, l % 8))


@triton.jit
def _iq3_s(blk, gi, l, grid):
    idx = _u8(blk + 2 + 8 * gi + l // 4) | (((_u8(blk + 66 + gi) >> (l // 4)) & 1) << 8)
    sc = (_u8(blk + 106 + gi // 2) >> (4 * (gi % 2))) & 15  # [BN, G, 1]
    db = _f16(blk) * (1 + 2 * sc).to(tl.float32)
    w = db * tl.load(grid + idx * 4 + l % 4).to(tl.float32)
    return _signed(w, (_u8(blk + 74 + 4 * gi + l // 8) >> (l % 8)) & 1)


@triton.jit
def _iq1_s(blk, gi, l, grid):
    qh = _u16(blk + 34 + 2 * gi)  # [BN, G, 1]
    dl = _f16(blk) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
    delta = tl.where((qh & 0x8000) != 0, -IQ1_DELTA, IQ1_DELTA)
    idx = _u8(blk + 2 + 4 * gi + l // 8) | (((qh >> (3 * (l // 8))) & 7) << 8)
    return dl * (_grid8(grid, idx, l) + delta)


@triton.jit
def _iq1_m_d(sc):
    """IQ1_M's float16 scale: the top nibbles of the four u16 words at sc, first word lowest."""
    bits = (_u8(sc + 1) >> 4) | ((_u8(sc + 3) >> 4) << 4) | ((_u8(sc + 5) >> 4) << 8) | ((_u8(sc + 7) >> 4) << 12)
    return _f16_bits(bits)


@triton.jit
def _iq1_m(blk, gi, l, grid):
    half = l // 16
    s = (_u16(blk + 48 + 2 * (gi // 2)) >> (3 * (2 * (gi % 2) + half))) & 7  # [BN, G, 32]: 3 bits per 16
    dl = _iq1_m_d(blk + 48) * (2 * s + 1).to(tl.float32)
    v = _by16(blk + 32 + 2 * gi, l) >> (4 * ((l // 8) % 2))  # high index bits and delta sign per 8
    delta = tl.where((v & 8) != 0, -IQ1_DELTA, IQ1_DELTA)
    idx = _u8(blk + 4 * gi + l // 8) | ((v & 7) << 8)
    return dl * (_grid8(grid, idx, l) + delta)
