"""Integer SIMD values for the int8-activation dot kernels (rows_int.py): 32-byte vectors.

A weight sub-block of 32 codes is one `<32 x i8>` (a ymm register on x86); its dot with 32 int8
activations is `dpbusd`: unsigned weight bytes times signed activation bytes, each 4 adjacent
products summed into one of 8 int32 lanes (`<8 x i32>`), then scaled as floats (`<8 x float>`).
32 bytes rather than 64: every block layout of GGUF comes in 32-weight sub-blocks, and Zen 4
runs a 512-bit operation as two 256-bit halves anyway. The exceptions are the types whose codes
need no per-sub-block work (Q1_0, TQ2_0, TQ1_0): their dots take 64 bytes at a time
(`pm_dot128`, `tq2_dot256`, `tq1_dot256`, returning the 16-lane vectors of simd/vectors), which
halves the instructions per weight (one 64-byte vpdpbusd with AVX512-VNNI, else two 32-byte dots
as below).

`dpbusd` is emitted for the CPU numba compiles for (its name and features, read once here):
  AVX512-VNNI + VL or AVX-VNNI   one vpdpbusd
  AVX2                           vpmaddubsw + vpmaddwd (int16 pair sums saturate: the callers
                                 keep weight bytes <= 128, so 2 x 128 x 127 fits)
  anything else                  plain widening IR (exact, slower)
so nothing needs a compiler at install time, and a CPU without the instruction never sees it.
`dpbusd_k` also multiplies each int32 lane by an integer (the types with a scale per 16 weights):
vpmaddwd by those scales instead of by 1 on AVX2, a lane multiply after vpdpbusd with VNNI.
numba's on-disk cache is keyed by CPU name and features, so a cache moved between machines
recompiles. Every operation is exact integer arithmetic or one IEEE float operation in a fixed
order: results do not depend on the path taken.
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from .vectors import _i64, _ptr, _splat, _tree, float_binary, float_splat  # (the 16-lane module's IR helpers)
from .vectors import vecf as _vecf
from .vectors import veci as _veci

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
_VB, _VW, _VI, _VF = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)
_V1 = ir.VectorType(ir.IntType(1), 32)


@functools.cache
def cpu_features() -> frozenset[str]:
    """The features of the CPU numba compiles for (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, else the host)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if config.CPU_NAME and config.CPU_NAME != "host":
        flat = config.CPU_FEATURES or ""
    else:
        flat = config.CPU_FEATURES or llvm.get_host_cpu_features().flatten()
    return frozenset(f[1:] for f in flat.split(",") if f.startswith("+"))


def has_fast_pdep() -> bool:
    """BMI2's pdep in one uop: every CPU with BMI2 but AMD's before Zen 3 (microcoded there, ~250
    cycles); where the CPU's name is not known, no."""
    import llvmlite.binding as llvm
    from numba.core import config

    name = config.CPU_NAME if config.CPU_NAME and config.CPU_NAME != "host" else llvm.get_host_cpu_name()
    return "bmi2" in cpu_features() and name not in ("znver1", "znver2", "generic", "")


def has_vnni() -> bool:
    f = cpu_features()
    return ("avx512vnni" in f and "avx512vl" in f) or "avxvnni" in f


def has_avx2() -> bool:
    return "avx2" in cpu_features()


def has_avx512bw() -> bool:
    f = cpu_features()
    return "avx512bw" in f and "avx512vl" in f


def dot_path() -> str:
    """Which instructions `dpbusd` uses here: 'vnni', 'avx2' or 'generic'."""
    return "vnni" if has_vnni() else "avx2" if has_avx2() else "generic"


class _VecB(types.Type):
    def __init__(self) -> None:
        super().__init__(name="VecI8x32")


class _VecI(types.Type):
    def __init__(self) -> None:
        super().__init__(name="VecI32x8")


class _VecF(types.Type):
    def __init__(self) -> None:
        super().__init__(name="VecF32x8")


vb, vi8, vf8 = _VecB(), _VecI(), _VecF()


def _model(llty):
    class _M(models.PrimitiveModel):
        def __init__(self, dmm, fe_type):
            super().__init__(dmm, fe_type, llty)

    return _M


for _cls, _llty in ((_VecB, _VB), (_VecI, _VI), (_VecF, _VF)):
    register_model(_cls)(_model(_llty))


def _ints(*tys) -> bool:
    return all(isinstance(t, types.Integer) for t in tys)


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _scalar_i8(builder, v):
    return builder.trunc(v, _I8) if v.type.width > 8 else v


# -- byte vectors --------------------------------------------------------------------------------
@intrinsic
def ld_b(typingctx, p, off):
    """The 32 bytes at address p + off."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        q = builder.bitcast(_ptr(builder, args[0], args[1], _I8), _VB.as_pointer())
        return builder.load(q, align=1)

    return vb(p, off), codegen


def _bin_b(op: str):
    """vb (op) vb, or vb (op) an integer in every byte."""

    def typer(typingctx, a, b):
        if a != vb or not (b == vb or isinstance(b, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            rhs = args[1] if b == vb else _splat(builder, _scalar_i8(builder, args[1]), _VB)
            return getattr(builder, op)(args[0], rhs)

        return vb(a, b), codegen

    return typer


b_and, b_or, b_shr, b_shl, b_sub = (intrinsic(_bin_b(op)) for op in ("and_", "or_", "lshr", "shl", "sub"))


@intrinsic
def b_abs(typingctx, a):
    """|a| of int8 bytes, read as unsigned (|-128| = 128)."""
    if a != vb:
        return None

    def codegen(context, builder, sig, args):
        neg = builder.icmp_signed("<", args[0], ir.Constant(_VB, [0] * 32))
        return builder.select(neg, builder.sub(ir.Constant(_VB, [0] * 32), args[0]), args[0])

    return vb(a), codegen


@intrinsic
def b_sign(typingctx, a, w):
    """a negated where w < 0 and zeroed where w == 0, bytewise (psignb)."""
    if a != vb or w != vb:
        return None

    def codegen(context, builder, sig, args):
        if has_avx2():
            return _call(builder, "llvm.x86.avx2.psign.b", _VB, list(args))
        zero = ir.Constant(_VB, [0] * 32)
        neg = builder.select(builder.icmp_signed("<", args[1], zero), builder.sub(zero, args[0]), args[0])
        return builder.select(builder.icmp_signed("==", args[1], zero), zero, neg)

    return vb(a, w), codegen


# -- the dot: u8 x s8 -> int32 lanes --------------------------------------------------------------
def _dp256(builder, a, uu, ss):
    """a + dpbusd(uu, ss) on <8 x i32> / <32 x i8> values, by the CPU's best path (above)."""
    if has_vnni():
        return _call(builder, "llvm.x86.avx512.vpdpbusd.256", _VI,
                     [a, builder.bitcast(uu, _VI), builder.bitcast(ss, _VI)])
    if has_avx2():
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _VW, [uu, ss])
        quads = _call(builder, "llvm.x86.avx2.pmadd.wd", _VI, [pairs, ir.Constant(_VW, [1] * 16)])
        return builder.add(a, quads)
    wide = ir.VectorType(_I32, 32)
    prod = builder.mul(builder.zext(uu, wide), builder.sext(ss, wide))
    out = a
    for k in range(4):
        out = builder.add(out, builder.shuffle_vector(prod, prod, ir.Constant(_VI, list(range(k, 32, 4)))))
    return out


@intrinsic
def dpbusd(typingctx, acc, u, s):
    """acc + (sums of 4 adjacent products of unsigned bytes u and signed bytes s): 8 int32 lanes.
    Exact while u <= 128 (the AVX2 path's int16 pair sums); the callers keep it so."""
    if acc != vi8 or u != vb or s != vb:
        return None

    def codegen(context, builder, sig, args):
        return _dp256(builder, *args)

    return vi8(acc, u, s), codegen


def _dp512(builder, a, uu, ss):
    """a + dpbusd(uu, ss) on <16 x i32> / <64 x i8>: one vpdpbusd zmm with AVX512-VNNI, else the
    two 32-byte halves by _dp256 (the same lanes: lane i sums bytes 4i .. 4i + 3)."""
    if "avx512vnni" in cpu_features() and "avx512bw" in cpu_features():
        v16 = ir.VectorType(_I32, 16)
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", v16,
                     [a, builder.bitcast(uu, v16), builder.bitcast(ss, v16)])
    half = [ir.Constant(ir.VectorType(_I32, 32), list(range(h, h + 32))) for h in (0, 32)]
    lanes = [ir.Constant(_VI, list(range(h, h + 8))) for h in (0, 8)]
    out = [_dp256(builder, builder.shuffle_vector(a, a, lanes[h]), builder.shuffle_vector(uu, uu, half[h]),
                  builder.shuffle_vector(ss, ss, half[h])) for h in (0, 1)]
    return builder.shuffle_vector(out[0], out[1], ir.Constant(ir.VectorType(_I32, 16), list(range(16))))


def _ld64(builder, p, off, extra):
    v64 = ir.VectorType(_I8, 64)
    q = _ptr(builder, p, builder.add(_i64(builder, off), ir.Constant(_I64, extra)), _I8)
    return builder.load(builder.bitcast(q, v64.as_pointer()), align=1)


def _mask64(builder, bits):
    bits = bits if bits.type.width == 64 else builder.zext(bits, _I64)
    return builder.bitcast(bits, ir.VectorType(ir.IntType(1), 64))


# The +-1 dot of a Q1_0 block (128 weights w = 2 b - 1, bit b_k of the 64-bit words b0 then b1)
# with 128 int8 activations: 16 int32 lanes, lane i the sum over bytes 4i .. 4i + 3 of both
# 64-byte halves. Two ways to the same integers: pm_dot128 negates the activations where the bit
# is clear (a masked move and a 64-byte vpdpbusd per 64 weights, nothing to precompute: any row
# count), pm_dot128_from adds 2 a where the bit is set to the activations' negated lane sums S
# (pm_sums128, once per activation row; then only a zero-masked constant and a vpdpbusd on the
# activations in memory per 64 weights: the one-row kernel's ~25 % fewer instructions).
@intrinsic
def pm_dot128(typingctx, b0, b1, p, off):
    """sum_k (2 b_k - 1) a_k over the 128 activations at p + off, in 16 lanes (above)."""
    if not _ints(b0, b1, p, off):
        return None

    def codegen(context, builder, sig, args):
        v64 = ir.VectorType(_I8, 64)
        acc = ir.Constant(ir.VectorType(_I32, 16), [0] * 16)
        for h in (0, 1):
            a = _ld64(builder, args[2], args[3], 64 * h)
            signed = builder.select(_mask64(builder, args[h]), a, builder.sub(ir.Constant(v64, [0] * 64), a))
            acc = _dp512(builder, acc, ir.Constant(v64, [1] * 64), signed)
        return acc

    return _veci(b0, b1, p, off), codegen


@intrinsic
def pm_sums128(typingctx, p, off):
    """-(the lane sums of the 128 activations at p + off): pm_dot128_from's S."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        acc = builder.add(_lane_sums(builder, args[0], args[1], 0), _lane_sums(builder, args[0], args[1], 64))
        return builder.sub(ir.Constant(ir.VectorType(_I32, 16), [0] * 16), acc)

    return _veci(p, off), codegen


@intrinsic
def pm_dot128_from(typingctx, sums, b0, b1, p, off):
    """pm_dot128 as S + sum_k 2 b_k a_k, S = pm_sums128(p, off) (above)."""
    if sums != _veci or not _ints(b0, b1, p, off):
        return None

    def codegen(context, builder, sig, args):
        v64 = ir.VectorType(_I8, 64)
        acc = args[0]
        for h in (0, 1):
            twos = builder.select(_mask64(builder, args[1 + h]), ir.Constant(v64, [2] * 64), ir.Constant(v64, [0] * 64))
            acc = _dp512(builder, acc, twos, _ld64(builder, args[3], args[4], 64 * h))
        return acc

    return _veci(sums, b0, b1, p, off), codegen


def _negated(builder, a, bits):
    """The 64 bytes a negated where bit k of the i64 `bits` is set: with AVX-512BW one masked
    subtract (a mask register from the bits), with AVX2 psignb by +-1 bytes per 32-byte half,
    else a select."""
    zero = ir.Constant(a.type, [0] * 64)
    if has_avx512bw() or not has_avx2():
        return builder.select(_mask64(builder, bits), builder.sub(zero, a), a)
    m32 = ir.VectorType(_I32, 32)
    halves = []
    for h in (0, 32):
        m = builder.bitcast(builder.trunc(builder.lshr(bits, ir.Constant(_I64, h)), _I32), _V1)
        signs = builder.or_(builder.sext(m, _VB), ir.Constant(_VB, [1] * 32))
        halves.append(_call(builder, "llvm.x86.avx2.psign.b", _VB,
                            [builder.shuffle_vector(a, a, ir.Constant(m32, list(range(h, h + 32)))), signs]))
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(_I32, 64), list(range(64))))


@intrinsic
def dp64_neg(typingctx, acc, u, bits, p, off):
    """acc + dpbusd(u, a) on 64 bytes: u (64 unsigned bytes, as veci), a the activations at p + off
    negated where bit k of the int64 `bits` is set (a masked subtract with AVX-512BW)."""
    if acc != _veci or u != _veci or not _ints(bits, p, off):
        return None

    def codegen(context, builder, sig, args):
        signed = _negated(builder, _ld64(builder, args[3], args[4], 0), _i64(builder, args[2]))
        return _dp512(builder, args[0], builder.bitcast(args[1], ir.VectorType(_I8, 64)), signed)

    return _veci(acc, u, bits, p, off), codegen


@intrinsic
def dp64_neg_k(typingctx, acc, u, bits, p, off, k, r):
    """acc + run r's dots as dp64_neg's (the activations at p + off negated where `bits` are set)
    with each group of 16 weights' lanes times its integer scale: k (veci) holds group g's in lane
    g, run r (a constant) has groups 4 r .. 4 r + 3 (vpmaddubsw, then vpdpwssd by _run_scales)."""
    if acc != _veci or u != _veci or k != _veci or not _ints(bits, p, off) or not isinstance(r, types.IntegerLiteral):
        return None
    rr = r.literal_value

    def codegen(context, builder, sig, args):
        signed = _negated(builder, _ld64(builder, args[3], args[4], 0), _i64(builder, args[2]))
        return _dp_words(builder, args[0], builder.bitcast(args[1], ir.VectorType(_I8, 64)), signed,
                         _run_scales(builder, args[5], rr))

    return _veci(acc, u, bits, p, off, k, r), codegen


@intrinsic
def f8_pair(typingctx, c, r):
    """Lanes 2 r and 2 r + 1 of the 8 floats c, each in 8 lanes of a 16-lane vector: a 64-byte run's
    two sub-block scales."""
    if c != vf8 or not isinstance(r, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        k = builder.shl(builder.trunc(args[1], _I32), ir.Constant(_I32, 1))
        lo = builder.extract_element(args[0], k)
        hi = builder.extract_element(args[0], builder.add(k, ir.Constant(_I32, 1)))
        picks = ir.Constant(ir.VectorType(ir.IntType(1), 16), [0] * 8 + [1] * 8)
        vf16 = ir.VectorType(_F32, 16)
        return builder.select(picks, _splat(builder, hi, vf16), _splat(builder, lo, vf16))

    return _vecf(c, r), codegen


@intrinsic
def q1_scales8(typingctx, p, off, da, out):
    """out[m] = d_m x da[m], m < 8: the f16 scales d_m of the 8 Q1_0 blocks (18 B each) at p + off
    times 8 float32 at address da, stored as 8 float32 at address out. The 8 scales lie in the
    blocks' first 128 bytes: one two-register shuffle (a vpermt2w with AVX-512) and one
    vcvtph2ps, where taking each apart costs a load, a conversion and a broadcast per block."""
    if not _ints(p, off, da, out):
        return None

    def codegen(context, builder, sig, args):
        v64, v16 = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16)
        o = _i64(builder, args[1])
        lo, hi = (_ld_vec_at(builder, args[0], o, k, v64) for k in (0, 64))
        picks = ir.Constant(v16, [18 * m + b for m in range(8) for b in (0, 1)])
        d = builder.fpext(builder.bitcast(builder.shuffle_vector(lo, hi, picks), ir.VectorType(ir.HalfType(), 8)), _VF)
        a = _ld_vec(builder, args[2], ir.Constant(_I64, 0), _VF)
        builder.store(builder.fmul(d, a), builder.bitcast(_ptr(builder, args[3], ir.Constant(_I64, 0), _I8),
                                                          _VF.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.none(p, off, da, out), codegen


def _q2k_dots(builder, p, off, a, e, gsums):
    """Q2_K's two integer dots of a super-block (q2k_dot256): t1 = sum_k sc_g(k) q_k a_k in
    pm_dot128's lanes and t2 = m_g gsum_g in lane g (gsum_g: the sum of activations 16 g ..
    16 g + 15; `gsums` the address of the 16 as int32, or None: summed here)."""
    v64, d16 = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16)
    o = _i64(builder, off)
    sc = _ld_vec_at(builder, p, o, 0, ir.VectorType(_I8, 16))
    # Dword 4 l + c of the table is group 4 c + l's [0, sc, 2 sc, 3 sc]: run c's 16-byte lane l (group
    # 4 c + l) finds its table at bytes 4 c .. 4 c + 3 of its own lane, so a run's lookup index is
    # its code + 4 c and no run needs its groups' tables moved into place.
    across = builder.shuffle_vector(sc, sc, ir.Constant(ir.VectorType(_I32, 16),
                                                        [4 * (i % 4) + i // 4 for i in range(16)]))
    lo = builder.zext(builder.and_(across, ir.Constant(sc.type, [15] * 16)), d16)  # [16] scales, transposed
    hi = builder.zext(builder.lshr(sc, ir.Constant(sc.type, [4] * 16)), d16)  # [16] their mins, group g in lane g
    table = builder.bitcast(builder.mul(lo, ir.Constant(d16, [0x03020100] * 16)), v64)
    t1 = ir.Constant(d16, [0] * 16)
    for c in range(4):  # run c: elements 64 c .. 64 c + 63, groups 4 c .. 4 c + 3 (a 16-byte lane each)
        j, sh = c // 2, 4 * (c % 2)
        q32 = _ld_vec_at(builder, p, o, 16 + 32 * j, _VB)
        both = builder.shuffle_vector(q32, q32, ir.Constant(ir.VectorType(_I32, 64), list(range(32)) * 2))
        idx = _bit_pairs(builder, both, sh, 4 * c)  # low half bits sh, sh + 1; high half sh + 2, sh + 3
        t1 = _dp512(builder, t1, _lut64(builder, table, idx), _ld64(builder, a, e, 64 * c))  # sc q . a
    if gsums is None:
        g = _group_sums(builder, [_lane_sums(builder, a, e, 64 * c) for c in range(4)])
    else:
        g = _ld_vec(builder, gsums, ir.Constant(_I64, 0), d16)
    return t1, _mul16(builder, g, hi)


def _bit_pairs(builder, x, sh, plus):
    """<64 x i8>: byte i = (bits s, s + 1 of x[i]) + plus, s = sh in the low 32 bytes and sh + 2 in
    the high 32 (plus a multiple of 4 below 16). With GFNI one vgf2p8affineqb (gf_affine), where a
    shift and a mask take two uops on the ports the lookups and dots need."""
    v64 = ir.VectorType(_I8, 64)
    if "gfni" in cpu_features() and has_avx512bw():
        return gf_affine(builder, x, [[1 << sh, 2 << sh]] * 4 + [[4 << sh, 8 << sh]] * 4, plus)
    shifted = builder.lshr(builder.bitcast(x, _W32), ir.Constant(_W32, [sh] * 16 + [sh + 2] * 16))
    codes = builder.and_(builder.bitcast(shifted, v64), ir.Constant(v64, [3] * 64))
    return builder.or_(codes, ir.Constant(v64, [plus] * 64))


def gf_affine(builder, x, qwords, plus):
    """vgf2p8affineqb on the 32- or 64-byte x: result bit i of a byte is the parity of the byte's
    bits in masks[i] (a GF(2) matrix row), XOR bit i of `plus`; masks = qwords[q] for the bytes of
    qword q (cycled; missing rows 0). One uop picks, moves, inverts or sums bits within a byte."""
    n = x.type.count
    vty = ir.VectorType(_I8, n)
    rows = []
    for q in range(n // 8):
        masks = qwords[q % len(qwords)]
        rows += [masks[7 - b] if 7 - b < len(masks) else 0 for b in range(8)]  # byte b: result bit 7 - b
    return _call(builder, f"llvm.x86.vgf2p8affineqb.{8 * n}", vty, [x, ir.Constant(vty, rows), ir.Constant(_I8, plus)])


_W32 = ir.VectorType(_I16, 32)


def _ld_vec_at(builder, p, o, k, vty):
    """The `vty` at p + o + k (o an i64 value, k a constant)."""
    return _ld_vec(builder, p, builder.add(o, ir.Constant(_I64, k)), vty)


def _lut64(builder, table, idx):
    """table[idx] per byte within each 16-byte lane, idx bytes 0..15 (vpshufb)."""
    if has_avx512bw():
        return _call(builder, "llvm.x86.avx512.pshuf.b.512", table.type, [table, idx])
    if has_avx2():
        m32 = ir.VectorType(_I32, 32)
        halves = [_call(builder, "llvm.x86.avx2.pshuf.b", _VB,
                        [builder.shuffle_vector(table, table, ir.Constant(m32, list(range(h, h + 32)))),
                         builder.shuffle_vector(idx, idx, ir.Constant(m32, list(range(h, h + 32))))]) for h in (0, 32)]
        return builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(_I32, 64), list(range(64))))
    out = table
    for i in range(64):  # (no byte shuffle: one lookup per byte)
        k = builder.add(builder.zext(builder.extract_element(idx, ir.Constant(_I32, i)), _I32),
                        ir.Constant(_I32, 16 * (i // 16)))
        out = builder.insert_element(out, builder.extract_element(table, k), ir.Constant(_I32, i))
    return out


def _lane_sums(builder, a, e, k):
    """The lane sums of the 64 activations at a + e + k: lane i = bytes 4i .. 4i + 3."""
    v64 = ir.VectorType(_I8, 64)
    return _dp512(builder, ir.Constant(ir.VectorType(_I32, 16), [0] * 16), ir.Constant(v64, [1] * 64),
                  _ld64(builder, a, e, k))


def _group_sums(builder, runs):
    """The 16 sums of 16 activations (4 lanes each) of four runs' lane sums, group g in lane g."""
    m16 = ir.VectorType(_I32, 16)

    def pairs(x, y):  # lanes 2i + 2i + 1 of x then of y
        ev = builder.shuffle_vector(x, y, ir.Constant(m16, list(range(0, 32, 2))))
        od = builder.shuffle_vector(x, y, ir.Constant(m16, list(range(1, 32, 2))))
        return builder.add(ev, od)

    return pairs(pairs(runs[0], runs[1]), pairs(runs[2], runs[3]))


def _mul16(builder, x, k):
    """x * k on <16 x i32> whose values fit an int16 and k >= 0 does: one vpmaddwd (the high
    halves: x's sign and k's zero) with AVX-512BW, else a lane multiply."""
    if has_avx512bw():
        return _call(builder, "llvm.x86.avx512.pmaddw.d.512", x.type,
                     [builder.bitcast(x, _W32), builder.bitcast(k, _W32)])
    return builder.mul(x, k)


def _has_gfni() -> bool:
    f = cpu_features()
    return "gfni" in f and ("avx512vl" in f or "avx" in f)


def _q3k_codes64(builder, p, o, c):
    """Q3_K's unsigned codes u = q + 4 h (0..7) of elements 64 c .. 64 c + 63 (c a constant 0..3) of
    the super-block at p + o: q the 2-bit code (bits s, s + 1 of qs[32 (c // 2) + m], s = 4 (c % 2)
    in the low 32 bytes, s + 2 in the high; the 64 qs after the 32 hmask bytes), h bit 2 c (low) or
    2 c + 1 (high) of hmask[m]. With GFNI two vgf2p8affineqb and an or: the code's two bits, and
    the mask's bit moved to bit 2."""
    m64 = ir.VectorType(_I32, 64)
    both = [builder.shuffle_vector(x, x, ir.Constant(m64, list(range(32)) * 2))
            for x in (_ld_vec_at(builder, p, o, 32 + 32 * (c // 2), _VB), _ld_vec_at(builder, p, o, 0, _VB))]
    q = _bit_pairs(builder, both[0], 4 * (c % 2), 0)
    if _has_gfni() and has_avx512bw():
        h = gf_affine(builder, both[1], [[0, 0, 1 << (2 * c)]] * 4 + [[0, 0, 2 << (2 * c)]] * 4, 0)
    else:
        v64 = both[1].type
        h = builder.lshr(both[1], ir.Constant(v64, [2 * c] * 32 + [2 * c + 1] * 32))
        h = builder.shl(builder.and_(h, ir.Constant(v64, [1] * 64)), ir.Constant(v64, [2] * 64))
    return builder.or_(q, h)


def _q3k_scales16(builder, p, o):
    """Q3_K's 16 6-bit scales less 32 (-32..31), scale i in lane i: the 12 bytes at p + o, scale i
    bits 4 (i // 8).. of byte i % 8 with bits 2 (i // 4).. of byte 8 + i % 4 on top."""
    v16 = ir.VectorType(_I32, 16)
    b = builder.zext(_ld_vec(builder, p, o, ir.VectorType(_I8, 12)), ir.VectorType(_I32, 12))
    lo = builder.shuffle_vector(b, b, ir.Constant(v16, [i % 8 for i in range(16)]))
    lo = builder.lshr(lo, ir.Constant(v16, [4 * (i // 8) for i in range(16)]))
    hi = builder.shuffle_vector(b, b, ir.Constant(v16, [8 + i % 4 for i in range(16)]))
    hi = builder.lshr(hi, ir.Constant(v16, [2 * (i // 4) for i in range(16)]))
    lo, hi = builder.and_(lo, ir.Constant(v16, [15] * 16)), builder.and_(hi, ir.Constant(v16, [3] * 16))
    return builder.sub(builder.or_(lo, builder.shl(hi, ir.Constant(v16, [4] * 16))), ir.Constant(v16, [32] * 16))


def _dp_words(builder, acc, u, a, kw):
    """acc + lane i = sum over bytes b = 4 i .. 4 i + 3 of u_b a_b kw[b // 2] on <64 x i8> u (unsigned,
    <= 127 / 2 per pair: no int16 saturation) and a (signed), <32 x i16> kw: vpmaddubsw then
    vpdpwssd by kw (AVX-512 VNNI; vpmaddwd and an add with AVX-512BW), else the same on 32-byte
    halves (AVX2) or plain widening IR."""
    d16, w32 = ir.VectorType(_I32, 16), ir.VectorType(_I16, 32)
    if has_avx512bw():
        pairs = _call(builder, "llvm.x86.avx512.pmaddubs.w.512", w32, [u, a])
        if "avx512vnni" in cpu_features():  # (vpdpwssd: LLVM does not fuse the add itself here)
            return _call(builder, "llvm.x86.avx512.vpdpwssd.512", d16,
                         [acc, builder.bitcast(pairs, d16), builder.bitcast(kw, d16)])
        return builder.add(acc, _call(builder, "llvm.x86.avx512.pmaddw.d.512", d16, [pairs, kw]))
    if has_avx2():
        m32, m16 = ir.VectorType(_I32, 32), ir.VectorType(_I32, 16)
        out = []
        for h in (0, 32):
            half = ir.Constant(m32, list(range(h, h + 32)))
            pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _VW,
                          [builder.shuffle_vector(u, u, half), builder.shuffle_vector(a, a, half)])
            k = builder.shuffle_vector(kw, kw, ir.Constant(m16, list(range(h // 2, h // 2 + 16))))
            out.append(_call(builder, "llvm.x86.avx2.pmadd.wd", _VI, [pairs, k]))
        return builder.add(acc, builder.shuffle_vector(out[0], out[1], ir.Constant(d16, list(range(16)))))
    wide, m64 = ir.VectorType(_I32, 64), ir.VectorType(_I32, 64)
    kb = builder.sext(builder.shuffle_vector(kw, kw, ir.Constant(m64, [b // 2 for b in range(64)])), wide)
    prod = builder.mul(builder.mul(builder.zext(u, wide), builder.sext(a, wide)), kb)
    for k in range(4):
        acc = builder.add(acc, builder.shuffle_vector(prod, prod, ir.Constant(d16, list(range(k, 64, 4)))))
    return acc


def _run_scales(builder, k, r):
    """The int16 multipliers of run r's pair sums (<32 x i16>: groups 4 r .. 4 r + 3 of 16 weights,
    8 lanes each) from k (<16 x i32>, group g's integer scale in lane g): k in both int16 halves
    of its lane, moved by one vpermd (a vpermw of 16-bit lanes cost AVX2 13 % on IQ2_S)."""
    d16 = ir.VectorType(_I32, 16)
    low = builder.and_(k, ir.Constant(d16, [0xFFFF] * 16))
    pairs = builder.or_(low, builder.shl(low, ir.Constant(d16, [16] * 16)))
    picks = builder.shuffle_vector(pairs, pairs, ir.Constant(d16, [4 * r + i // 4 for i in range(16)]))
    return builder.bitcast(picks, ir.VectorType(_I16, 32))


def _q3k_dot(builder, p, off, a, e, gsums):
    """Q3_K's super-block at p + off (hmask[32], qs[64], scales[12], f16 d: w = d (sc - 32) (u - 4),
    u = _q3k_codes64's) against the 256 activations at a + e, less d: sum_k K_g(k) (u_k - 4) a_k as
    16 int32 lanes, K = sc - 32 per 16 weights. The codes are unsigned (no sign moved onto the
    activations per sub-block): the dots sum K u a per run of 64 (_dp_words, K in int16 pair lanes),
    and -4 K_g gsum_g goes in lane g (gsum_g: the activations 16 g .. 16 g + 15 summed; `gsums` the
    address of the 16 as int32, or None: summed here)."""
    d16 = ir.VectorType(_I32, 16)
    o = _i64(builder, off)
    K = _q3k_scales16(builder, p, builder.add(o, ir.Constant(_I64, 96)))
    t = ir.Constant(d16, [0] * 16)
    for c in range(4):  # run c: elements 64 c .. 64 c + 63, groups 4 c .. 4 c + 3
        u, x = _q3k_codes64(builder, p, o, c), _ld64(builder, a, e, 64 * c)
        t = _dp_words(builder, t, u, x, _run_scales(builder, K, c))
    if gsums is None:
        g = _group_sums(builder, [_lane_sums(builder, a, e, 64 * c) for c in range(4)])
    else:
        g = _ld_vec(builder, gsums, ir.Constant(_I64, 0), d16)
    return builder.sub(t, builder.shl(builder.mul(K, g), ir.Constant(d16, [2] * 16)))


@intrinsic
def q3k_dot256(typingctx, p, off, a, e):
    """_q3k_dot, the activations' group sums made here (any row count)."""
    if not _ints(p, off, a, e):
        return None

    def codegen(context, builder, sig, args):
        return _q3k_dot(builder, args[0], args[1], args[2], args[3], None)

    return _veci(p, off, a, e), codegen


@intrinsic
def q3k_dot256_from(typingctx, p, off, a, e, gsums):
    """_q3k_dot with the group sums read from `gsums` (the one-row kernel's, made once per call):
    the same integers."""
    if not _ints(p, off, a, e, gsums):
        return None

    def codegen(context, builder, sig, args):
        return _q3k_dot(builder, args[0], args[1], args[2], args[3], args[4])

    return _veci(p, off, a, e, gsums), codegen


@intrinsic
def q2k_dot256(typingctx, p, off, a, e):
    """The Q2_K super-block at p + off (scales[16]: low nibble a scale, high a min per 16 weights;
    qs[64]: element 128 j + 32 l + m bits 2 l of qs[32 j + m], as TQ2_0's; f16 d, dmin) against
    the 256 activations at a + e: (sum sc q a, m . group sums) as two 16-lane integer vectors.
    The scales are multiplied into the codes by a lookup (a 16-byte lane is one group of 16:
    0, sc, 2 sc, 3 sc), so a run of 64 codes is one vpshufb and one 64-byte vpdpbusd; the weights
    are d sc q - dmin m, so the caller scales the two by d and -dmin."""
    if not _ints(p, off, a, e):
        return None

    def codegen(context, builder, sig, args):
        return context.make_tuple(builder, sig.return_type, list(_q2k_dots(builder, args[0], args[1], args[2],
                                                                          args[3], None)))

    return types.UniTuple(_veci, 2)(p, off, a, e), codegen


@intrinsic
def q2k_dot256_from(typingctx, p, off, a, e, gsums):
    """q2k_dot256 with the activations' group sums read from `gsums` (the super-block's 16 int32:
    the one-row kernel's, made once per call), the same integers."""
    if not _ints(p, off, a, e, gsums):
        return None

    def codegen(context, builder, sig, args):
        return context.make_tuple(builder, sig.return_type, list(_q2k_dots(builder, args[0], args[1], args[2],
                                                                          args[3], args[4])))

    return types.UniTuple(_veci, 2)(p, off, a, e, gsums), codegen


@intrinsic
def group_sums256(typingctx, a, e):
    """The 16 sums of 16 activations of the 256 at a + e, group g in lane g (q2k_dot256_from's)."""
    if not _ints(a, e):
        return None

    def codegen(context, builder, sig, args):
        return _group_sums(builder, [_lane_sums(builder, args[0], args[1], 64 * c) for c in range(4)])

    return _veci(a, e), codegen


@intrinsic
def tq1_dot256(typingctx, sums, p, off, a, e):
    """sums + sum_k q_k a_k for the 256 TQ1_0 codes (0..2) of the block at p + off (qs[48], qh[4]:
    base-3 digits, 5 (4) per byte) and the 256 activations at a + e, in pm_dot128's lanes.

    Element 32 n + m is digit n of qs[m] (n < 5), 160 + 16 n + m digit n of qs[32 + m], 240 + 4 n
    + m digit n of qh[m]; digit n of byte b is the top of (b 3^n mod 256) x 3 / 256. The 52 code
    bytes are one 64-byte vector X; X 3^n (n = 0..4, byte adds: x86 has no byte multiply) hold
    every digit plane of every byte at once, and the four 64-element runs of the block are their
    16-byte lanes in element order (lane shuffles; qh's 16 digits one dword permute). A digit is
    (x >= 86) + (x >= 171): two unsigned compares, and one 64-byte vpdpbusd per run, as
    tq2_dot256. With VNNI (whose u8 x s8 products never saturate) no digit is made: as 3 x mod
    256 is the next plane's byte, digit = (3 x - (3 x mod 256)) / 256, so the digits' dot is
    (3 A - B) / 256 for A the dot of the bytes x and B of the bytes 3 x (two adds), exact in
    int32; the compares and their port 5 go (one thread, a 4096 x 1536 expert: 0.79 / 0.76 ->
    0.73 / 0.73 ms)."""
    if sums != _veci or not _ints(p, off, a, e):
        return None

    def codegen(context, builder, sig, args):
        v64, d16 = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16)
        o = _i64(builder, args[2])

        def load(k, n):
            return _ld_vec_at(builder, args[1], o, k, ir.VectorType(_I8, n))

        # the block's 52 code bytes, read within its 54 (a 64-byte load could run past a mapping's end)
        if has_avx512bw():  # one masked load
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                v64, [v64.as_pointer(), _I32, ir.VectorType(ir.IntType(1), 64), v64]), "llvm.masked.load.v64i8.p0v64i8")
            q = builder.bitcast(_ptr(builder, args[1], o, _I8), v64.as_pointer())
            mask = ir.Constant(ir.VectorType(ir.IntType(1), 64), [1] * 52 + [0] * 12)
            x = builder.call(fn, [q, ir.Constant(_I32, 1), mask, ir.Constant(v64, [0] * 64)])
        else:
            lo, mid, qh = load(0, 32), load(32, 16), load(48, 4)
            mq = builder.shuffle_vector(mid, builder.shuffle_vector(qh, qh, ir.Constant(ir.VectorType(_I32, 16),
                                                                                       list(range(4)) + [0] * 12)),
                                        ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
            x = builder.shuffle_vector(lo, mq, ir.Constant(ir.VectorType(_I32, 64), list(range(64))))
        P = [x]
        for _ in range(4):
            P.append(builder.add(builder.add(P[-1], P[-1]), P[-1]))  # x 3^n, wrapping
        D = [builder.bitcast(q, d16) for q in P]  # as dwords: lane L = dwords 4L .. 4L + 3

        def lanes(*picks):  # 16-byte lanes (plane, lane) side by side as one 64-byte vector
            out = []
            for n, L in picks:
                out += [(n, 4 * L + k) for k in range(4)]
            return out

        def gather(picks):  # dwords (plane, index) in these places: one two-source shuffle per plane
            m16 = ir.VectorType(_I32, 16)
            planes = sorted({n for n, _ in picks})
            acc = builder.shuffle_vector(D[planes[0]], D[planes[0]],
                                         ir.Constant(m16, [k if n == planes[0] else 0 for n, k in picks]))
            for m in planes[1:]:  # (places of later planes hold a placeholder until their turn)
                acc = builder.shuffle_vector(acc, D[m], ir.Constant(m16, [16 + k if n == m else i
                                                                          for i, (n, k) in enumerate(picks)]))
            return builder.bitcast(acc, v64)

        hq = [(n, 12) for n in range(4)]  # qh's digit n of its 4 bytes: dword 12 of plane n
        runs = [lanes((0, 0), (0, 1), (1, 0), (1, 1)), lanes((2, 0), (2, 1), (3, 0), (3, 1)),
                lanes((4, 0), (4, 1), (0, 2), (1, 2)), lanes((2, 2), (3, 2), (4, 2)) + hq]
        acc = args[0]
        if has_vnni():  # digits linear in the planes: no compares (above)
            A = B = ir.Constant(d16, [0] * 16)
            for c, picks in enumerate(runs):
                q, a = gather(picks), _ld64(builder, args[3], args[4], 64 * c)
                A = _dp512(builder, A, q, a)
                B = _dp512(builder, B, builder.add(builder.add(q, q), q), a)
            exact = builder.sub(builder.add(builder.add(A, A), A), B)  # 256 x each lane's digit dot
            return builder.add(acc, builder.ashr(exact, ir.Constant(d16, [8] * 16)))
        for c, picks in enumerate(runs):
            q = gather(picks)
            one = [builder.zext(builder.icmp_unsigned(">=", q, ir.Constant(v64, [t] * 64)), v64) for t in (86, 171)]
            acc = _dp512(builder, acc, builder.add(one[0], one[1]), _ld64(builder, args[3], args[4], 64 * c))
        return acc

    return _veci(sums, p, off, a, e), codegen


@intrinsic
def tq2_dot256(typingctx, sums, p, off, a, e):
    """sums + sum_k q_k a_k for the 256 TQ2_0 codes (0..2) of the qs[64] at p + off and the 256
    activations at a + e, in pm_dot128's lanes (lane i: bytes 4i .. 4i + 3 of each 64-byte run of
    activations). The codes of elements 64c .. 64c + 63 are bits 4 (c % 2) and 4 (c % 2) + 2 of
    qs[32 (c // 2):][:32]: those 32 bytes in both halves of a 64-byte vector, their bit pairs
    picked per half (_bit_pairs), then one 64-byte vpdpbusd on the activations in memory."""
    if sums != _veci or not _ints(p, off, a, e):
        return None

    def codegen(context, builder, sig, args):
        acc = args[0]
        for c in range(4):
            j, sh = c // 2, 4 * (c % 2)
            q32 = _ld_vec_at(builder, args[1], _i64(builder, args[2]), 32 * j, _VB)
            both = builder.shuffle_vector(q32, q32, ir.Constant(ir.VectorType(_I32, 64), list(range(32)) * 2))
            acc = _dp512(builder, acc, _bit_pairs(builder, both, sh, 0), _ld64(builder, args[3], args[4], 64 * c))
        return acc

    return _veci(sums, p, off, a, e), codegen


@intrinsic
def i8_zero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VI, [0] * 8)

    return vi8(), codegen


# -- float lanes ------------------------------------------------------------------------------------
@intrinsic
def f8_zero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, [0.0] * 8)

    return vf8(), codegen


@intrinsic
def f8_hsum(typingctx, a):
    """The 8 lanes' sum as float32, in a fixed tree order."""
    if a != vf8:
        return None

    def codegen(context, builder, sig, args):
        return _tree(builder, args[0], builder.fadd)

    return types.float32(a), codegen


@intrinsic
def f8_wide(typingctx, a):
    """The 8 floats a in lanes 0-7 of a 16-lane vector, zeros above (a 256-bit register read as 512)."""
    if a != vf8:
        return None

    def codegen(context, builder, sig, args):
        return builder.shuffle_vector(args[0], ir.Constant(_VF, [0.0] * 8), ir.Constant(ir.VectorType(_I32, 16), list(range(16))))

    return _vecf(a), codegen


@intrinsic
def prefetch_lines(typingctx, p, off, nbytes):
    """Ask for the cache lines of the nbytes at address p + off (llvm.prefetch: read, keep in all
    levels). Addresses past a mapping are harmless: a prefetch never faults. Without it the dots
    and the memory took turns (one core: 1 / (1/compute + 1/bandwidth))."""
    if not _ints(p, off, nbytes):
        return None

    def codegen(context, builder, sig, args):
        i8p = _I8.as_pointer()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                            "llvm.prefetch.p0i8")
        start, size = _i64(builder, args[1]), _i64(builder, args[2])
        with cgutils.for_range_slice(builder, ir.Constant(_I64, 0), size, ir.Constant(_I64, 64), intp=_I64) as (c, _):
            q = builder.bitcast(_ptr(builder, args[0], builder.add(start, c), _I8), i8p)
            builder.call(fn, [q, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return types.void(p, off, nbytes), codegen


# -- scalars at addresses ---------------------------------------------------------------------------
def _ld_scalar(llty, nbty, signed: bool):
    def typer(typingctx, p, off):
        if not _ints(p, off):
            return None

        def codegen(context, builder, sig, args):
            v = builder.load(builder.bitcast(_ptr(builder, args[0], args[1], _I8), llty.as_pointer()), align=1)
            if isinstance(llty, ir.IntType) and llty.width < 64:
                return builder.sext(v, _I64) if signed else builder.zext(v, _I64)
            return v

        return nbty(p, off), codegen

    return typer


f32_at = intrinsic(_ld_scalar(_F32, types.float32, False))
f32_at.__doc__ = "The float32 at address p + off (byte offset)."
i32_at = intrinsic(_ld_scalar(_I32, types.int64, True))
i32_at.__doc__ = "The int32 at address p + off (byte offset), as int64."
u16_at = intrinsic(_ld_scalar(_I16, types.int64, False))
u16_at.__doc__ = "The little-endian uint16 at address p + off, as int64."
u32_at = intrinsic(_ld_scalar(_I32, types.int64, False))
u32_at.__doc__ = "The little-endian uint32 at address p + off, as int64."
u64_at = intrinsic(_ld_scalar(_I64, types.int64, False))
u64_at.__doc__ = "The little-endian 64-bit word at address p + off (its bits, as int64)."


@intrinsic
def nib16(typingctx, p, off):
    """The 16 bytes at p + off as 32 nibbles: the low nibbles (elements 0-15) then the high ones."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        h = ir.VectorType(_I8, 16)
        c = builder.load(builder.bitcast(_ptr(builder, args[0], args[1], _I8), h.as_pointer()), align=1)
        lo = builder.and_(c, ir.Constant(h, [15] * 16))
        hi = builder.lshr(c, ir.Constant(h, [4] * 16))
        return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))

    return vb(p, off), codegen


@intrinsic
def f8_add(typingctx, a, b):
    if a != vf8 or b != vf8:
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])

    return vf8(a, b), codegen


# -- per-super-block (8 sub-blocks) forms -----------------------------------------------------------
@intrinsic
def hsum8x8(typingctx, t):
    """Lane j = the sum of the 8 lanes of t[j], for a tuple t of 8 int32 vectors (a transposing
    add tree: 7 adds and 14 shuffles for 8 sub-blocks' dot products)."""
    if not (isinstance(t, types.UniTuple) and t.count == 8 and t.dtype == vi8):
        return None

    def codegen(context, builder, sig, args):
        v = [builder.extract_value(args[0], i) for i in range(8)]

        def level(a, b, lo, hi):
            m = lambda idx: ir.Constant(_VI, idx)  # noqa: E731
            return builder.add(builder.shuffle_vector(a, b, m(lo)), builder.shuffle_vector(a, b, m(hi)))

        l1 = [level(v[k], v[k + 1], [0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15]) for k in range(0, 8, 2)]
        l2 = [level(l1[k], l1[k + 1], [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]) for k in range(0, 4, 2)]
        return level(l2[0], l2[1], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])

    return vi8(t), codegen


@intrinsic
def f8_ld(typingctx, p, off):
    """The 8 float32 at address p + off (byte offset)."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(builder.bitcast(_ptr(builder, args[0], args[1], _I8), _VF.as_pointer()), align=4)

    return vf8(p, off), codegen


@intrinsic
def f8_of_i(typingctx, i):
    if i != vi8:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _VF)

    return vf8(i), codegen


@intrinsic
def f8_of_u8x8(typingctx, w):
    """The 8 bytes of a 64-bit integer (little-endian: byte j in lane j), as float32 lanes."""
    if not isinstance(w, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0] if args[0].type.width == 64 else builder.zext(args[0], _I64)
        b = builder.bitcast(v, ir.VectorType(_I8, 8))
        return builder.uitofp(b, _VF)

    return vf8(w), codegen


@intrinsic
def f8_of_f16(typingctx, p, off, stride):
    """8 float16 at p + off + j * stride (j = 0..7), widened exactly to float32."""
    if not _ints(p, off, stride):
        return None

    def codegen(context, builder, sig, args):
        vh = ir.VectorType(ir.HalfType(), 8)
        v = ir.Constant(vh, ir.Undefined)
        base, step = _i64(builder, args[1]), _i64(builder, args[2])
        for j in range(8):
            o = builder.add(base, builder.mul(step, ir.Constant(_I64, j)))
            q = builder.bitcast(_ptr(builder, args[0], o, _I8), ir.HalfType().as_pointer())
            v = builder.insert_element(v, builder.load(q, align=1), ir.Constant(_I32, j))
        return builder.fpext(v, _VF)

    return vf8(p, off, stride), codegen


f8_splat = intrinsic(float_splat(vf8, _VF))  # a float32 in every lane
f8_mul = intrinsic(float_binary("fmul", vf8))


@intrinsic
def f8_fma(typingctx, a, b, c):
    """a * b + c, rounded once."""
    if not (a == b == c == vf8):
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.fma.v8f32", _VF, list(args))

    return vf8(a, b, c), codegen


def _c(ty, vals):
    return ir.Constant(ty, vals)


def _ld_vec(builder, p, off, vty):
    return builder.load(builder.bitcast(_ptr(builder, p, off, _I8), vty.as_pointer()), align=1)


@intrinsic
def i8_lane(typingctx, v, j):
    """Lane j (a constant after inlining) of an int32 vector, as int64."""
    if v != vi8 or not isinstance(j, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(builder.extract_element(args[0], builder.trunc(args[1], _I32)), _I64)

    return types.int64(v, j), codegen


@intrinsic
def hsum4x8_halves(typingctx, t):
    """For 4 int32 vectors t[0..3] (dots of 32 bytes: lanes 0-3 cover the first 16 bytes, 4-7 the
    last 16): [t[j] lanes 0-3 summed for j = 0..3, then t[j] lanes 4-7 summed for j = 0..3]."""
    if not (isinstance(t, types.UniTuple) and t.count == 4 and t.dtype == vi8):
        return None

    def codegen(context, builder, sig, args):
        v = [builder.extract_value(args[0], i) for i in range(4)]

        def level(a, b, lo, hi):
            return builder.add(builder.shuffle_vector(a, b, _c(_VI, lo)), builder.shuffle_vector(a, b, _c(_VI, hi)))

        l1 = [level(v[k], v[k + 1], [0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15]) for k in (0, 2)]
        return level(l1[0], l1[1], [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])

    return vi8(t), codegen


@intrinsic
def f8_ld4x2(typingctx, p, off):
    """The 4 float32 at address p + off, twice: [f0, f1, f2, f3, f0, f1, f2, f3]."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        v4 = _ld_vec(builder, args[0], args[1], ir.VectorType(_F32, 4))
        return builder.shuffle_vector(v4, v4, _c(_VI, [0, 1, 2, 3, 0, 1, 2, 3]))

    return vf8(p, off), codegen


# -- per-16 integer scales, bit masks, 16-entry tables ----------------------------------------------
@intrinsic
def dpbusd_k(typingctx, u, s, k):
    """dpbusd(0, u, s) with lane i multiplied by k[i] (k: 8 int32 lanes, or one integer for all):
    the sub-block's integer scales folded into its sums (lanes 0-3 cover bytes 0-15, lanes 4-7
    bytes 16-31: a scale per 16 weights). With AVX2 the multiply is vpmaddwd's own (the int16
    pair sums times k instead of times 1), VNNI CPUs included (vpdpbusd then vpmulld would be
    3 uops, not 2); an integer k takes vpdpbusd where there is one; elsewhere a lane multiply.
    Exact on every path while u <= 128 and |k| < 2^15 (the callers' scales are < 64)."""
    if u != vb or s != vb or not (k == vi8 or isinstance(k, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        uu, ss, kk = args
        if k != vi8:
            kk = _splat(builder, builder.trunc(kk, _I32) if kk.type.width > 32 else kk, _VI)
        if has_vnni() and k != vi8:
            d = _call(builder, "llvm.x86.avx512.vpdpbusd.256", _VI,
                      [ir.Constant(_VI, [0] * 8), builder.bitcast(uu, _VI), builder.bitcast(ss, _VI)])
            return builder.mul(d, kk)
        if has_avx2():
            pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _VW, [uu, ss])
            k16 = builder.or_(builder.and_(kk, ir.Constant(_VI, [0xFFFF] * 8)),
                              builder.shl(kk, ir.Constant(_VI, [16] * 8)))  # k in both int16 halves
            return _call(builder, "llvm.x86.avx2.pmadd.wd", _VI, [pairs, builder.bitcast(k16, _VW)])
        wide = ir.VectorType(_I32, 32)
        prod = builder.mul(builder.zext(uu, wide), builder.sext(ss, wide))
        out = ir.Constant(_VI, [0] * 8)
        for q in range(4):
            out = builder.add(out, builder.shuffle_vector(prod, prod, ir.Constant(_VI, list(range(q, 32, 4)))))
        return builder.mul(out, kk)

    return vi8(u, s, k), codegen


@intrinsic
def b_bits(typingctx, bits):
    """The 32 bits of an integer as bytes 0 / 1 (byte k = bit k)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        m = args[0]
        m = builder.trunc(m, _I32) if m.type.width > 32 else builder.zext(m, _I32) if m.type.width < 32 else m
        return builder.zext(builder.bitcast(m, _V1), _VB)

    return vb(bits), codegen


@intrinsic
def b_lut16(typingctx, table, idx):
    """table[idx] bytewise for idx bytes 0..15, `table` holding its 16 entries in both 16-byte
    halves (vpshufb looks up within each half)."""
    if table != vb or idx != vb:
        return None

    def codegen(context, builder, sig, args):
        t, i = args
        if has_avx2():
            return _call(builder, "llvm.x86.avx2.pshuf.b", _VB, [t, i])
        out = ir.Constant(_VB, ir.Undefined)
        for k in range(32):
            j = builder.and_(builder.extract_element(i, ir.Constant(_I32, k)), ir.Constant(_I8, 15))
            j = builder.add(builder.zext(j, _I32), ir.Constant(_I32, 16 * (k // 16)))
            out = builder.insert_element(out, builder.extract_element(t, j), ir.Constant(_I32, k))
        return out

    return vb(table, idx), codegen
