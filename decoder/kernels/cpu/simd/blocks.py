"""Block-layout unpackers for the int8 dot kernels (rows_int.py): LLVM vector IR that turns
one super-block's packed fields (grid indices, sign bits, 6-bit or 4-bit scales, base-3 digits)
into the byte vectors and float scale vectors of simd/integer, 8 sub-blocks at a time.

Written as IR, not numba loops: each is a handful of vector shifts, masks and shuffles (plus
`llvm.masked.gather` for the code books), which numba's scalar code left as per-byte work.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .integer import _I8, _I16, _I32, _I64, _VB, _VF, _VI, _c, _i64, _ints, _ld_vec, _splat, vb, vf8, vi8


# -- grid (IQ) super-blocks: indices, signs and scales of 8 sub-blocks at once ------------------------
def _gather_grid(builder, table, idx32):
    """The 32 uint64 code-book entries table[idx32[k]] (idx32 <32 x i32>), as 8 byte vectors
    (sub-block j = entries 4j .. 4j + 3): llvm.masked.gather, 8 entries at a time."""
    i64p = _I64.as_pointer()
    v8p = ir.VectorType(i64p, 8)
    base = _splat(builder, _i64(builder, table), ir.VectorType(_I64, 8))
    v8 = ir.VectorType(_I64, 8)
    fn_ty = ir.FunctionType(v8, [v8p, _I32, ir.VectorType(ir.IntType(1), 8), v8])
    fn = cgutils.get_or_insert_function(builder.module, fn_ty, "llvm.masked.gather.v8i64.v8p0i64")
    out = []
    for h in range(4):
        part = builder.shuffle_vector(idx32, idx32, ir.Constant(_VI, list(range(8 * h, 8 * h + 8))))
        offs = builder.shl(builder.zext(part, ir.VectorType(_I64, 8)), _c(ir.VectorType(_I64, 8), [3] * 8))
        ptrs = builder.inttoptr(builder.add(base, offs), v8p)
        g = builder.call(fn, [ptrs, ir.Constant(_I32, 8), ir.Constant(ir.VectorType(ir.IntType(1), 8), [1] * 8),
                              ir.Constant(v8, ir.Undefined)])
        for k in range(2):
            q = builder.shuffle_vector(g, g, ir.Constant(ir.VectorType(_I32, 4), list(range(4 * k, 4 * k + 4))))
            out.append(builder.bitcast(q, _VB))
    return out


_PREP_TY = types.Tuple([types.UniTuple(vb, 8), vi8, vf8])


@intrinsic
def iq2xxs_prep(typingctx, p, off, table):
    """An IQ2_XXS super-block at p + off (f16 d, then per sub-block 4 index bytes and a u32 aux):
    (U: its 8 sub-blocks' grid bytes, the 8 sub-blocks' 32 sign bits (ksigns: 7 bits each group,
    the 8th their parity), the 8 scales 2 s + 1 as floats)."""
    if not _ints(p, off, table):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I32, 16)
        words = _ld_vec(builder, args[0], builder.add(_i64(builder, args[1]), _c(_I64, 2)), v16)
        idx = builder.shuffle_vector(words, words, _c(_VI, list(range(0, 16, 2))))  # 4 index bytes each
        aux = builder.shuffle_vector(words, words, _c(_VI, list(range(1, 16, 2))))
        idx32 = builder.zext(builder.bitcast(idx, _VB), ir.VectorType(_I32, 32))
        U = _gather_grid(builder, args[2], idx32)
        ctpop = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI, [_VI]), "llvm.ctpop.v8i32")
        signs = _c(_VI, [0] * 8)
        for l in range(4):
            f = builder.and_(builder.lshr(aux, _c(_VI, [7 * l] * 8)), _c(_VI, [127] * 8))
            par = builder.and_(builder.call(ctpop, [f]), _c(_VI, [1] * 8))
            byte = builder.or_(f, builder.shl(par, _c(_VI, [7] * 8)))
            signs = builder.or_(signs, builder.shl(byte, _c(_VI, [8 * l] * 8)))
        k = builder.or_(builder.shl(builder.lshr(aux, _c(_VI, [28] * 8)), _c(_VI, [1] * 8)), _c(_VI, [1] * 8))
        tup = context.make_tuple(builder, sig.return_type[0], U)
        return context.make_tuple(builder, sig.return_type, [tup, signs, builder.sitofp(k, _VF)])

    return _PREP_TY(p, off, table), codegen


@intrinsic
def iq1s_prep(typingctx, p, off, table):
    """An IQ1_S super-block at p + off (f16 d, qs[32], u16 qh[8]): (U: the 8 sub-blocks' grid
    bytes from the code book `table` (index qs[4j + l] | bits 3l.. of qh[j] << 8), 2 s + 1 as
    floats, 8 (1 - delta) (2 s + 1) as floats (delta = -1/8 where qh's top bit is set))."""
    if not _ints(p, off, table):
        return None

    def codegen(context, builder, sig, args):
        o = _i64(builder, args[1])
        qs = _ld_vec(builder, args[0], builder.add(o, _c(_I64, 2)), _VB)
        qh = builder.zext(_ld_vec(builder, args[0], builder.add(o, _c(_I64, 34)), ir.VectorType(_I16, 8)), _VI)
        v32 = ir.VectorType(_I32, 32)
        rep = builder.shuffle_vector(qh, qh, _c(v32, [j // 4 for j in range(32)]))
        hi = builder.and_(builder.lshr(rep, _c(v32, [3 * (j % 4) for j in range(32)])), _c(v32, [7] * 32))
        idx32 = builder.or_(builder.zext(qs, v32), builder.shl(hi, _c(v32, [8] * 32)))
        U = _gather_grid(builder, args[2], idx32)
        k = builder.or_(builder.shl(builder.and_(builder.lshr(qh, _c(_VI, [12] * 8)), _c(_VI, [7] * 8)),
                                    _c(_VI, [1] * 8)), _c(_VI, [1] * 8))
        neg = builder.icmp_unsigned("!=", builder.and_(qh, _c(_VI, [0x8000] * 8)), _c(_VI, [0] * 8))
        m = builder.mul(k, builder.select(neg, _c(_VI, [9] * 8), _c(_VI, [7] * 8)))
        tup = context.make_tuple(builder, sig.return_type[0], U)
        return context.make_tuple(builder, sig.return_type, [tup, builder.sitofp(k, _VF), builder.sitofp(m, _VF)])

    return types.Tuple([types.UniTuple(vb, 8), vf8, vf8])(p, off, table), codegen


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
def q2k_scales(typingctx, p, off):
    """Q2_K's 16 scale bytes at p + off (low nibble: scale, high: min, one per 16 weights) as the
    8 sub-blocks' per-byte scales and mins: (S, M), S[j] = 16 x scale 2j then 16 x scale 2j + 1."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        v16 = ir.VectorType(_I8, 16)
        v = _ld_vec(builder, args[0], args[1], v16)
        lo, hi = builder.and_(v, _c(v16, [15] * 16)), builder.lshr(v, _c(v16, [4] * 16))
        v32 = ir.VectorType(_I32, 32)
        pick = [[2 * j] * 16 + [2 * j + 1] * 16 for j in range(8)]
        S = [builder.shuffle_vector(lo, lo, _c(v32, m)) for m in pick]
        M = [builder.shuffle_vector(hi, hi, _c(v32, m)) for m in pick]
        ty = sig.return_type[0]
        return context.make_tuple(builder, sig.return_type, [context.make_tuple(builder, ty, S),
                                                             context.make_tuple(builder, ty, M)])

    return types.UniTuple(types.UniTuple(vb, 8), 2)(p, off), codegen


@intrinsic
def tq1_codes(typingctx, p, off):
    """A TQ1_0 super-block at p + off (qs[48], qh[4] of base-3 digits, 5 (4) per byte, the digit n
    of byte b being the top of (b 3^n mod 256) x 3 / 256): its 256 codes (0..2) as 8 sub-blocks.
    Elements 32n + m: digit n of qs[m] (n < 5); 160 + 16n + m: digit n of qs[32 + m]; 240 + 4n + m:
    digit n of qh[m]."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        o = _i64(builder, args[1])
        v16, v32 = ir.VectorType(_I8, 16), ir.VectorType(_I32, 32)
        a = _ld_vec(builder, args[0], o, _VB)
        b = _ld_vec(builder, args[0], builder.add(o, _c(_I64, 32)), v16)
        h = _ld_vec(builder, args[0], builder.add(o, _c(_I64, 48)), ir.VectorType(_I8, 4))
        bb = builder.shuffle_vector(b, b, _c(v32, list(range(16)) * 2))  # qs[32:48] twice
        hb = builder.shuffle_vector(h, h, _c(ir.VectorType(_I32, 16), list(range(4)) * 4))
        b4h = builder.shuffle_vector(b, hb, _c(v32, list(range(16)) + list(range(16, 32))))  # qs[32:48], qh x 4
        wide = ir.VectorType(_I16, 32)

        def digit(v, mults):
            m = builder.mul(v, _c(_VB, mults))  # mod 256
            t = builder.lshr(builder.mul(builder.zext(m, wide), _c(wide, [3] * 32)), _c(wide, [8] * 32))
            return builder.trunc(t, _VB)

        U = [digit(a, [3 ** n] * 32) for n in range(5)]
        U.append(digit(bb, [1] * 16 + [3] * 16))
        U.append(digit(bb, [9] * 16 + [27] * 16))
        U.append(digit(b4h, [81] * 16 + [1] * 4 + [3] * 4 + [9] * 4 + [27] * 4))
        return context.make_tuple(builder, sig.return_type, U)

    return types.UniTuple(vb, 8)(p, off), codegen
