"""Explicit SIMD values for the numba kernels: 16-lane float32 / int32 vectors as numba types.

The fused dot kernels (rows_dot.py) decode a block's codes into registers and multiply-add
them into vector accumulators that live across the whole row; written as scalar loops, LLVM
reduced every 32-element block horizontally (or spilled the decoded row to a buffer and read it
back), which kept the kernels at half the memory bandwidth. These intrinsics emit the LLVM
vector IR directly (`<16 x float>`, `<16 x i32>`): LLVM lowers it to one zmm register with
AVX-512, two ymm with AVX2, four xmm on plain x86-64 or NEON, so the code stays portable and
needs no compiler at install time. Every operation is an exact IEEE operation in a fixed order
(no fast-math flags): a sum comes out the same whichever kernel (1 or 4 activation rows) ran it.

Loads read integer addresses (`addr(arr)` plus an offset), unaligned and unchecked, like
numba's own unchecked indexing: the callers stay inside the rows they were given.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

LANES = 16
_F32, _I32, _I8, _I16, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(8), ir.IntType(16), ir.IntType(64)
_VF, _VI = ir.VectorType(_F32, LANES), ir.VectorType(_I32, LANES)


class _VecF(types.Type):
    def __init__(self) -> None:
        super().__init__(name="VecF32x16")


class _VecI(types.Type):
    def __init__(self) -> None:
        super().__init__(name="VecI32x16")


vecf, veci = _VecF(), _VecI()


@register_model(_VecF)
class _VecFModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


@register_model(_VecI)
class _VecIModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI)


def _i64(builder, v):
    return v if v.type.width == 64 else builder.sext(v, _I64)


def _ptr(builder, addr, idx, elem):
    """Pointer to element idx of `elem`s starting at the integer address `addr`."""
    base = builder.inttoptr(_i64(builder, addr), elem.as_pointer())
    return builder.gep(base, [_i64(builder, idx)])


def _splat(builder, scalar, vec_ty):
    """`scalar` in every lane of `vec_ty` (any width: simd/integer's 8-lane vectors use it too)."""
    n = vec_ty.count
    v = builder.insert_element(ir.Constant(vec_ty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vec_ty, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _store(builder, ptr, value):
    """Store a vector at the (any-typed) pointer ptr, unaligned."""
    builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=1)


def _ints(*tys) -> bool:
    return all(isinstance(t, types.Integer) for t in tys)


# -- addresses and loads ---------------------------------------------------------------------------
# The kernels pass plain integer addresses, not arrays, into the per-row functions: an array
# argument costs an NRT incref/decref pair per call wherever numba cannot prune them (it could
# not in the type dispatch), which took more time than the dot itself.
@intrinsic
def addr(typingctx, arr):
    """The address of arr's first element, as an int64."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.ptrtoint(a.data, _I64)

    return types.int64(arr), codegen


@intrinsic
def ld_f32(typingctx, p, idx):
    """The 16 float32 at address p, elements idx .. idx + 15, as a vector."""
    if not _ints(p, idx):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(builder.bitcast(_ptr(builder, args[0], args[1], _F32), _VF.as_pointer()), align=4)

    return vecf(p, idx), codegen


def _ld_bytes(signed: bool):
    def typer(typingctx, p, off):
        if not _ints(p, off):
            return None

        def codegen(context, builder, sig, args):
            q = builder.bitcast(_ptr(builder, args[0], args[1], _I8), ir.VectorType(_I8, LANES).as_pointer())
            v = builder.load(q, align=1)
            return builder.sext(v, _VI) if signed else builder.zext(v, _VI)

        return veci(p, off), codegen

    return typer


ld_i8 = intrinsic(_ld_bytes(True))
ld_i8.__doc__ = "The 16 bytes at address p + off read as int8, widened to int32 lanes."
ld_u8 = intrinsic(_ld_bytes(False))
ld_u8.__doc__ = "The 16 bytes at address p + off, zero-extended to int32 lanes."


@intrinsic
def u8_at(typingctx, p, off):
    """The byte at address p + off, as an int32."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(builder.load(_ptr(builder, args[0], args[1], _I8)), _I32)

    return types.int32(p, off), codegen


@intrinsic
def f16_at(typingctx, p, off):
    """The little-endian float16 at address p + off, widened exactly to float32."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        q = builder.bitcast(_ptr(builder, args[0], args[1], _I8), _I16.as_pointer())
        return builder.fpext(builder.bitcast(builder.load(q, align=1), ir.HalfType()), _F32)

    return types.float32(p, off), codegen


# -- rows of float32 or float16 (a KV cache) ------------------------------------------------------
# numba has no float16 on the CPU: a float16 array arrives as its int16 bit patterns. These take
# the array only for its type and read or write its element idx at address p as float32, so one
# kernel source compiles for either cache.
def _row_elem(arr) -> ir.Type | None:
    if not isinstance(arr, types.Array):
        return None
    return {types.float32: _F32, types.int16: ir.HalfType()}.get(arr.dtype)


@intrinsic
def ld_row(typingctx, arr, p, idx):
    """The 16 elements idx .. idx + 15 at address p of a float32 or float16 (int16 bits) row, as
    float32 lanes (float16 widened exactly: vcvtph2ps with F16C)."""
    elem = _row_elem(arr)
    if elem is None or not _ints(p, idx):
        return None

    def codegen(context, builder, sig, args):
        vt = ir.VectorType(elem, LANES)
        x = builder.load(builder.bitcast(_ptr(builder, args[1], args[2], elem), vt.as_pointer()), align=2)
        return x if elem == _F32 else builder.fpext(x, _VF)

    return vecf(arr, p, idx), codegen


@intrinsic
def row_at(typingctx, arr, p, idx):
    """Element idx at address p of a float32 or float16 (int16 bits) row, as a float32."""
    elem = _row_elem(arr)
    if elem is None or not _ints(p, idx):
        return None

    def codegen(context, builder, sig, args):
        x = builder.load(_ptr(builder, args[1], args[2], elem), align=2)
        return x if elem == _F32 else builder.fpext(x, _F32)

    return types.float32(arr, p, idx), codegen


@intrinsic
def set_row(typingctx, arr, p, idx, x):
    """Element idx at address p of a float32 or float16 (int16 bits) row = x (a float32; to
    float16 rounded to nearest even, as torch's conversion)."""
    elem = _row_elem(arr)
    if elem is None or not _ints(p, idx) or x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        v = args[3] if elem == _F32 else builder.fptrunc(args[3], elem)
        builder.store(v, _ptr(builder, args[1], args[2], elem), align=2)
        return context.get_dummy_value()

    return types.void(arr, p, idx, x), codegen


@intrinsic
def ld_i32(typingctx, p, off):
    """The 16 int32 at address p + off (byte offset)."""
    if not _ints(p, off):
        return None

    def codegen(context, builder, sig, args):
        return builder.load(builder.bitcast(_ptr(builder, args[0], args[1], _I8), _VI.as_pointer()), align=4)

    return veci(p, off), codegen


@intrinsic
def st_i32(typingctx, p, off, a):
    """Store the 16 int32 lanes of a at address p + off (byte offset)."""
    if not _ints(p, off) or a != veci:
        return None

    def codegen(context, builder, sig, args):
        _store(builder, _ptr(builder, args[0], args[1], _I8), args[2])
        return context.get_dummy_value()

    return types.void(p, off, a), codegen


# -- float vectors -------------------------------------------------------------------------------
@intrinsic
def zero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, [0.0] * LANES)

    return vecf(), codegen


@intrinsic
def izero(typingctx):
    def codegen(context, builder, sig, args):
        return ir.Constant(_VI, [0] * LANES)

    return veci(), codegen


def float_splat(vt, llvm_vt):
    """The typer of an intrinsic that puts a float32 in every lane of the vector type `vt`."""
    def typer(typingctx, f):
        if not isinstance(f, types.Float):
            return None

        def codegen(context, builder, sig, args):
            v = args[0] if args[0].type == _F32 else builder.fptrunc(args[0], _F32)
            return _splat(builder, v, llvm_vt)

        return vt(f), codegen

    return typer


def float_binary(op: str, vt):
    """The typer of an intrinsic applying llvm's `op` lane-wise to two `vt` vectors."""
    def typer(typingctx, a, b):
        if a != vt or b != vt:
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, op)(args[0], args[1])

        return vt(a, b), codegen

    return typer


splat = intrinsic(float_splat(vecf, _VF))  # a float32 in every lane
add, sub, mul = (intrinsic(float_binary(op, vecf)) for op in ("fadd", "fsub", "fmul"))


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c, rounded once (llvm.fma: vfmadd with FMA hardware)."""
    if not (a == b == c == vecf):
        return None

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * 3), "llvm.fma.v16f32")
        return builder.call(fn, list(args))

    return vecf(a, b, c), codegen


def _tree(builder, v, combine):
    """v's lanes combined in a fixed tree, halves first (log2(lanes) steps): combine(lo, hi)."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        v = combine(lo, hi)
    return builder.extract_element(v, ir.Constant(_I32, 0))


@intrinsic
def hsum(typingctx, a):
    """The lanes' sum as float32, in a fixed tree order (halves added, log2(16) = 4 steps)."""
    if a != vecf:
        return None

    def codegen(context, builder, sig, args):
        return _tree(builder, args[0], builder.fadd)

    return types.float32(a), codegen


@intrinsic
def st_hsum4(typingctx, p, idx, a, b, c, d):
    """Store the lane sums of a, b, c, d as 4 float32 at address p, elements idx .. idx + 3: each
    summed in hsum's tree (the same bits), the four trees interleaved in shared shuffles."""
    if not _ints(p, idx) or not (a == b == c == d == vecf):
        return None

    def codegen(context, builder, sig, args):
        def pick(x, y, lanes):
            return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))

        def halves(x, y, lo, hi):
            return builder.fadd(pick(x, y, lo), pick(x, y, hi))

        a, b, c, d = args[2:]
        low, high = list(range(8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32))
        ab, cd = halves(a, b, low, high), halves(c, d, low, high)  # each tree's first step: 8 lanes each
        quads = [q + i for q in (0, 8, 16, 24) for i in range(4)]
        s = halves(ab, cd, quads, [i + 4 for i in quads])  # 4 lanes each
        pairs = [q + i for q in (0, 4, 8, 12) for i in range(2)]
        s = halves(s, s, pairs, [i + 2 for i in pairs])  # 2 lanes each
        s = halves(s, s, [0, 2, 4, 6], [1, 3, 5, 7])  # the 4 sums
        _store(builder, _ptr(builder, args[0], args[1], _F32), s)
        return context.get_dummy_value()

    return types.void(p, idx, a, b, c, d), codegen


def _float_call(name: str, n_args: int):
    """The typer of an intrinsic applying the llvm intrinsic `name` (.v16f32) lane-wise to one or
    two float vectors."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * n_args), f"{name}.v16f32")
        return builder.call(fn, list(args))

    def unary(typingctx, a):
        return (vecf(a), codegen) if a == vecf else None

    def binary(typingctx, a, b):
        return (vecf(a, b), codegen) if a == b == vecf else None

    return unary if n_args == 1 else binary


div = intrinsic(float_binary("fdiv", vecf))
fmin, fmax = intrinsic(_float_call("llvm.minnum", 2)), intrinsic(_float_call("llvm.maxnum", 2))
rint = intrinsic(_float_call("llvm.rint", 1))  # (round half to even, as np.rint)
fabs = intrinsic(_float_call("llvm.fabs", 1))


@intrinsic
def hmax(typingctx, a):
    """The largest lane (maxnum: a NaN lane loses to a number)."""
    if a != vecf:
        return None

    def codegen(context, builder, sig, args):
        def vmax(lo, hi):
            ty = lo.type
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty]),
                                                f"llvm.maxnum.v{ty.count}f32")
            return builder.call(fn, [lo, hi])

        return _tree(builder, args[0], vmax)

    return types.float32(a), codegen


@intrinsic
def lane(typingctx, a, k):
    """Lane k of a float vector."""
    if a != vecf or not isinstance(k, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], args[1])

    return types.float32(a, k), codegen


@intrinsic
def st_f32(typingctx, p, idx, a):
    """Store the 16 float32 lanes of a at address p, elements idx .. idx + 15."""
    if not _ints(p, idx) or a != vecf:
        return None

    def codegen(context, builder, sig, args):
        _store(builder, _ptr(builder, args[0], args[1], _F32), args[2])
        return context.get_dummy_value()

    return types.void(p, idx, a), codegen


# -- int32 vectors -------------------------------------------------------------------------------
@intrinsic
def to_i(typingctx, a):
    """float32 lanes -> int32, truncated (exact for the integral values the callers pass)."""
    if a != vecf:
        return None

    def codegen(context, builder, sig, args):
        return builder.fptosi(args[0], _VI)

    return veci(a), codegen


@intrinsic
def st_i8(typingctx, p, off, a):
    """Store the 16 int32 lanes of a, each cut to its low byte, at address p + off."""
    if not _ints(p, off) or a != veci:
        return None

    def codegen(context, builder, sig, args):
        _store(builder, _ptr(builder, args[0], args[1], _I8), builder.trunc(args[2], ir.VectorType(_I8, LANES)))
        return context.get_dummy_value()

    return types.void(p, off, a), codegen


@intrinsic
def ihsum(typingctx, a):
    """The int32 lanes' sum (exact while it fits)."""
    if a != veci:
        return None

    def codegen(context, builder, sig, args):
        return _tree(builder, args[0], builder.add)

    return types.int32(a), codegen


@intrinsic
def bits_f(typingctx, a):
    """The int32 lanes' bits read as float32 (a register bitcast)."""
    if a != veci:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _VF)

    return vecf(a), codegen


@intrinsic
def to_f(typingctx, a):
    """int32 lanes -> float32 (exact for the small codes the decoders make)."""
    if a != veci:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _VF)

    return vecf(a), codegen


def _binary_i(op: str):
    """veci (op) veci, or veci (op) an integer scalar in every lane."""

    def typer(typingctx, a, b):
        if a != veci or not (b == veci or isinstance(b, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            rhs = args[1]
            if b != veci:
                s = builder.trunc(rhs, _I32) if rhs.type.width > 32 else builder.sext(rhs, _I32) if rhs.type.width < 32 else rhs
                rhs = _splat(builder, s, _VI)
            return getattr(builder, op)(args[0], rhs)

        return veci(a, b), codegen

    return typer


iand, ior, ishr, ishl, iadd, isub, imul = (intrinsic(_binary_i(op)) for op in
                                           ("and_", "or_", "lshr", "shl", "add", "sub", "mul"))
