"""The int8-activation CPU kernels (rows_int): activations quantized per 32, integer dots.

References are independent: gguf-py's numpy dequantizer for the weights, float64 math, and
  - the same int8-quantized activations (q x d, from the kernels' quantizer, itself checked
    against round-to-nearest here): the kernels must agree to float32 summation order,
    TIGHT = 2e-5 x max |reference|;
  - the unquantized float32 activations: int8 rounding of the activations is the only
    difference, LOOSE = 2e-2 x max |reference| (llama.cpp's CPU dots quantize the same way).
Every test sets the int8 path on itself (the suite's conftest keeps the float path for the
model-level comparisons with transformers) and restores the setting after.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq
from numba import njit

from moestream.decoder.bench.kernels import random_matrix
from moestream.decoder.kernels.cpu import ffn as qk
from moestream.decoder.kernels.cpu.simd import integer as si
from moestream.decoder.kernels.cpu.rows_int import INT_TYPES, quantize_acts
from moestream.decoder.kernels.cpu.simd.vectors import addr

TIGHT, LOOSE = 2e-5, 2e-2
D, FF = 512, 256


@pytest.fixture(autouse=True)
def int8_on():
    before = qk.int8_activations()
    qk.set_int8_activations(True)
    yield
    qk.set_int8_activations(before)


def matrix(qtype: Q, n_out: int, n_in: int, seed: int) -> qk.QMatrix:
    return qk.QMatrix(random_matrix(qtype, n_out, n_in, np.random.default_rng(seed)), int(qtype), n_out, n_in)


def weights64(m: qk.QMatrix) -> np.ndarray:
    return gq.dequantize(m.data, Q(m.qtype)).reshape(m.n_out, m.n_in).astype(np.float64)  # [n_out, n_in]


def dequant_acts(x: np.ndarray) -> np.ndarray:
    """x [N, n] float32 as the kernels see it: int8 codes times their block scales, float64."""
    q, d, _ = quantize_acts(x)
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
def test_quantizer_rounds_each_block_to_nearest() -> None:
    x = activations(9, 1024, 1)
    q, d, ds = quantize_acts(x)
    xb = x.reshape(9, -1, 32).astype(np.float64)  # [N, blocks, 32]
    amax = np.abs(xb).max(-1)
    np.testing.assert_allclose(d, amax / 127, rtol=2e-7)  # d = amax / 127 (as a float32 product)
    assert np.abs(q).max() <= 127 and q.dtype == np.int8
    err = np.abs(q.reshape(xb.shape) * d[..., None].astype(np.float64) - xb)  # [N, blocks, 32]
    assert (err <= 0.5 * d[..., None] * (1 + 1e-5) + 1e-30).all(), "not rounded to the nearest code"
    assert (q.reshape(xb.shape)[amax == 0] == 0).all()
    sums = q.reshape(xb.shape).sum(-1, dtype=np.int64)
    np.testing.assert_allclose(ds, d.astype(np.float64) * sums, rtol=1e-6, atol=0)


# -- one matrix (linear: the down kernel) against both references ----------------------------------
@pytest.mark.parametrize("qtype", INT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 3, 6])
def test_linear_matches_float64_references(qtype: Q, n: int) -> None:
    m = matrix(qtype, 96, D, seed=int(qtype))
    x = activations(n, D, seed=n)  # [n, D]
    got = qk.linear(x, m)  # [n, 96]
    w = weights64(m)
    assert_within(got, dequant_acts(x) @ w.T, TIGHT, f"{qtype.name} vs int8-activation reference")
    assert_within(got, x.astype(np.float64) @ w.T, LOOSE, f"{qtype.name} vs float reference")


@pytest.mark.parametrize("qtype", INT_TYPES, ids=lambda q: q.name)
def test_expert_matches_float64_references(qtype: Q) -> None:
    """gate/up against the int8 reference (tight), the whole expert against the float one."""
    gate, up, down = matrix(qtype, FF, D, 1), matrix(qtype, FF, D, 2), matrix(qtype, D, FF, 3)
    x = activations(5, D, seed=7)  # [5, D]
    xq = dequant_acts(x)
    g64, u64 = xq @ weights64(gate).T, xq @ weights64(up).T  # [5, FF]
    h = np.empty((5, FF), np.float32)  # the gate/up kernel's output: act(gate x, up x)
    qts = np.array([[int(qtype)] * 3], np.int64)
    qk._gate_up(gate.readonly(), up.readonly(), qk._ZERO_OFFS, qts, qk._readonly(x), np.array([0, 5]),
                np.arange(5), FF, D, h, 1, qk._NO_BIAS_GU, False, qk.ACTS["swiglu"])
    assert_within(h, silu_mul(g64, u64), TIGHT, f"{qtype.name} gate/up")
    y = qk.swiglu_expert(x, gate, up, down)  # [5, D]
    assert_within(y, dequant_acts(h) @ weights64(down).T, TIGHT, f"{qtype.name} down of the kernel's h")
    x64 = x.astype(np.float64)
    ref = silu_mul(x64 @ weights64(gate).T, x64 @ weights64(up).T) @ weights64(down).T  # [5, D]
    assert_within(y, ref, LOOSE, f"{qtype.name} expert vs float reference")


# -- determinism --------------------------------------------------------------------------------
def test_rows_threads_and_batches_do_not_change_bits() -> None:
    """A token's result is the same bits alone, in a group of 4 or of 2-3, in any order, on 1 or
    more threads, and beside other experts of other types in one call."""
    types = [Q.Q4_K, Q.IQ2_XXS, Q.Q8_0, Q.IQ1_S, Q.Q6_K]  # Q6_K: a float-path type in the same call
    experts = [(matrix(t, FF, D, 10 + i), matrix(t, FF, D, 20 + i), matrix(t, D, FF, 30 + i))
               for i, t in enumerate(types)]
    base = np.concatenate([m.data for e in experts for m in e])
    ends = np.cumsum([m.nbytes for e in experts for m in e])
    mats = [qk.QMatrix(base[end - m.nbytes:end], m.qtype, m.n_out, m.n_in)
            for m, end in zip([m for e in experts for m in e], ends)]
    pool = [tuple(mats[i:i + 3]) for i in range(0, len(mats), 3)]
    x = activations(9, D, seed=3)  # [9, D]
    idx = [np.array([4]), np.arange(7), np.array([8, 2, 5]), np.array([1, 0]), np.arange(9)]
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
@pytest.mark.parametrize("features", [None, {"avx2"}, set()], ids=["host", "avx2", "generic"])
def test_dpbusd_on_each_path(monkeypatch, features) -> None:
    """vpdpbusd, AVX2's vpmaddubsw + vpmaddwd, and plain IR give the same exact sums (unsigned
    bytes <= 128, as the kernels keep them); the function is compiled afresh for each path."""
    if features is not None:
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



# -- a model: streamed == resident, bit for bit, on the int8 path ------------------------------------
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K"])
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
        assert (a - b).abs().max() <= LOOSE * b.abs().max()
