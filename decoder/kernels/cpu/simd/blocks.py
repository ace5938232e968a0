"""Block-layout unpackers for the int8 dot kernels (rows_int.py): LLVM vector IR that turns
one super-block's packed fields (grid indices, sign bits, 6-bit or 4-bit scales)
into the byte vectors and float scale vectors of simd/integer, 8 sub-blocks at a time.

Written as IR, not numba loops: each is a handful of vector shifts, masks and shuffles (plus
one scalar load per code-book entry, inserted into vectors), which numba's scalar code left as
per-byte work.
"""

from __future__ import annotations

import functools

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import integer  # (its feature checks through the module: one place for a test to mask a feature)
from .integer import _I8, _I16, _I32, _I64, _VB, _VF, _VI, _c, _call, _i64, _ints, _ld_vec, _ptr, _splat, gf_affine, vb, vf8, vi8
from .vectors import veci


# -- grid (IQ) super-blocks: indices, signs and scales of 8 sub-blocks at once ------------------------
def _gather(builder, table, idx, ety, per):
    """The code-book entries table[idx[k]] (ety each: 8 or 4 grid bytes) for the scalar i64
    indices idx, `per` to a byte vector (sub-block j = entries per j .. per j + per - 1). One
    scalar load each, inserted into the vector: on Zen 3, 10-15 % faster per IQ super-block than
    llvm.masked.gather (vpgatherqq / vpgatherdd), as llama.cpp's AVX2 dots do it too. The indices
    are scalar loads and shifts, not lanes extracted from a vector (on an Intel core: IQ3_XXS rows
    2.1x, IQ1_S 1.7x, IQ2_XXS 1.15x faster)."""
    base = builder.inttoptr(_i64(builder, table), ety.as_pointer())
    out = []
    for j in range(len(idx) // per):
        v = ir.Constant(ir.VectorType(ety, per), ir.Undefined)
        for k in range(per):
            v = builder.insert_element(v, builder.load(builder.gep(base, [idx[per * j + k]])), _c(_I32, k))
        out.append(builder.bitcast(v, _VB))
    return out


def _gather_grid(builder, table, idx):
    """The 32 uint64 entries table[idx[k]] (8 grid bytes each, 32 scalar indices), as 8 byte vectors."""
    return _gather(builder, table, idx, _I64, 4)


def _gather_grid4(builder, table, idx):
    """The 64 uint32 entries table[idx[k]] (4 grid bytes each, 64 scalar indices), as 8 byte vectors."""
    return _gather(builder, table, idx, _I32, 8)


def _gather_runs(builder, table, idx):
    """The code-book entries table[idx[k]] (uint64: 8 grid bytes) for the <32 x i32> indices idx,
    as four 64-byte runs (veci): one 8-entry hardware gather per run."""
    v8p, m8 = ir.VectorType(_I64.as_pointer(), 8), ir.VectorType(ir.IntType(1), 8)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
        ir.VectorType(_I64, 8), [v8p, _I32, m8, ir.VectorType(_I64, 8)]), "llvm.masked.gather.v8i64.v8p0i64")
    runs = []
    for r in range(4):
        part = builder.shuffle_vector(idx, idx, _c(ir.VectorType(_I32, 8), list(range(8 * r, 8 * r + 8))))
        at = builder.add(_splat(builder, _i64(builder, table), ir.VectorType(_I64, 8)),
                         builder.shl(builder.zext(part, ir.VectorType(_I64, 8)), _c(ir.VectorType(_I64, 8), [3] * 8)))
        ptrs = builder.inttoptr(at, v8p)
        got = builder.call(fn, [ptrs, _c(_I32, 8), ir.Constant(m8, [1] * 8), ir.Constant(ir.VectorType(_I64, 8), ir.Undefined)])
        runs.append(builder.bitcast(got, ir.VectorType(_I32, 16)))
    return runs


def _u(builder, p, off, k, ty=_I8):
    """The unsigned `ty` at p + off + k (bytes), as i64."""
    q = builder.bitcast(_ptr(builder, p, builder.add(_i64(builder, off), _c(_I64, k)), _I8), ty.as_pointer())
    return builder.zext(builder.load(q, align=1), _I64)


def _u32_fields(builder, p, off, starts, per, bits, mask):
    """Code-book indices as i64: the `per` fields of `bits` bits (masked) of the u32 at each of
    p + off + starts. Loaded one index at a time, LLVM merged adjacent loads into a vector and
    took each index out with vpextrb / vpextrw (2 uops each, 31 a super-block for IQ2_XXS and
    IQ2_XS); a u32 load and shifts are 1 uop per index (IQ2_XXS rows 1.2x faster on the Intel VM)."""
    out = []
    for k in starts:
        w = _u(builder, p, off, k, _I32)
        out += [builder.and_(builder.lshr(w, _c(_I64, bits * i)), _c(_I64, mask)) for i in range(per)]
    return out


def _indices4(builder, p, off, k, hi, bits):
    """Four code-book indices of 8 + `bits` bits as i64: the bytes at p + off + k .. k + 3, and
    above them the four `bits`-bit fields of the i64 `hi` (the lowest first). With a fast pdep
    two of them place the bytes and the fields in the four 16-bit lanes of one word, which shifts
    hand out; else a byte load, a shift, a mask and an or per index (one thread, 4096-wide rows:
    IQ1_S 12 %, IQ2_S 8 %, IQ3_S 33 % faster)."""
    mask = (1 << bits) - 1
    if integer.has_fast_pdep():
        pdep = "llvm.x86.bmi.pdep.64"
        lanes = _call(builder, pdep, _I64, [_u(builder, p, off, k, _I32), _c(_I64, 0x00FF00FF00FF00FF)])
        high = _call(builder, pdep, _I64, [hi, _c(_I64, sum(mask << (16 * l + 8) for l in range(4)))])
        w = builder.or_(lanes, high)
        return [builder.and_(builder.lshr(w, _c(_I64, 16 * l)), _c(_I64, 0xFFFF)) for l in range(4)]
    return [builder.or_(_u(builder, p, off, k + l),
                        builder.shl(builder.and_(builder.lshr(hi, _c(_I64, bits * l)), _c(_I64, mask)), _c(_I64, 8)))
            for l in range(4)]


def _ksigns(builder, f):
    """ksigns of 7-bit fields f (<n x i32>): the 7 bits and their parity as bit 7 (an even count
    of minus signs per 8 weights)."""
    ty = f.type
    ctpop = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty]), f"llvm.ctpop.v{ty.count}i32")
    par = builder.and_(builder.call(ctpop, [f]), _c(ty, [1] * ty.count))
    return builder.or_(f, builder.shl(par, _c(ty, [7] * ty.count)))


def _has_vbmi_gfni() -> bool:
    return {"avx512vbmi", "gfni", "avx512vl"} <= integer.cpu_features()


def _ksign_bytes(builder, x, picks):
    """ksigns of 7-bit fields of the byte vector x (32 or 64 bytes): vpmultishiftqb puts the field
    at bit offset picks[j] of byte j's qword in byte j, and gf_affine keeps its bits 0..6 and makes
    bit 7 their parity (the matrix row 0x7f). Needs _has_vbmi_gfni."""
    vty = ir.VectorType(_I8, x.type.count)
    fields = _call(builder, f"llvm.x86.avx512.pmultishift.qb.{8 * x.type.count}", vty, [_c(vty, picks), x])
    return gf_affine(builder, fields, [[1, 2, 4, 8, 16, 32, 64, 0x7F]], 0)


def _aux_signs(builder, aux):
    """The 32 sign bits of 8 sub-blocks (<8 x i32>) from IQ2_XXS / IQ3_XXS aux words (4 x 7 bits):
    with VBMI and GFNI two instructions (_ksign_bytes: byte l of dword j the field at bit 7 l),
    where shifts, masks and a popcount per field took 32 uops."""
    if _has_vbmi_gfni():
        picks = [7 * l + 32 * h for _ in range(4) for h in (0, 1) for l in range(4)]
        return builder.bitcast(_ksign_bytes(builder, builder.bitcast(aux, _VB), picks), _VI)
    signs = _c(_VI, [0] * 8)
    for l in range(4):
        f = builder.and_(builder.lshr(aux, _c(_VI, [7 * l] * 8)), _c(_VI, [127] * 8))
        signs = builder.or_(signs, builder.shl(_ksigns(builder, f), _c(_VI, [8 * l] * 8)))
    return signs


def _bytes_to_words(builder, b32):
    """<32 x i32> of bytes (byte l of sub-block j at 4j + l) -> <8 x i32> words, byte l at bits 8l."""
    out = _c(_VI, [0] * 8)
    for l in range(4):
        part = builder.shuffle_vector(b32, b32, _c(_VI, [4 * j + l for j in range(8)]))
        out = builder.or_(out, builder.shl(part, _c(_VI, [8 * l] * 8)))
    return out


def _ld_u8(builder, p, off, n):
    """n bytes at p + off, zero-extended to <n x i32>."""
    return builder.zext(_ld_vec(builder, p, off, ir.VectorType(_I8, n)), ir.VectorType(_I32, n))


def _at(builder, off, k):
    return builder.add(_i64(builder, off), _c(_I64, k))


def _per16(builder, lo, hi):
    """Per sub-block j, the int32 lanes [lo[j] x 4, hi[j] x 4] (dpbusd_k's per-16 multipliers)."""
    return [builder.shuffle_vector(lo, hi, _c(_VI, [j] * 4 + [8 + j] * 4)) for j in range(8)]


IQ2_LEVELS = (0x08, 0x19, 0x2B)  # the byte values of IQ2_XXS's (and IQ2_XS's, IQ2_S's) grid entries
IQ3_LEVELS = (4, 12, 20, 28, 36, 44, 52, 62)  # IQ3_XXS's
IQ3S_LEVELS = (1, 3, 5, 7, 9, 11, 13, 15)  # IQ3_S's


def word_grid(grid: np.ndarray, levels: tuple[int, ...]) -> np.ndarray:
    """A code book of 8- or 4-byte entries over `levels` ([n, width] bytes) as one uint16 per
    entry, byte b's level at bits 2 b (3 levels) or 3 b (8): the table _word_lookup looks up."""
    lv = np.array(levels, np.uint8)
    bits = 2 if len(levels) <= 4 else 3
    codes = np.minimum(np.searchsorted(lv, grid), len(lv) - 1)  # [n, width]
    assert (lv[codes] == grid).all() and bits * grid.shape[1] <= 16
    return (codes.astype(np.uint16) << (bits * np.arange(grid.shape[1], dtype=np.uint16))).sum(axis=1, dtype=np.uint16)


def _word_lookup(builder, words, idx, n):
    """words[idx] for 32 indices < n (<32 x i16>; n 256 or 512) from the n uint16 at address
    `words`: n / 64 vpermi2w of 64 entries each, chosen between by the index's bits 6, 7 (and 8).
    (LLVM keeps a 256-word table in 8 registers and copies one before each vpermt2w, ~40
    register moves a super-block, which cost less than keeping it in memory: 190 vs 225 us.)"""
    w32 = ir.VectorType(_I16, 32)
    t = [_ld_vec(builder, words, _c(_I64, 64 * k), w32) for k in range(n // 32)]
    parts = [_call(builder, "llvm.x86.avx512.vpermi2var.hi.512", w32, [t[2 * q], idx, t[2 * q + 1]])
             for q in range(n // 64)]
    b = 64
    while len(parts) > 1:
        bit = builder.icmp_unsigned("!=", builder.and_(idx, _c(w32, [b] * 32)), _c(w32, [0] * 32))
        parts = [builder.select(bit, parts[i + 1], parts[i]) for i in range(0, len(parts), 2)]
        b *= 2
    return parts[0]


def _grid_runs(builder, codes, levels):
    """Four 64-byte runs of grid bytes from level words (_word_lookup's). 8-byte entries
    (IQ2_LEVELS; codes: one <32 x i16>, entry 8 r + q in run r's qword q): per run one vpermw
    (each word into the four of its qword), one vpmultishiftqb (byte b: bits 2 b.. of its qword)
    and one vpermb (the level's byte value). 4-byte entries (IQ3_LEVELS; codes: two, entries 0-31
    and 32-63, entry 16 r + k in run r's dword k): the words of a qword's two entries at bits 0
    and 32, byte b of each bits 3 b.."""
    v64, m32 = ir.VectorType(_I8, 64), ir.VectorType(_I32, 32)
    period = 4 if len(levels) <= 4 else 8  # (vpermb reads 6 bits: the level's 2 or 3, repeated)
    table = _c(v64, (list(levels) + [0] * (period - len(levels))) * (64 // period))
    if len(levels) <= 4:
        picks = _c(v64, [2 * b for _ in range(8) for b in range(8)])
        words = [(codes[0], [8 * r + q for q in range(8) for _ in range(4)]) for r in range(4)]
    else:
        picks = _c(v64, [3 * b + 32 * h for _ in range(8) for h in (0, 1) for b in range(4)])
        words = [(codes[r // 2], [16 * (r % 2) + 2 * q + h for q in range(8) for h in (0, 0, 1, 1)]) for r in range(4)]
    out = []
    for vec, order in words:
        rep = builder.bitcast(builder.shuffle_vector(vec, vec, _c(m32, order)), v64)
        fields = _call(builder, "llvm.x86.avx512.pmultishift.qb.512", v64, [picks, rep])
        out.append(builder.bitcast(_call(builder, "llvm.x86.avx512.permvar.qi.512", v64, [table, fields]), _VI16))
    return out


_VI16 = ir.VectorType(_I32, 16)


_RUNS_TY = types.Tuple([types.UniTuple(veci, 4), vi8, vf8])
_RUNS_K_TY = types.Tuple([types.UniTuple(veci, 4), vi8, veci])


def _runs_of(builder, subs):
    """The 8 sub-blocks' 32-byte vectors (_gather's) as four 64-byte runs (veci each)."""
    m64 = ir.VectorType(_I32, 64)
    return [builder.bitcast(builder.shuffle_vector(subs[2 * r], subs[2 * r + 1], _c(m64, list(range(64)))), _VI16)
            for r in range(4)]


def _nib_scales16(builder, p, o, at):
    """2 s + 1 of the 16 nibbles of the 8 scale bytes at p + o + at (group 2 j the low nibble of
    byte j, 2 j + 1 the high), group g in lane g: IQ2_XS's and IQ2_S's per-16 multipliers."""
    sc = _ld_u8(builder, p, _at(builder, o, at), 8)
    nib = builder.shuffle_vector(sc, sc, _c(_VI16, [g // 2 for g in range(16)]))
    nib = builder.and_(builder.lshr(nib, _c(_VI16, [4 * (g % 2) for g in range(16)])), _c(_VI16, [15] * 16))
    return builder.or_(builder.shl(nib, _c(_VI16, [1] * 16)), _c(_VI16, [1] * 16))


def _qs_words(builder, p, o):
    """The 64 index bytes at p + o + 2 (IQ3_XXS's and IQ3_S's qs) as two <32 x i16>."""
    w16 = ir.VectorType(_I16, 32)
    return [builder.zext(_ld_vec(builder, p, builder.add(o, _c(_I64, 2 + 32 * h)), _VB), w16) for h in (0, 1)]


def has_word_grids() -> bool:
    """The IQ2 code books looked up as level words in registers (_word_lookup, _grid_runs):
    AVX-512 VBMI (vpermb, vpmultishiftqb) and BW (vpermi2w)."""
    return {"avx512vbmi", "avx512bw", "avx512vl"} <= integer.cpu_features()


@functools.cache
def has_fast_gather() -> bool:
    """AVX-512 gathers at their hardware speed: an AVX-512F CPU whose kernel does not report the
    Gather Data Sampling microcode mitigation (which slows every gather several times over). On the
    Intel VM an 8-qword vpgatherdq took 1.37 ns, eight scalar loads 1.93."""
    if "avx512f" not in integer.cpu_features():
        return False
    try:
        with open("/sys/devices/system/cpu/vulnerabilities/gather_data_sampling") as f:
            return not f.read().startswith("Mitigation")
    except OSError:
        return True


@intrinsic
def iq2xxs_runs(typingctx, p, off, table, words):
    """An IQ2_XXS super-block at p + off as four 64-byte runs (run r: sub-blocks 2 r, 2 r + 1):
    (the runs' grid bytes, 4 x 64 bytes as veci; the 8 sub-blocks' 32 sign bits, lane j bit k the
    sign of sub-block j's weight k (_aux_signs); their 2 s + 1 as floats). With VBMI the 32
    entries come from the code book as level words (`words`: word_grid of it): one byte shuffle
    for the indices, _word_lookup and _grid_runs, where 32 scalar loads from `table` inserted
    one by one filled port 5 (one thread, 4096-wide rows: 1.3x); else those loads."""
    if not _ints(p, off, table, words):
        return None

    def codegen(context, builder, sig, args):
        o = _i64(builder, args[1])
        v64, m64 = ir.VectorType(_I8, 64), ir.VectorType(_I32, 64)
        dwords = _ld_vec(builder, args[0], builder.add(o, _c(_I64, 2)), _VI16)  # sub-block j: dwords 2 j, 2 j + 1
        aux = builder.shuffle_vector(dwords, dwords, _c(_VI, list(range(1, 16, 2))))
        if has_word_grids():  # index word 4 j + l: byte l of dword 2 j, zero-extended
            idx = builder.shuffle_vector(builder.bitcast(dwords, v64), _c(v64, [0] * 64),
                                         _c(m64, [x for w in range(32) for x in (8 * (w // 4) + w % 4, 64)]))
            words = _word_lookup(builder, args[3], builder.bitcast(idx, ir.VectorType(_I16, 32)), 256)
            U = _grid_runs(builder, [words], IQ2_LEVELS)
        else:
            U = _runs_of(builder, _gather_grid(builder, args[2], _u32_fields(builder, args[0], args[1],
                                                                             range(2, 66, 8), 4, 8, 255)))
        signs = _aux_signs(builder, aux)
        k = builder.or_(builder.shl(builder.lshr(aux, _c(_VI, [28] * 8)), _c(_VI, [1] * 8)), _c(_VI, [1] * 8))
        runs = context.make_tuple(builder, sig.return_type[0], U)
        return context.make_tuple(builder, sig.return_type, [runs, signs, builder.sitofp(k, _VF)])

    return _RUNS_TY(p, off, table, words), codegen


def _iq1s_scales(builder, qh):
    """IQ1_S's qh words (<8 x i32>) -> (2 s + 1, 8 (1 - delta) (2 s + 1)) per sub-block as floats
    (s: bits 12-14, delta = -1/8 where bit 15 is set)."""
    k = builder.or_(builder.shl(builder.and_(builder.lshr(qh, _c(_VI, [12] * 8)), _c(_VI, [7] * 8)),
                                _c(_VI, [1] * 8)), _c(_VI, [1] * 8))
    neg = builder.icmp_unsigned("!=", builder.and_(qh, _c(_VI, [0x8000] * 8)), _c(_VI, [0] * 8))
    m = builder.mul(k, builder.select(neg, _c(_VI, [9] * 8), _c(_VI, [7] * 8)))
    return builder.sitofp(k, _VF), builder.sitofp(m, _VF)


@intrinsic
def iq1s_prep(typingctx, p, off, table):
    """An IQ1_S super-block at p + off (f16 d, qs[32], u16 qh[8]): (U: the 8 sub-blocks' grid
    bytes from the code book `table` (index qs[4j + l] | bits 3l.. of qh[j] << 8), 2 s + 1 as
    floats, 8 (1 - delta) (2 s + 1) as floats (delta = -1/8 where qh's top bit is set))."""
    if not _ints(p, off, table):
        return None

    def codegen(context, builder, sig, args):
        o = _i64(builder, args[1])
        qh = builder.zext(_ld_vec(builder, args[0], builder.add(o, _c(_I64, 34)), ir.VectorType(_I16, 8)), _VI)
        U = _gather_grid(builder, args[2], [i for j in range(8) for i in _indices4(
            builder, args[0], o, 2 + 4 * j, _u(builder, args[0], o, 34 + 2 * j, _I16), 3)])
        tup = context.make_tuple(builder, sig.return_type[0], U)
        return context.make_tuple(builder, sig.return_type, [tup, *_iq1s_scales(builder, qh)])

    return types.Tuple([types.UniTuple(vb, 8), vf8, vf8])(p, off, table), codegen


@intrinsic
def iq1s_runs(typingctx, p, off, table):
    """iq1s_prep's super-block as four 64-byte runs (run r: sub-blocks 2 r, 2 r + 1) of grid bytes
    from the code book `table`, with the same k and m. The 32 indices are vector lanes (qs's
    bytes, above them their 3 bits of qh) looked up by four 8-entry gathers (has_fast_gather),
    where iq1s_prep makes them as scalars (pdep, shifts) and inserts 32 loads into vectors one by
    one. Intel VM, 2 threads, an expert of 4096 x 1536 a call: 0.50 -> 0.44 ms."""
    if not _ints(p, off, table):
        return None

    def codegen(context, builder, sig, args):
        o = _i64(builder, args[1])
        v32 = ir.VectorType(_I32, 32)
        qh = builder.zext(_ld_vec(builder, args[0], builder.add(o, _c(_I64, 34)), ir.VectorType(_I16, 8)), _VI)
        lo = builder.zext(_ld_vec(builder, args[0], builder.add(o, _c(_I64, 2)), _VB), v32)  # [32] qs
        hi = builder.shuffle_vector(qh, qh, _c(v32, [e // 4 for e in range(32)]))  # lane 4 j + l: qh[j]
        hi = builder.and_(builder.lshr(builder.shl(hi, _c(v32, [8] * 32)), _c(v32, [3 * (e % 4) for e in range(32)])),
                          _c(v32, [0x700] * 32))
        U = _gather_runs(builder, args[2], builder.or_(lo, hi))
        runs = context.make_tuple(builder, sig.return_type[0], U)
        return context.make_tuple(builder, sig.return_type, [runs, *_iq1s_scales(builder, qh)])

    return types.Tuple([types.UniTuple(veci, 4), vf8, vf8])(p, off, table), codegen


@intrinsic
def q6_scales(typingctx, p, off):
    """Q6_K's 16 int8 scales at p + off as two float vectors in hsum4x8_halves' lane order:
    ([s0, s2, s4, s6, s1, s3, s5, s7], [s8, s10, .., s15])."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        v = _ld_vec(builder, args[0], args[1], ir.VectorType(_I8, 16))
        a = builder.shuffle_vector(v, v, _c(_VI, [0, 2, 4, 6, 1, 3, 5, 7]))
        b = builder.shuffle_vector(v, v, _c(_VI, [8, 10, 12, 14, 9, 11, 13, 15]))
        return context.make_tuple(builder, sig.return_type, [builder.sitofp(a, _VF), builder.sitofp(b, _VF)])

    return types.UniTuple(vf8, 2)(p, off), codegen


@intrinsic
def iq2xs_runs(typingctx, p, off, table, words):
    """An IQ2_XS super-block at p + off (f16 d, u16 qs[32]: 9-bit grid index, 7-bit ksigns index;
    scales[8]: a nibble per 16 weights) as four 64-byte runs: (their grid bytes, as iq2xxs_runs';
    the 8 sub-blocks' 32 sign bits each; the per-16 multipliers 2 s + 1, group g in lane g). With
    VBMI the 32 entries from the code book as level words (word_grid, one 512-entry _word_lookup),
    else 32 scalar loads."""
    if not _ints(p, off, table, words):
        return None

    def codegen(context, builder, sig, args):
        o = _i64(builder, args[1])
        if has_word_grids():
            w16 = ir.VectorType(_I16, 32)
            idx = builder.and_(_ld_vec(builder, args[0], builder.add(o, _c(_I64, 2)), w16), _c(w16, [511] * 32))
            U = _grid_runs(builder, [_word_lookup(builder, args[3], idx, 512)], IQ2_LEVELS)
        else:
            U = _runs_of(builder, _gather_grid(builder, args[2], _u32_fields(builder, args[0], args[1],
                                                                             range(2, 66, 4), 2, 16, 511)))
        if _has_vbmi_gfni():  # qword j holds sub-block j's 4 u16: their top 7 bits to bytes 0..3
            raw = _ld_vec(builder, args[0], _at(builder, args[1], 2), ir.VectorType(_I8, 64))
            b = _ksign_bytes(builder, raw, [9, 25, 41, 57, 0, 0, 0, 0] * 8)
            firsts = _c(ir.VectorType(_I32, 32), [8 * j + l for j in range(8) for l in range(4)])
            signs = builder.bitcast(builder.shuffle_vector(b, b, firsts), _VI)
        else:
            v32 = ir.VectorType(_I32, 32)
            qs = builder.zext(_ld_vec(builder, args[0], _at(builder, args[1], 2), ir.VectorType(_I16, 32)), v32)
            signs = _bytes_to_words(builder, _ksigns(builder, builder.lshr(qs, _c(v32, [9] * 32))))
        runs = context.make_tuple(builder, sig.return_type[0], U)
        return context.make_tuple(builder, sig.return_type, [runs, signs, _nib_scales16(builder, args[0], o, 66)])

    return _RUNS_K_TY(p, off, table, words), codegen


@intrinsic
def iq2s_runs(typingctx, p, off, table):
    """An IQ2_S super-block at p + off (f16 d, qs[32], signs[32], qh[8], scales[8]; group l of
    sub-block j: index qs[4j + l] | bits 2l.. of qh[j] << 8, signs[4j + l]) as iq2xs_runs' (runs,
    signs, per-16 multipliers). Its 1024-entry code book is 32 registers of level words, more
    than the kernel has: the entries are scalar loads (_gather_grid)."""
    if not _ints(p, off, table):
        return None

    def codegen(context, builder, sig, args):
        o = _i64(builder, args[1])
        U = _runs_of(builder, _gather_grid(builder, args[2], [i for j in range(8) for i in _indices4(
            builder, args[0], args[1], 2 + 4 * j, _u(builder, args[0], args[1], 66 + j), 2)]))
        signs = _ld_vec(builder, args[0], _at(builder, args[1], 34), _VI)
        runs = context.make_tuple(builder, sig.return_type[0], U)
        return context.make_tuple(builder, sig.return_type, [runs, signs, _nib_scales16(builder, args[0], o, 74)])

    return _RUNS_K_TY(p, off, table), codegen


@intrinsic
def iq3xxs_runs(typingctx, p, off, table, words):
    """An IQ3_XXS super-block at p + off (f16 d, qs[64] of 4-byte grid indices, u32 aux[8] as
    IQ2_XXS's) as iq2xxs_runs' (runs, signs, 2 s + 1): with VBMI the 64 entries from the code
    book as level words (word_grid with IQ3_LEVELS, two _word_lookup), else 64 scalar loads."""
    if not _ints(p, off, table, words):
        return None

    def codegen(context, builder, sig, args):
        o = _i64(builder, args[1])
        if has_word_grids():
            U = _grid_runs(builder, [_word_lookup(builder, args[3], i, 256) for i in _qs_words(builder, args[0], o)],
                           IQ3_LEVELS)
        else:
            U = _runs_of(builder, _gather_grid4(builder, args[2], [_u(builder, args[0], args[1], 2 + k)
                                                                   for k in range(64)]))
        aux = _ld_vec(builder, args[0], _at(builder, args[1], 66), _VI)
        one = _c(_VI, [1] * 8)
        k = builder.or_(builder.shl(builder.lshr(aux, _c(_VI, [28] * 8)), one), one)
        runs = context.make_tuple(builder, sig.return_type[0], U)
        return context.make_tuple(builder, sig.return_type, [runs, _aux_signs(builder, aux), builder.sitofp(k, _VF)])

    return _RUNS_TY(p, off, table, words), codegen


@intrinsic
def iq3s_runs(typingctx, p, off, table, words):
    """An IQ3_S super-block at p + off (f16 d, qs[64], qh[8], signs[32], scales[4]; entry k of
    sub-block j: index qs[8j + k] | bit k of qh[j] << 8; scale: nibble j % 2 of scales[j // 2])
    as iq2xxs_runs' (runs, signs, 2 s + 1): with VBMI the 64 entries from the code book as level
    words (word_grid with IQ3S_LEVELS, two 512-entry _word_lookup), else 64 scalar loads."""
    if not _ints(p, off, table, words):
        return None

    def codegen(context, builder, sig, args):
        o = _i64(builder, args[1])
        if has_word_grids():
            w16, b32 = ir.VectorType(_I16, 32), ir.VectorType(ir.IntType(1), 32)
            qh = [builder.bitcast(_ld_vec(builder, args[0], builder.add(o, _c(_I64, 66 + 4 * h)), _I32), b32)
                  for h in (0, 1)]
            idx = _qs_words(builder, args[0], o)
            idx = [builder.select(qh[h], builder.or_(idx[h], _c(w16, [256] * 32)), idx[h]) for h in (0, 1)]
            U = _grid_runs(builder, [_word_lookup(builder, args[3], i, 512) for i in idx], IQ3S_LEVELS)
        else:
            U = _runs_of(builder, _gather_grid4(builder, args[2], [
                i for j in range(8) for h in (0, 1) for i in _indices4(
                    builder, args[0], args[1], 2 + 8 * j + 4 * h,
                    builder.lshr(_u(builder, args[0], args[1], 66 + j), _c(_I64, 4 * h)), 1)]))
        signs = _ld_vec(builder, args[0], _at(builder, args[1], 74), _VI)
        sc = _ld_u8(builder, args[0], _at(builder, args[1], 106), 4)
        s8 = builder.shuffle_vector(sc, sc, _c(_VI, [j // 2 for j in range(8)]))
        s8 = builder.and_(builder.lshr(s8, _c(_VI, [4 * (j % 2) for j in range(8)])), _c(_VI, [15] * 8))
        one = _c(_VI, [1] * 8)
        k = builder.or_(builder.shl(s8, one), one)
        runs = context.make_tuple(builder, sig.return_type[0], U)
        return context.make_tuple(builder, sig.return_type, [runs, signs, builder.sitofp(k, _VF)])

    return _RUNS_TY(p, off, table, words), codegen


@intrinsic
def iq1m_prep(typingctx, p, off, table):
    """An IQ1_M super-block at p + off (qs[32], qh[16]: a nibble per group of 8 (3 index bits,
    the delta's sign), u16 sc[4]: 3-bit scales per 16 weights and d's four nibbles on top):
    (W: the 8 sub-blocks' signed codes 8 (grid + delta) from `table` (GRID64_IQ1: the +delta
    entries, then the -delta ones), the per-16 multipliers 2 s + 1 as dpbusd_k lanes, d)."""
    if not _ints(p, off, table):
        return None

    def codegen(context, builder, sig, args):
        W = _gather_grid(builder, args[2], [i for j in range(8) for i in _indices4(  # bit 11: -delta
            builder, args[0], args[1], 4 * j, _u(builder, args[0], args[1], 32 + 2 * j, _I16), 4)])
        sc = builder.zext(_ld_vec(builder, args[0], _at(builder, args[1], 48), ir.VectorType(_I16, 4)),
                          ir.VectorType(_I32, 4))
        s8 = builder.shuffle_vector(sc, sc, _c(_VI, [j // 2 for j in range(8)]))
        s8 = builder.lshr(s8, _c(_VI, [6 * (j % 2) for j in range(8)]))
        one, seven = _c(_VI, [1] * 8), _c(_VI, [7] * 8)
        lo = builder.or_(builder.shl(builder.and_(s8, seven), one), one)
        hi = builder.or_(builder.shl(builder.and_(builder.lshr(s8, _c(_VI, [3] * 8)), seven), one), one)
        top = builder.lshr(sc, _c(ir.VectorType(_I32, 4), [12] * 4))  # d's nibble i in sc[i]
        bits = _c(_I32, 0)
        for i in range(4):
            bits = builder.or_(bits, builder.shl(builder.extract_element(top, _c(_I32, i)), _c(_I32, 4 * i)))
        d = builder.fpext(builder.bitcast(builder.trunc(bits, _I16), ir.HalfType()), ir.FloatType())
        ty = sig.return_type
        return context.make_tuple(builder, ty, [context.make_tuple(builder, ty[0], W),
                                                context.make_tuple(builder, ty[1], _per16(builder, lo, hi)), d])

    return types.Tuple([types.UniTuple(vb, 8), types.UniTuple(vi8, 8), types.float32])(p, off, table), codegen


@intrinsic
def iq4xs_scales(typingctx, p, off):
    """IQ4_XS's scales at p + off (u16 scales_h: 2 bits per sub-block, scales_l[4]: a nibble per
    sub-block), less 32, as 8 floats."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        h = builder.zext(_ld_vec(builder, args[0], args[1], _I16), _I32)
        lo = _ld_u8(builder, args[0], _at(builder, args[1], 2), 4)
        lo = builder.shuffle_vector(lo, lo, _c(_VI, [j // 2 for j in range(8)]))
        lo = builder.and_(builder.lshr(lo, _c(_VI, [4 * (j % 2) for j in range(8)])), _c(_VI, [15] * 8))
        hi = builder.lshr(_splat(builder, h, _VI), _c(_VI, [2 * j for j in range(8)]))
        hi = builder.shl(builder.and_(hi, _c(_VI, [3] * 8)), _c(_VI, [4] * 8))
        return builder.sitofp(builder.sub(builder.or_(lo, hi), _c(_VI, [32] * 8)), _VF)

    return vf8(p, off), codegen


@intrinsic
def e8m0_halves(typingctx, p, off, stride):
    """The 8 E8M0 exponent bytes at p + off + j * stride as 2^(e - 128) in float32 (ggml's
    ggml_e8m0_to_fp32_half: e < 2 gives the subnormals 2^-128 and 2^-127)."""
    if not _ints(p, off, stride):
        return None

    def codegen(context, builder, sig, args):
        v = ir.Constant(_VI, [0] * 8)
        for j in range(8):
            o = builder.add(_i64(builder, args[1]), builder.mul(_i64(builder, args[2]), _c(_I64, j)))
            v = builder.insert_element(v, builder.zext(_ld_vec(builder, args[0], o, _I8), _I32), _c(_I32, j))
        sub = builder.shl(_c(_VI, [0x00200000] * 8), v)
        norm = builder.shl(builder.sub(v, _c(_VI, [1] * 8)), _c(_VI, [23] * 8))
        bits = builder.select(builder.icmp_unsigned("<", v, _c(_VI, [2] * 8)), sub, norm)
        return builder.bitcast(bits, _VF)

    return vf8(p, off, stride), codegen


def _ue4m3_half(builder, x):
    """Unsigned E4M3 scale bytes (<8 x i32>, bias 7) halved, as float32 (gguf-py's
    NVFP4.ue4m3_to_fp32): 0 and 0x7F give 0, the top bit is ignored."""
    ex = builder.and_(builder.lshr(x, _c(_VI, [3] * 8)), _c(_VI, [15] * 8))
    man = builder.and_(x, _c(_VI, [7] * 8))
    norm = builder.bitcast(builder.or_(builder.shl(builder.add(ex, _c(_VI, [119] * 8)), _c(_VI, [23] * 8)),
                                       builder.shl(man, _c(_VI, [20] * 8))), _VF)
    sub = builder.fmul(builder.sitofp(man, _VF), _c(_VF, [2.0 ** -10] * 8))  # man x 2^-9, halved: exact
    v = builder.select(builder.icmp_unsigned("==", ex, _c(_VI, [0] * 8)), sub, norm)
    zero = builder.or_(builder.icmp_unsigned("==", x, _c(_VI, [0] * 8)), builder.icmp_unsigned("==", x, _c(_VI, [0x7F] * 8)))
    return builder.select(zero, _c(_VF, [0.0] * 8), v)


@intrinsic
def nvfp4_scales(typingctx, p, off):
    """The 16 UE4M3 scales (4 per 64-weight block of 36 bytes at p + off) of 256 weights, halved,
    as two float vectors in hsum4x8_halves' lane order: sub-block j's first 16 weights have scale
    2 (j % 2) of block j // 2, its last 16 the next one: ([j = 0..3 first, j = 0..3 last],
    [j = 4..7 first, j = 4..7 last])."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I32, 16)
        v = ir.Constant(v16, ir.Undefined)
        for b in range(4):
            w = _ld_u8(builder, args[0], _at(builder, args[1], 36 * b), 4)
            for i in range(4):
                v = builder.insert_element(v, builder.extract_element(w, _c(_I32, i)), _c(_I32, 4 * b + i))
        order = [[4 * (j // 2) + 2 * (j % 2) for j in range(h, h + 4)] + [4 * (j // 2) + 2 * (j % 2) + 1 for j in range(h, h + 4)]
                 for h in (0, 4)]
        out = [_ue4m3_half(builder, builder.shuffle_vector(v, v, _c(_VI, o))) for o in order]
        return context.make_tuple(builder, sig.return_type, out)

    return types.UniTuple(vf8, 2)(p, off), codegen


@intrinsic
def nib8x2(typingctx, p, off):
    """The 16 bytes at p + off as 32 nibbles in NVFP4's order: the low then the high nibbles of
    bytes 0-7, then those of bytes 8-15."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        h = ir.VectorType(_I8, 16)
        c = _ld_vec(builder, args[0], args[1], h)
        lo, hi = builder.and_(c, _c(h, [15] * 16)), builder.lshr(c, _c(h, [4] * 16))
        order = list(range(8)) + list(range(16, 24)) + list(range(8, 16)) + list(range(24, 32))
        return builder.shuffle_vector(lo, hi, _c(ir.VectorType(_I32, 32), order))

    return vb(p, off), codegen
