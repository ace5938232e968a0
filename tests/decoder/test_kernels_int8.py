"""The int8-activation CPU kernels (rows_int): activations quantized per 32 (per 256 for the
WIDE_TYPES), integer dots.

References are independent: gguf-py's numpy dequantizer for the weights (Q1_0: tests/qref.py's,
written from ggml's layout), float64 math, and
  - the same int8-quantized activations (q x d, from the kernels' quantizer, itself checked
    against round-to-nearest here): the kernels must agree to float32 summation order,
    TIGHT = 2e-5 x max |reference|;
  - the unquantized float32 activations: int8 rounding of the activations is the only
    difference, LOOSE = 2e-2 x max |reference| (llama.cpp's CPU dots quantize the same way), and
    LOOSE_WIDE = 3e-2 for the WIDE_TYPES, whose activations share a scale per 256 as llama.cpp's
    Q8_K (a whole random expert, 5 seeds, worst of err / max |ref|: 0.021-0.027 wide, 0.014-0.017
    per 32 for the same K/IQ types).
Weights come three ways: random codes with sane scales (authoring's random_blocks, as the
benchmarks), the encoders' output for float rows of varying scale (authoring's encode), and random
bytes in every field with random f16 scales (every code, scale and sign bit pattern).
Every test sets the int8 path on itself (the suite's conftest keeps the float path for the
model-level comparisons with transformers) and restores the setting after.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq
from numba import njit
from numba import types as nbt
from numba.extending import intrinsic

from gguf import GGML_QUANT_SIZES
from moestream.authoring.quantize import ENCODABLE, encode
from moestream.authoring.quantize_iq import set_d
from moestream.decoder.bench.kernels import random_matrix
from moestream.decoder.kernels.cpu import ffn as qk
from moestream.decoder.kernels.cpu.simd import integer as si
from moestream.decoder.kernels.cpu.rows_int import INT_TYPES, WIDE_TYPES, quantize_acts
from moestream.decoder.kernels.cpu.simd import vectors as sv
from moestream.decoder.kernels.cpu.simd.vectors import addr

import qref

TIGHT, LOOSE, LOOSE_WIDE = 2e-5, 2e-2, 3e-2


def loose(qtype: Q) -> float:
    return LOOSE_WIDE if qtype in WIDE_TYPES else LOOSE
D, FF = 512, 256


@pytest.fixture(autouse=True)
def int8_on():
    before = qk.int8_activations()
    qk.set_int8_activations(True)
    yield
    qk.set_int8_activations(before)


def matrix(qtype: Q, n_out: int, n_in: int, seed: int) -> qk.QMatrix:
    return qk.QMatrix(random_matrix(qtype, n_out, n_in, np.random.default_rng(seed)), int(qtype), n_out, n_in)


def encoded(qtype: Q, n_out: int, n_in: int, seed: int) -> qk.QMatrix:
    """Float rows whose 32-weight blocks differ in scale (so the sub-block scales do), encoded."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n_out, n_in)) * np.exp(rng.uniform(-2.0, 2.0, (n_out, n_in // 32))).repeat(32, -1)
    return qk.QMatrix(encode((0.02 * w).astype(np.float32), qtype).reshape(-1), int(qtype), n_out, n_in)


# f16 fields (byte offsets in a block) set to random moderate values in random_bytes; IQ1_M's d
# is spread over four nibbles (set_d), MXFP4's scale is an exponent byte, NVFP4's are UE4M3 bytes
F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82),
              Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
              Q.TQ1_0: (52,), Q.TQ2_0: (64,), Q.Q1_0: (0,), Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,),
              Q.IQ3_XXS: (0,), Q.IQ3_S: (0,), Q.IQ1_S: (0,), Q.IQ1_M: (), Q.MXFP4: (), Q.NVFP4: ()}


def random_bytes(qtype: Q, n_out: int, n_in: int, seed: int) -> qk.QMatrix:
    """Random bytes in every field; f16 scales random with |d| in 2^-14 .. 2^-8, either sign."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_out * n_in // block, type_size), dtype=np.uint8)

    def scales() -> np.ndarray:
        return (rng.choice([-1.0, 1.0], len(blocks)) * np.exp2(rng.uniform(-14, -8, len(blocks)))).astype(np.float16)

    for off in F16_FIELDS[qtype]:
        blocks[:, off:off + 2] = scales().view(np.uint8).reshape(-1, 2)
    if qtype == Q.IQ1_M:
        for i, d in enumerate(scales()):
            set_d(blocks[i:i + 1], qtype, float(d))
    if qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(114, 122, len(blocks))  # 2^(e - 128): 2^-14 .. 2^-7
    return qk.QMatrix(blocks.reshape(-1), int(qtype), n_out, n_in)


MATRICES = {"random": matrix, "encoded": encoded, "bytes": random_bytes}


def weights64(m: qk.QMatrix) -> np.ndarray:
    return qref.dequantize(m.data, Q(m.qtype)).reshape(m.n_out, m.n_in).astype(np.float64)  # [n_out, n_in]


def dequant_acts(x: np.ndarray, qtype: Q) -> np.ndarray:
    """x [N, n] float32 as the kernels see it for weights of `qtype`: int8 codes times their block
    scales (one per 256 for WIDE_TYPES), float64."""
    q, d, _ = quantize_acts(x, qtype in WIDE_TYPES)
    return q.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)  # [N, n]


def activations(n: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * rng.exponential(1.0, (n, 1))  # rows of different scales
    x[0, :32] = 0.0  # an all-zero block
    return x.astype(np.float32)  # [n, d]


def assert_within(got: np.ndarray, want: np.ndarray, rtol: float, what: str) -> None:
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    assert scale > 0 and err <= rtol * scale, f"{what}: {err:.3g} > {rtol} * {scale:.3g}"


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    return g / (1.0 + np.exp(-g)) * u


# -- the activation quantizer -------------------------------------------------------------------
@pytest.mark.parametrize("wide", [False, True])
def test_quantizer_rounds_each_block_to_nearest(wide: bool) -> None:
    span = 256 if wide else 32  # the elements that share a scale
    x = activations(9, 1024, 1)
    q, d, ds = quantize_acts(x, wide)
    xb = x.reshape(9, -1, span).astype(np.float64)  # [N, blocks, span]
    amax = np.abs(xb).max(-1)
    np.testing.assert_allclose(d, np.repeat(amax, span // 32, axis=1) / 127, rtol=2e-7)  # amax / 127, per 32
    assert np.abs(q).max() <= 127 and q.dtype == np.int8
    scale = np.repeat(d.astype(np.float64), 32, axis=1).reshape(xb.shape)  # [N, blocks, span]
    err = np.abs(q.reshape(xb.shape) * scale - xb)
    assert (err <= 0.5 * scale * (1 + 1e-5) + 1e-30).all(), "not rounded to the nearest code"
    assert (q.reshape(xb.shape)[amax == 0] == 0).all()
    sums = q.reshape(9, -1, 32).sum(-1, dtype=np.int64)  # [N, n / 32]
    np.testing.assert_allclose(ds, d.astype(np.float64) * sums, rtol=1e-6, atol=0)


def test_quantizer_takes_strided_rows() -> None:
    x = activations(4, 1024, 2)
    strided = x[:, ::2]  # [4, 512] a view with a stride of 2 elements
    for got, want in zip(quantize_acts(strided), quantize_acts(np.ascontiguousarray(strided))):
        np.testing.assert_array_equal(got, want)


# -- one matrix (linear: the down kernel) against both references ----------------------------------
@pytest.mark.parametrize("qtype", INT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3, 6])
def test_linear_matches_float64_references(qtype: Q, n: int) -> None:
    m = matrix(qtype, 96, D, seed=int(qtype))
    x = activations(n, D, seed=n)  # [n, D]
    got = qk.linear(x, m)  # [n, 96]
    w = weights64(m)
    assert_within(got, dequant_acts(x, qtype) @ w.T, TIGHT, f"{qtype.name} vs int8-activation reference")
    assert_within(got, x.astype(np.float64) @ w.T, loose(qtype), f"{qtype.name} vs float reference")


@pytest.mark.parametrize("n_in", [1024, 1536, 2304])
def test_q1_0_wide_rows_one_at_a_time_and_four(n_in: int) -> None:
    """Q1_0's one-row kernel takes each row's block scales 8 at a time (the rest one by one):
    rows of 8, 12 and 18 blocks, alone and four at once (the other kernel), the same bits and
    the int8-activation reference's values."""
    m = random_bytes(Q.Q1_0, 24, n_in, seed=n_in)
    x = activations(4, n_in, seed=5)  # [4, n_in]
    four = qk.linear(x, m)  # [4, 24]
    alone = np.concatenate([qk.linear(x[[i]], m) for i in range(4)])  # [4, 24]
    np.testing.assert_array_equal(alone.view(np.uint32), four.view(np.uint32))
    assert_within(alone, dequant_acts(x, Q.Q1_0) @ weights64(m).T, TIGHT, f"Q1_0 rows of {n_in}")


@pytest.mark.parametrize("qtype", INT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("source", ["encoded", "bytes"])
def test_encoded_and_random_byte_weights(qtype: Q, source: str) -> None:
    """The encoders' blocks and random bytes (every scale and sign pattern), 4 rows at once."""
    if source == "encoded" and qtype not in ENCODABLE:
        pytest.skip(f"authoring has no {qtype.name} encoder")
    m = MATRICES[source](qtype, 64, D, seed=100 + int(qtype))
    x = activations(4, D, seed=11)  # [4, D]
    got = qk.linear(x, m)  # [4, 64]
    w = weights64(m)
    assert_within(got, dequant_acts(x, qtype) @ w.T, TIGHT, f"{qtype.name} ({source}) vs int8-activation reference")
    assert_within(got, x.astype(np.float64) @ w.T, loose(qtype), f"{qtype.name} ({source}) vs float reference")


@pytest.mark.parametrize("qtype", INT_TYPES, ids=lambda q: q.name)
def test_expert_matches_float64_references(qtype: Q) -> None:
    """gate/up against the int8 reference (tight), the whole expert against the float one."""
    gate, up, down = matrix(qtype, FF, D, 1), matrix(qtype, FF, D, 2), matrix(qtype, D, FF, 3)
    x = activations(5, D, seed=7)  # [5, D]
    xq = dequant_acts(x, qtype)
    g64, u64 = xq @ weights64(gate).T, xq @ weights64(up).T  # [5, FF]
    h = np.empty((5, FF), np.float32)  # the gate/up kernel's output: act(gate x, up x)
    qts = np.array([[int(qtype)] * 3], np.int64)
    qk._gate_up(gate.readonly(), up.readonly(), qk._ZERO_OFFS, qts, qk._readonly(x), np.array([0, 5]),
                np.arange(5), FF, D, h, 1, qk._NO_BIAS_GU, False, qk.ACTS["swiglu"])
    assert_within(h, silu_mul(g64, u64), TIGHT, f"{qtype.name} gate/up")
    y = qk.swiglu_expert(x, gate, up, down)  # [5, D]
    assert_within(y, dequant_acts(h, qtype) @ weights64(down).T, TIGHT, f"{qtype.name} down of the kernel's h")
    x64 = x.astype(np.float64)
    ref = silu_mul(x64 @ weights64(gate).T, x64 @ weights64(up).T) @ weights64(down).T  # [5, D]
    assert_within(y, ref, loose(qtype), f"{qtype.name} expert vs float reference")


# -- determinism --------------------------------------------------------------------------------
# Every int type in some group, each group with a float-path type (F16) beside it in the call.
BIT_GROUPS = [[Q.Q4_K, Q.IQ2_XXS, Q.Q8_0, Q.IQ1_S, Q.Q6_K], [Q.Q1_0, Q.Q4_0, Q.Q2_K, Q.Q5_K, Q.TQ2_0, Q.TQ1_0]]
_REST = [t for t in INT_TYPES if all(t not in g for g in BIT_GROUPS)]
BIT_GROUPS = [g + [Q.F16] for g in BIT_GROUPS + [_REST[i:i + 5] for i in range(0, len(_REST), 5)]]


@pytest.mark.parametrize("types", BIT_GROUPS, ids=lambda ts: "-".join(t.name for t in ts))
def test_rows_threads_and_batches_do_not_change_bits(types: list[Q]) -> None:
    """A token's result is the same bits alone, in a group of 4 or of 2-3, in any order, on 1 or
    more threads, and beside other experts of other types in one call."""
    experts = [(matrix(t, FF, D, 10 + i), matrix(t, FF, D, 20 + i), matrix(t, D, FF, 30 + i))
               for i, t in enumerate(types)]
    base = np.concatenate([m.data for e in experts for m in e])
    ends = np.cumsum([m.nbytes for e in experts for m in e])
    mats = [qk.QMatrix(base[end - m.nbytes:end], m.qtype, m.n_out, m.n_in)
            for m, end in zip([m for e in experts for m in e], ends)]
    pool = [tuple(mats[i:i + 3]) for i in range(0, len(mats), 3)]
    x = activations(9, D, seed=3)  # [9, D]
    rows = [np.array([4]), np.arange(7), np.array([8, 2, 5]), np.array([1, 0]), np.arange(9), np.array([6, 3, 0, 7, 1])]
    idx = [rows[e % len(rows)] for e in range(len(pool))]
    got = qk.swiglu_experts(x, qk.expert_table(base, pool), idx)
    for e, r, y in zip(pool, idx, got):
        alone = np.concatenate([qk.swiglu_expert(x[[t]], *e) for t in r])
        np.testing.assert_array_equal(y.view(np.uint32), alone.view(np.uint32))
    threads = qk.get_threads()
    try:
        qk.set_threads(1)
        one = qk.swiglu_experts(x, qk.expert_table(base, pool), idx)
    finally:
        qk.set_threads(threads)
    for a, b in zip(one, got):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_switch_selects_the_float_path() -> None:
    m = matrix(Q.Q4_K, 64, D, 5)
    x = activations(2, D, seed=5)
    y8 = qk.linear(x, m)
    qk.set_int8_activations(False)
    yf = qk.linear(x, m)
    assert not np.array_equal(y8, yf)
    assert_within(yf, x.astype(np.float64) @ weights64(m).T, TIGHT, "float path")


# -- the integer dot on every instruction path ----------------------------------------------------
@intrinsic
def _i8_ld(typingctx, p):
    """The 8 int32 at address p (test input for dpbusd_k's multipliers)."""
    def codegen(context, builder, sig, args):
        return builder.load(builder.inttoptr(args[0], si._VI.as_pointer()), align=4)

    return si.vi8(p), codegen


@intrinsic
def _i8_st(typingctx, p, v):
    """Store the 8 int32 lanes v at address p (test output)."""
    def codegen(context, builder, sig, args):
        builder.store(args[1], builder.inttoptr(args[0], si._VI.as_pointer()), align=4)
        return context.get_dummy_value()

    return nbt.none(p, v), codegen


@intrinsic
def _st_b(typingctx, p, off, v):
    """Store the 32 bytes v at address p + off (test output)."""
    def codegen(context, builder, sig, args):
        builder.store(args[2], builder.inttoptr(builder.add(args[0], args[1]), si._VB.as_pointer()), align=1)
        return context.get_dummy_value()

    return nbt.none(p, off, v), codegen


def _without(monkeypatch, feature: str) -> None:
    """Compile as for this host less CPU features ("a+b": both; the kernels' other paths); skip
    where the host lacks one, as its own path is then that one."""
    drop = set(feature.split("+"))
    if not drop <= si.cpu_features():
        pytest.skip(f"the host has no {feature}: its own path is the one without")
    features = si.cpu_features() - drop
    monkeypatch.setattr(si, "cpu_features", lambda: features)


@pytest.mark.parametrize("features", [None, "no gfni", {"avx2"}, set()], ids=["host", "host-no-gfni", "avx2", "generic"])
def test_dpbusd_on_each_path(monkeypatch, features) -> None:
    """vpdpbusd, AVX2's vpmaddubsw + vpmaddwd, and plain IR give the same exact sums (unsigned
    bytes <= 128, as the kernels keep them), also with per-lane scales (dpbusd_k); the 16-entry
    lookup (vpshufb or per byte), the bit expansion, the 64-byte dots of activations negated by
    bits (a masked subtract, psignb or a select; also with per-16 scales, dp64_neg_k), the TQ1_0
    block dot (one masked load or three; digits by compares, or with VNNI none: 3 A - B), Q2_K's
    (its codes by vgf2p8affineqb or a shift and a mask; a vpshufb, two or one per byte) and Q3_K's
    (its unsigned codes by vgf2p8affineqb or shifts, vpmaddubsw + vpdpwssd on 64 or 32 bytes or
    plain IR; against gguf-py's dequantizer) agree; each compiled afresh per path."""
    if features == "no gfni":
        _without(monkeypatch, "gfni")
    elif features is not None:
        if "avx2" in features and not si.has_avx2():
            pytest.skip("the host has no AVX2")
        monkeypatch.setattr(si, "cpu_features", lambda: frozenset(features))

    @njit(cache=False)
    def dots(u, a):
        return si.dpbusd(si.i8_zero(), si.ld_b(addr(u), 0), si.ld_b(addr(a), 0))

    @njit(cache=False)
    def lanes(u, a, out):
        v = dots(u, a)
        out[0] = si.f8_hsum(si.f8_of_i(v))

    rng = np.random.default_rng(0)
    for _ in range(20):
        u = rng.integers(0, 129, 32).astype(np.uint8)
        a = rng.integers(-127, 128, 32).astype(np.int8)
        out = np.zeros(1, np.float32)
        lanes(u, a, out)
        assert out[0] == float(np.dot(u.astype(np.int64), a.astype(np.int64)))

    @njit(cache=False)
    def scaled(u, a, k, out):  # dpbusd_k: lane i (4 bytes) times k[i]
        v = si.dpbusd_k(si.ld_b(addr(u), 0), si.ld_b(addr(a), 0), _i8_ld(addr(k)))
        out[0] = si.f8_hsum(si.f8_of_i(v))

    @njit(cache=False)
    def bytes_of(t, i, bits, out):  # b_lut16, b_bits
        _st_b(addr(out), 0, si.b_lut16(si.ld_b(addr(t), 0), si.ld_b(addr(i), 0)))
        _st_b(addr(out), 32, si.b_bits(bits))

    @njit(cache=False)
    def negated_dots(u, bits, a, k, out):  # dp64_neg, dp64_neg_k (run 1: groups 4 .. 7 of k)
        sv.st_i32(addr(out), 0, si.dp64_neg(sv.izero(), sv.ld_i32(addr(u), 0), bits, addr(a), 0))
        sv.st_i32(addr(out), 64, si.dp64_neg_k(sv.izero(), sv.ld_i32(addr(u), 0), bits, addr(a), 0,
                                               sv.ld_i32(addr(k), 0), 1))

    for _ in range(20):
        u = rng.integers(0, 129, 32).astype(np.uint8)
        a = rng.integers(-127, 128, 32).astype(np.int8)
        k = rng.integers(-32, 64, 8).astype(np.int32)
        out = np.zeros(1, np.float32)
        scaled(u, a, k, out)
        assert out[0] == float((u.astype(np.int64) * a * np.repeat(k, 4)).sum())
        t, i = np.tile(rng.integers(-128, 128, 16), 2).astype(np.int8), rng.integers(0, 16, 32).astype(np.uint8)
        bits = int(rng.integers(0, 1 << 32))
        got = np.zeros(64, np.int8)
        bytes_of(t, i, bits, got)
        np.testing.assert_array_equal(got[:32], t[i])
        np.testing.assert_array_equal(got[32:64], (bits >> np.arange(32)) & 1)
        u64, a64 = rng.integers(0, 44, 64).astype(np.uint8), rng.integers(-127, 128, 64).astype(np.int8)
        bits64 = int(rng.integers(-(1 << 63), 1 << 63, dtype=np.int64))
        k = rng.integers(1, 32, 16).astype(np.int32)
        got_dots = np.zeros(32, np.int32)
        negated_dots(u64, bits64, a64, k, got_dots)
        prod = u64 * np.where((bits64 >> np.arange(64)) & 1, -a64.astype(np.int64), a64)  # [64]
        np.testing.assert_array_equal(got_dots[:16], prod.reshape(16, 4).sum(axis=1))
        np.testing.assert_array_equal(got_dots[16:], (prod * np.repeat(k[4:8], 16)).reshape(16, 4).sum(axis=1))

    @njit(cache=False)
    def pm_lanes(a, b0, b1, out):  # both ways to a Q1_0 block's +-1 dot, 16 lanes each
        p = addr(a)
        sv.st_i32(addr(out), 0, si.pm_dot128(b0, b1, p, 0))
        sv.st_i32(addr(out), 64, si.pm_dot128_from(si.pm_sums128(p, 0), b0, b1, p, 0))

    for _ in range(20):
        a = rng.integers(-127, 128, 128).astype(np.int8)
        b0, b1 = (int(w) for w in rng.integers(-(1 << 63), 1 << 63, 2, dtype=np.int64))
        bits = np.unpackbits(np.array([b0, b1], np.int64).view(np.uint8), bitorder="little")  # [128]
        prod = (2 * bits.astype(np.int64) - 1) * a  # [128]
        want = prod.reshape(2, 16, 4).sum(axis=(0, 2))  # lane i: bytes 4i .. 4i + 3 of both halves
        got = np.zeros(32, np.int32)
        pm_lanes(a, b0, b1, got)
        np.testing.assert_array_equal(got[:16], want)
        np.testing.assert_array_equal(got[16:], want)

    @njit(cache=False)
    def tq2_lanes(qs, a, init, out):  # a TQ2_0 super-block's codes dotted, from the lanes `init`
        sv.st_i32(addr(out), 0, si.tq2_dot256(sv.ld_i32(addr(init), 0), addr(qs), 0, addr(a), 0))

    for _ in range(20):
        qs = rng.integers(0, 256, 64).astype(np.uint8)
        a = rng.integers(-127, 128, 256).astype(np.int8)
        init = rng.integers(-5000, 5000, 16).astype(np.int32)
        e = np.arange(256)  # element 128 j + 32 l + m: bits 2 l of qs[32 j + m]
        codes = (qs[32 * (e // 128) + e % 32] >> (2 * ((e % 128) // 32))) & 3  # [256]
        want = init + (codes.astype(np.int64) * a).reshape(4, 16, 4).sum(axis=(0, 2))
        got = np.zeros(16, np.int32)
        tq2_lanes(qs, a, init, got)
        np.testing.assert_array_equal(got, want)

    @njit(cache=False)
    def tq1_lanes(block, a, init, out):  # a TQ1_0 block's base-3 codes dotted, from the lanes `init`
        sv.st_i32(addr(out), 0, si.tq1_dot256(sv.ld_i32(addr(init), 0), addr(block), 0, addr(a), 0))

    for _ in range(20):
        block = np.concatenate([rng.integers(0, 256, 52).astype(np.uint8), np.array([1.0], np.float16).view(np.uint8)])
        codes = gq.dequantize(block, Q.TQ1_0).astype(np.int64) + 1  # gguf-py's digits (d = 1): 0..2, [256]
        a = rng.integers(-127, 128, 256).astype(np.int8)
        init = rng.integers(-5000, 5000, 16).astype(np.int32)
        want = init + (codes * a).reshape(4, 16, 4).sum(axis=(0, 2))  # lane i: bytes 4i .. 4i + 3 of each 64
        got = np.zeros(16, np.int32)
        tq1_lanes(block, a, init, got)
        np.testing.assert_array_equal(got, want)

    @njit(cache=False)
    def q2k_lanes(block, a, out):  # a Q2_K super-block's two dots, the group sums summed here and given
        t1, t2 = si.q2k_dot256(addr(block), 0, addr(a), 0)
        sv.st_i32(addr(out), 0, t1)
        sv.st_i32(addr(out), 64, t2)
        g = si.group_sums256(addr(a), 0)
        sv.st_i32(addr(out), 128, g)
        u1, u2 = si.q2k_dot256_from(addr(block), 0, addr(a), 0, addr(out) + 128)
        sv.st_i32(addr(out), 192, u1)
        sv.st_i32(addr(out), 256, u2)

    one, zero = np.array([1.0], np.float16).view(np.uint8), np.array([0.0], np.float16).view(np.uint8)
    for _ in range(20):
        body = rng.integers(0, 256, 80).astype(np.uint8)  # scales[16], qs[64]
        scq = gq.dequantize(np.concatenate([body, one, zero]), Q.Q2_K).astype(np.int64)  # sc q (d 1, dmin 0)
        m = -gq.dequantize(np.concatenate([body, zero, one]), Q.Q2_K).astype(np.int64)  # m per weight
        a = rng.integers(-127, 128, 256).astype(np.int8)
        got = np.zeros(80, np.int32)
        q2k_lanes(np.concatenate([body, one, one]), a, got)
        np.testing.assert_array_equal(got[:16], (scq * a).reshape(4, 16, 4).sum(axis=(0, 2)))
        np.testing.assert_array_equal(got[16:32], (m * a).reshape(16, 16).sum(axis=1))  # lane g: m_g x its sum
        np.testing.assert_array_equal(got[32:48], a.astype(np.int64).reshape(16, 16).sum(axis=1))
        np.testing.assert_array_equal(got[48:], got[:32])  # from the group sums: the same integers

    @njit(cache=False)
    def q3k_lanes(block, a, out):  # a Q3_K super-block's dot, the group sums summed here and given
        sv.st_i32(addr(out), 0, si.q3k_dot256(addr(block), 0, addr(a), 0))
        sv.st_i32(addr(out), 64, si.group_sums256(addr(a), 0))
        sv.st_i32(addr(out), 128, si.q3k_dot256_from(addr(block), 0, addr(a), 0, addr(out) + 64))

    unit = np.full(12, 0xAA, np.uint8)  # every 6-bit scale 33 (k = sc - 32 = 1): its high bits 2,
    unit[:8] = 0x11  # its low nibbles 1
    for _ in range(20):
        body = rng.integers(0, 256, 96).astype(np.uint8)  # hmask[32], qs[64]
        scales = rng.integers(0, 256, 12).astype(np.uint8)
        u = gq.dequantize(np.concatenate([body, unit, one]), Q.Q3_K).astype(np.int64) + 4  # q + 4 h: 0..7
        k = gq.dequantize(np.concatenate([np.full(32, 0xFF, np.uint8), np.full(64, 0x55, np.uint8), scales, one]),
                          Q.Q3_K).astype(np.int64)  # every code 1 with h set: w = k per weight
        w = gq.dequantize(np.concatenate([body, scales, one]), Q.Q3_K).astype(np.int64)  # d = 1
        a = rng.integers(-127, 128, 256).astype(np.int8)
        got = np.zeros(48, np.int32)
        q3k_lanes(np.concatenate([body, scales, one]), a, got)
        want = (k * u * a).reshape(4, 16, 4).sum(axis=(0, 2)) - 4 * (k * a).reshape(16, 16).sum(axis=1)
        np.testing.assert_array_equal(got[:16], want)  # lane i: bytes 4i .. 4i + 3 of each run, less 4 k_g gsum_g
        assert int(got[:16].sum()) == int((w * a).sum())
        np.testing.assert_array_equal(got[32:], got[:16])  # from the group sums: the same integers


@pytest.mark.parametrize("without", [None, "avx512vbmi"], ids=["host", "no-vbmi"])
def test_iq_aux_signs_on_each_path(monkeypatch, without) -> None:
    """The sign bits IQ2_XXS and IQ3_XXS unpack from their aux words (iq2xxs_runs', iq3xxs_runs')
    and IQ2_XS from its u16 codes' top 7 bits (iq2xs_runs'): each 7-bit field with its parity as
    bit 7 (ggml's ksigns_iq2xs), by vpmultishiftqb and vgf2p8affineqb or by shifts and
    popcounts; and IQ2_XXS's, IQ3_XXS's and IQ2_XS's grid bytes, looked up as level words in
    registers (VBMI) or loaded from the code book (and IQ2_XS's scales); compiled afresh per path."""
    from moestream.decoder.kernels.cpu.rows_int import WORDS_IQ2_XS, WORDS_IQ2_XXS, WORDS_IQ3_XXS
    from moestream.decoder.kernels.cpu.rows_iq import GRID32_IQ3_XXS, GRID64_IQ2_XS, GRID64_IQ2_XXS
    from moestream.decoder.kernels.cpu.simd import blocks as blk

    if without is not None:
        _without(monkeypatch, without)

    @njit(cache=False)
    def signs_of(block, grid, words, out, grid_bytes, m):  # IQ2_XXS (m 0) or IQ3_XXS
        if m == 0:
            U, sg, _ = blk.iq2xxs_runs(addr(block), 0, addr(grid), addr(words))
        else:
            U, sg, _ = blk.iq3xxs_runs(addr(block), 0, addr(grid), addr(words))
        for j in range(8):
            out[j] = si.i8_lane(sg, j)
        for r in range(4):
            sv.st_i32(addr(grid_bytes), 64 * r, U[r])

    @njit(cache=False)
    def xs_of(block, grid, words, out, grid_bytes, k):
        U, sg, K = blk.iq2xs_runs(addr(block), 0, addr(grid), addr(words))
        for j in range(8):
            out[j] = si.i8_lane(sg, j)
        for r in range(4):
            sv.st_i32(addr(grid_bytes), 64 * r, U[r])
        sv.st_i32(addr(k), 0, K)

    def ksigns(f: np.ndarray) -> np.ndarray:
        parity = np.array([bin(int(v)).count("1") & 1 for v in f], np.int64)
        return f | parity << 7

    rng = np.random.default_rng(0)
    for _ in range(50):
        block = rng.integers(0, 256, 66).astype(np.uint8)
        aux = block[2:].view(np.uint32)[1::2].astype(np.int64)  # [8] each sub-block's second u32
        want = sum(ksigns(aux >> (7 * l) & 127) << (8 * l) for l in range(4))  # [8]
        got, grid_bytes = np.zeros(8, np.int64), np.zeros(256, np.uint8)
        signs_of(block, GRID64_IQ2_XXS, WORDS_IQ2_XXS, got, grid_bytes, 0)
        np.testing.assert_array_equal(got & 0xFFFFFFFF, want)
        idx = block[2:].reshape(8, 8)[:, :4].reshape(-1)  # [32] sub-block j's 4 index bytes, in order
        np.testing.assert_array_equal(grid_bytes, GRID64_IQ2_XXS[idx].view(np.uint8))  # the code book's bytes
        block = rng.integers(0, 256, 98).astype(np.uint8)  # IQ3_XXS: d, qs[64], aux[8]
        aux = block[66:].view(np.uint32).astype(np.int64)
        signs_of(block, GRID32_IQ3_XXS, WORDS_IQ3_XXS, got, grid_bytes, 1)
        np.testing.assert_array_equal(got & 0xFFFFFFFF, sum(ksigns(aux >> (7 * l) & 127) << (8 * l) for l in range(4)))
        np.testing.assert_array_equal(grid_bytes, GRID32_IQ3_XXS[block[2:66]].view(np.uint8))
        block = rng.integers(0, 256, 74).astype(np.uint8)
        qs = block[2:66].view(np.uint16).astype(np.int64).reshape(8, 4)  # [8, 4] group l of sub-block j
        want = sum(ksigns(qs[:, l] >> 9) << (8 * l) for l in range(4))  # [8]
        k = np.zeros(16, np.int32)
        xs_of(block, GRID64_IQ2_XS, WORDS_IQ2_XS, got, grid_bytes, k)
        np.testing.assert_array_equal(got & 0xFFFFFFFF, want)
        np.testing.assert_array_equal(grid_bytes, GRID64_IQ2_XS[qs.reshape(-1) & 511].view(np.uint8))
        nib = block[66:74, None] >> np.array([0, 4]) & 15  # [8, 2] scales: group 2 j low nibble, 2 j + 1 high
        np.testing.assert_array_equal(k, 2 * nib.reshape(-1) + 1)


@pytest.mark.parametrize("without", [None, "bmi2+avx512vbmi"], ids=["host", "no-bmi2-vbmi"])
def test_iq_indices_on_each_path(monkeypatch, without) -> None:
    """IQ1_S's, IQ1_M's, IQ2_S's and IQ3_S's code-book indices (a byte of qs and 1 to 4 bits of qh
    above it), put together by two pdep per four or a byte at a time (IQ1_S's also as vector lanes
    for gathers, iq1s_runs): read back through a table whose entry i is i, against ggml's layouts
    in numpy; IQ3_S's (with VBMI looked up as level words in registers) through its code book,
    with its signs; compiled afresh per path."""
    from moestream.decoder.kernels.cpu.rows_int import WORDS_IQ3_S
    from moestream.decoder.kernels.cpu.rows_iq import GRID32_IQ3_S
    from moestream.decoder.kernels.cpu.simd import blocks as blk

    if without is not None:
        _without(monkeypatch, without)

    @njit(cache=False)
    def indices(block, table, out, m):
        if m == 0:
            U, _, _ = blk.iq1s_prep(addr(block), 0, addr(table))
        else:
            U, _, _ = blk.iq1m_prep(addr(block), 0, addr(table))
        for j in range(8):
            _st_b(addr(out), 32 * j, U[j])

    @njit(cache=False)
    def iq1s_runs(block, table, out):
        U, _, _ = blk.iq1s_runs(addr(block), 0, addr(table))
        for r in range(4):
            sv.st_i32(addr(out), 64 * r, U[r])

    @njit(cache=False)
    def iq2s(block, table, out):
        U, _, _ = blk.iq2s_runs(addr(block), 0, addr(table))
        for r in range(4):
            sv.st_i32(addr(out), 64 * r, U[r])

    @njit(cache=False)
    def iq3s(block, grid, words, out, signs):
        U, sg, _ = blk.iq3s_runs(addr(block), 0, addr(grid), addr(words))
        for r in range(4):
            sv.st_i32(addr(out), 64 * r, U[r])
        for j in range(8):
            signs[j] = si.i8_lane(sg, j)

    table = np.arange(4096, dtype=np.uint64)  # entry i holds i
    rng = np.random.default_rng(0)
    k32, k64 = np.arange(32), np.arange(64)
    for _ in range(50):
        block = rng.integers(0, 256, 110).astype(np.uint8)
        got = np.zeros(256, np.uint8)
        indices(block, table, got, 0)  # IQ1_S: f16 d, qs[32], u16 qh[8] (3 bits per group)
        qs, qh = block[2:34].astype(np.int64), block[34:50].view(np.uint16).astype(np.int64)
        np.testing.assert_array_equal(got.view(np.uint64), qs | (qh[k32 // 4] >> (3 * (k32 % 4)) & 7) << 8)
        iq1s_runs(block, table, got)
        np.testing.assert_array_equal(got.view(np.uint64), qs | (qh[k32 // 4] >> (3 * (k32 % 4)) & 7) << 8)
        indices(block, table, got, 1)  # IQ1_M: qs[32], qh[16] (a nibble per group)
        qs, qh = block[:32].astype(np.int64), block[32:48].astype(np.int64)
        np.testing.assert_array_equal(got.view(np.uint64), qs | (qh[k32 // 2] >> (4 * (k32 % 2)) & 15) << 8)
        iq2s(block, table, got)  # IQ2_S: f16 d, qs[32], signs[32], qh[8] (2 bits per group)
        qs, qh = block[2:34].astype(np.int64), block[66:74].astype(np.int64)
        np.testing.assert_array_equal(got.view(np.uint64), qs | (qh[k32 // 4] >> (2 * (k32 % 4)) & 3) << 8)
        signs = np.zeros(8, np.int64)
        iq3s(block, GRID32_IQ3_S, WORDS_IQ3_S, got, signs)  # IQ3_S: f16 d, qs[64], qh[8] (a bit per entry), signs[32]
        qs, qh = block[2:66].astype(np.int64), block[66:74].astype(np.int64)
        np.testing.assert_array_equal(got.view(np.uint32), GRID32_IQ3_S[qs | (qh[k64 // 8] >> (k64 % 8) & 1) << 8])
        np.testing.assert_array_equal(signs & 0xFFFFFFFF, block[74:106].view(np.uint32))


# -- a model: streamed == resident, bit for bit, on the int8 path ------------------------------------
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K", "Q1_0", "TQ2_0"])  # (the last two: wide activations)
def test_streamed_int8_is_bit_identical_to_resident(make_tiny_model, start_daemon, quant) -> None:
    """Both run the same deterministic kernels: decoding from a daemon's arena gives the file-map
    decode's tokens and logits exactly with int8 activations too; those differ from the float
    path's (so the int8 kernels really ran) by about the activations' rounding."""
    import torch
    from moestream.decoder.experts.arena import open_arena
    from moestream.decoder.experts.resident import QuantResidentExperts
    from test_arena_experts import PROMPT, Setup

    # 256 wide: the int8 dots take rows 256 weights at a time (narrower rows take the float path)
    s = Setup(make_tiny_model(quant=quant, arch="qwen3moe", layers=2, experts=8, top_k=2, hidden=256,
                              expert_ff=256))
    prompts = (PROMPT, PROMPT[:5])
    with QuantResidentExperts(s.layout) as resident:
        want = s.run(resident, prompts=prompts)
    daemon = start_daemon(s.path, arena_slots=6)
    with open_arena(s.layout, daemon.endpoint) as src:
        got = s.run(src, prompts=prompts)
    assert got.tokens == want.tokens
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    qk.set_int8_activations(False)
    with QuantResidentExperts(s.layout) as resident:
        exact = s.run(resident, prompts=prompts)
    assert not all(torch.equal(a, b) for a, b in zip(exact.logits, want.logits))
    for a, b in zip(want.logits, exact.logits):
        assert (a - b).abs().max() <= loose(Q[quant]) * b.abs().max()
