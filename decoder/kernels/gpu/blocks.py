"""GGUF block decoders for Triton, one jitted function per ggml type (`quant.decode` picks
one; the grid types `IQ1_*`, `IQ2_*`, `IQ3_*` are in `grids.py`).

Each decoder takes blk [BN, G, 1] (byte pointer to the block holding a 32-element group), gi
[1, G, 1] (the group's index inside its block) and l [1, 1, 32] (the element's index in the
group), and returns float32 [BN, G, 32]: scales are loaded once per group ([BN, G, 1]), codes
once per element. The arithmetic repeats gguf-py's numpy reference (`gguf.quants`) operation for
operation (the dequantize kernel is compiled without FMA contraction), so results are bit-exact.

Block layouts (bytes; `d`, `m`, `dmin` float16 little-endian; ggml-common.h's `block_*` structs):

    Q8_0   34: d | int8 q[32]
    Q4_0   18: d | qs[16]                 q = nibble - 8; low nibbles are elements 0-15, high 16-31
    Q4_1   20: d | m | qs[16]             d * nibble + m
    Q5_0   22: d | qh[4] | qs[16]         bit l of qh (u32) is element l's 5th bit; q - 16
    Q5_1   24: d | m | qh[4] | qs[16]     d * q + m
    IQ4_NL 18: d | qs[16]                 d * kvalues_iq4nl[nibble]
    MXFP4  17: e8m0 e | qs[16]            2^(e-128) * E2M1x2[nibble]
    NVFP4  36: ue4m3 d[4] | qs[32]        64 elements: 4 sub-blocks of 16, each 8 bytes (low, high nibbles)
    Q1_0   18: d | qs[16]                 128 elements: bit j%8 of qs[j/8] set -> +d, else -d
    TQ1_0  54: qs[48] | qh[4] | d         ternary, 5 (qs) or 4 (qh) base-3 digits per byte
    TQ2_0  66: qs[64] | d                 ternary, 2 bits each: q - 1
    Q2_K   84: scales[16] | qs[64] | d | dmin       16 sub-blocks of 16: 4-bit scale, 4-bit min
    Q3_K  110: hmask[32] | qs[64] | scales[12] | d  16 sub-blocks of 16, 6-bit signed scales
    Q4_K  144: d | dmin | scales[12] | qs[128]      8 sub-blocks of 32, 6-bit scale and min each
    Q5_K  176: d | dmin | scales[12] | qh[32] | qs[128]   bit i of qh[l] is element 32i+l's 5th
    Q6_K  210: ql[128] | qh[64] | int8 scales[16] | d     16 sub-blocks of 16
    IQ4_XS 136: d | u16 scales_h | scales_l[4] | qs[128]  sub-block scale ls - 32 (6 bits)
    F32 4, F16 2, BF16 2: one element
"""

from __future__ import annotations

import triton
import triton.language as tl


# -- byte helpers: blocks have no alignment, so every field is assembled from bytes ------------
@triton.jit
def _u8(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _u16(p):
    return _u8(p) | (_u8(p + 1) << 8)


@triton.jit
def _u32(p):
    """uint32 at byte pointer(s) p: unsigned, so that >> shifts in zeros."""
    return _u16(p).to(tl.uint32) | (_u16(p + 2).to(tl.uint32) << 16)


@triton.jit
def _f16(p):
    """float16 at byte pointer(s) p, widened to float32."""
    return _u16(p).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_bits(bits):
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nib16(qs, l):
    """Q4_0-order nibble of element l (0..31) of a 16-byte code array: low nibbles first."""
    byte = _u8(qs + (l % 16))
    return tl.where(l < 16, byte & 15, byte >> 4)


@triton.jit
def _by16(p, l):
    """Byte p[0] for elements l < 16, p[1] for the rest: two loads per group, not one per element."""
    return tl.where(l < 16, _u8(p), _u8(p + 1))


# -- 32-element blocks -------------------------------------------------------------------------
@triton.jit
def _q8_0(blk, gi, l):
    return _f16(blk) * tl.load(blk + 2 + l).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _q4_0(blk, gi, l):
    return _f16(blk) * (_nib16(blk + 2, l) - 8).to(tl.float32)


@triton.jit
def _q4_1(blk, gi, l):
    return (_f16(blk) * _nib16(blk + 4, l).to(tl.float32)) + _f16(blk + 2)


@triton.jit
def _q5_0(blk, gi, l):
    high = (_u32(blk + 2) >> l) & 1  # bit l of qh; loaded once per group
    q = _nib16(blk + 6, l) | (high.to(tl.int32) << 4)
    return _f16(blk) * (q - 16).to(tl.float32)


@triton.jit
def _q5_1(blk, gi, l):
    high = (_u32(blk + 4) >> l) & 1
    q = _nib16(blk + 8, l) | (high.to(tl.int32) << 4)
    return (_f16(blk) * q.to(tl.float32)) + _f16(blk + 2)


@triton.jit
def _iq4_nl(blk, gi, l, lut):
    return _f16(blk) * tl.load(lut + _nib16(blk + 2, l))


@triton.jit
def _mxfp4(blk, gi, l, lut):
    e = _u8(blk).to(tl.uint32)
    # ggml_e8m0_to_fp32_half: 2^(e-128), subnormal for e < 2
    bits = tl.where(e < 2, (e * 0 + 0x00200000) << e, (e - 1) << 23)
    return bits.to(tl.float32, bitcast=True) * tl.load(lut + _nib16(blk + 1, l))


@triton.jit
def _ue4m3_half(x):
    """ggml_ue4m3_to_fp32: half the unsigned E4M3 value of byte x (bit 7 ignored; 0 and 0x7F -> 0)."""
    e = (x >> 3) & 15
    m = x & 7
    normal = (((e + 119) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # (1 + m/8) 2^(e-7) / 2
    sub = m.to(tl.float32) * 0.0009765625  # m 2^-9 / 2
    return tl.where((x == 0) | (x == 0x7F), 0.0, tl.where(e == 0, sub, normal))


@triton.jit
def _nvfp4(blk, gi, l, lut):
    j = l % 16  # element of its 16-element sub-block 2 gi + l // 16
    byte = _u8(blk + 4 + 16 * gi + 8 * (l // 16) + j % 8)
    nib = tl.where(j < 8, byte & 15, byte >> 4)
    return _ue4m3_half(_by16(blk + 2 * gi, l)) * tl.load(lut + nib)


@triton.jit
def _q1_0(blk, gi, l):
    d = _f16(blk)  # [BN, G, 1]
    bits = _u32(blk + 2 + 4 * gi)  # [BN, G, 1]: the group's 32 bits, element l at bit l
    return tl.where(((bits >> l) & 1) != 0, d, -d)


# -- ternary -----------------------------------------------------------------------------------
@triton.jit
def _pow3(p):
    return tl.where(p == 0, 1, tl.where(p == 1, 3, tl.where(p == 2, 9, tl.where(p == 3, 27, 81))))


@triton.jit
def _tq1_0(blk, gi, l):
    # elements 0-159: digit gi of qs[l]; 160-239: digit e // 16 of qs[32 + e % 16] (e = element - 160);
    # 240-255: digit e // 4 of qh[e % 4] (e = element - 240). A digit is read as ((byte * 3^p) & 255) * 3 >> 8.
    e = 32 * (gi - 5) + l  # [1, G, 32], meaningful for gi >= 5
    tail = e >= 80
    off = tl.where(gi < 5, l, tl.where(tail, 48 + (e - 80) % 4, 32 + e % 16))
    p = tl.where(gi < 5, gi, tl.where(tail, (e - 80) // 4, e // 16))
    q = (((_u8(blk + off) * _pow3(p)) & 255) * 3) >> 8
    return _f16(blk + 52) * (q - 1).to(tl.float32)


@triton.jit
def _tq2_0(blk, gi, l):
    q = (_u8(blk + 32 * (gi // 4) + l) >> (2 * (gi % 4))) & 3
    return _f16(blk + 64) * (q - 1).to(tl.float32)


# -- K-quants: 256-element super-blocks --------------------------------------------------------
@triton.jit
def _q2_k(blk, gi, l):
    sc = _by16(blk + 2 * gi, l)  # [BN, G, 32]: one scale byte per 16 elements
    q = (_u8(blk + 16 + 32 * (gi // 4) + l) >> (2 * (gi % 4))) & 3
    dl = _f16(blk + 80) * (sc & 15).to(tl.float32)
    ml = _f16(blk + 82) * (sc >> 4).to(tl.float32)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _q3_k_scale(sc, m):
    """Q3_K's 6-bit scale m (0..15) from the 12 bytes at sc, minus 32."""
    low = (_u8(sc + m % 8) >> (4 * (m // 8))) & 15
    high = (_u8(sc + 8 + m % 4) >> (2 * (m // 4))) & 3
    return ((low | (high << 4)) - 32).to(tl.float32)


@triton.jit
def _q3_k(blk, gi, l):
    scale = tl.where(l < 16, _q3_k_scale(blk + 96, 2 * gi), _q3_k_scale(blk + 96, 2 * gi + 1))  # per group
    dl = _f16(blk + 108) * scale  # [BN, G, 32]
    low = (_u8(blk + 32 + 32 * (gi // 4) + l) >> (2 * (gi % 4))) & 3
    high = (_u8(blk + l) >> gi) & 1  # bit gi of hmask[l]; a clear bit subtracts 4
    return dl * (low - 4 * (1 - high)).to(tl.float32)


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
def _iq4_xs(blk, gi, l, lut):
    sl = (_u8(blk + 4 + gi // 2) >> (4 * (gi % 2))) & 15
    sh = (_u16(blk + 2) >> (2 * gi)) & 3
    dl = _f16(blk) * ((sl | (sh << 4)) - 32).to(tl.float32)  # [BN, G, 1]
    return dl * tl.load(lut + _nib16(blk + 8 + 16 * gi, l))


# -- one element each --------------------------------------------------------------------------
@triton.jit
def _f32(p):
    return (_u16(p).to(tl.uint32) | (_u16(p + 2).to(tl.uint32) << 16)).to(tl.float32, bitcast=True)


@triton.jit
def _bf16(p):
    return (_u16(p).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
