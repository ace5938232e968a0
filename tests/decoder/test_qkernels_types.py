"""The row decoders of rows_q.py (Q4_1 Q5_0 Q5_1 Q2_K Q3_K IQ4_NL IQ4_XS TQ1_0 TQ2_0 Q1_0
NVFP4) against gguf-py's numpy dequantizer (Q1_0: the numpy reference in qref.py, written from
ggml's block layout), bit for bit; and the fused / dense expert kernels on them within
RTOL x max |reference| of float64 SwiGLU on the reference-decoded weights."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from moestream.authoring.quantize import encode
from moestream.decoder.kernels.cpu import ffn as qk

import qref

RTOL = 2e-5
NEW = (Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.TQ1_0, Q.TQ2_0, Q.Q1_0, Q.NVFP4)
D, FF = 256, 512
F16_FIELDS = {Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.IQ4_NL: (0,),
              Q.IQ4_XS: (0,), Q.TQ1_0: (52,), Q.TQ2_0: (64,), Q.Q1_0: (0,), Q.NVFP4: ()}
PATHS = {"fused": 1 << 30, "dense": 0}  # DENSE_MIN_ROWS forcing each path


def encoded(qtype: Q, n_out: int, n_in: int, seed: int) -> qk.QMatrix:
    """A random ~N(0, 0.05) matrix, quantized by authoring.quantize."""
    w = (np.random.default_rng(seed).standard_normal((n_out, n_in)) * 0.05).astype(np.float32)
    return qk.QMatrix(encode(w, qtype).reshape(-1), int(qtype), n_out, n_in)


def random_bytes(qtype: Q, n_out: int, n_in: int, seed: int) -> qk.QMatrix:
    """Random block bytes, every code and scale bit pattern (f16 scales kept finite)."""
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_out * n_in // block, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        h = rng.integers(0, 1 << 16, size=len(blocks), dtype=np.uint16)
        h[(h & 0x7C00) == 0x7C00] &= 0xBFFF  # inf / NaN -> finite
        blocks[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)
    if qtype == Q.NVFP4:
        blocks[:4, :4] = [[0, 0x7F, 0x80, 0xFF], [1, 7, 8, 0x7E], [0x81, 0x87, 0x88, 0xFE], [0x38, 0x40, 3, 0x79]]
    return qk.QMatrix(blocks.reshape(-1), int(qtype), n_out, n_in)


def ref_weights(m: qk.QMatrix) -> np.ndarray:
    return qref.dequantize(m.data.reshape(m.n_out, -1), Q(m.qtype))  # [n_out, n_in] float32


def test_q1_0_reference_follows_the_block_layout() -> None:
    """The Q1_0 reference on a hand-made block: d = 0.5, weight j's bit set for j % 3 == 0."""
    bits = (np.arange(128) % 3 == 0).astype(np.uint8)
    block = np.concatenate([np.array([0.5], np.float16).view(np.uint8), np.packbits(bits, bitorder="little")])
    want = np.where(bits == 1, 0.5, -0.5).astype(np.float32)
    np.testing.assert_array_equal(qref.q1_0_dequantize(block), want)
    np.testing.assert_array_equal(qk.dequantize(qk.QMatrix(block, int(Q.Q1_0), 1, 128))[0], want)


@pytest.mark.parametrize("qtype", NEW, ids=lambda q: q.name)
def test_row_decode_bit_exact(qtype: Q) -> None:
    assert qk.has_kernel(int(qtype))
    for m in (encoded(qtype, 8, D, seed=1), random_bytes(qtype, 16, FF, seed=2)):
        got, want = qk.dequantize(m), ref_weights(m)
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), f"{(~same).sum()} of {same.size} values differ, first {np.flatnonzero(~same)[0]}"


@pytest.fixture(params=list(PATHS))
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(qk, "DENSE_MIN_ROWS", PATHS[request.param])
    return request.param


@pytest.mark.parametrize("qtype", NEW, ids=lambda q: q.name)
def test_expert_matches_float64_reference(qtype: Q, path: str) -> None:
    mats = (encoded(qtype, FF, D, 10), encoded(qtype, FF, D, 11), encoded(qtype, D, FF, 12))
    g, u, dn = (ref_weights(m).astype(np.float64) for m in mats)
    for n in (1, 5, 30):
        x = np.random.default_rng(n).standard_normal((n, D)).astype(np.float32)  # [n, D]
        x64 = x.astype(np.float64)
        a, b = x64 @ g.T, x64 @ u.T  # [n, FF]
        want = (a / (1.0 + np.exp(-a)) * b) @ dn.T  # [n, D]
        got = qk.swiglu_expert(x, *mats)
        err, scale = np.abs(got - want).max(), np.abs(want).max()
        assert err <= RTOL * scale, f"n={n}: max abs error {err:.3g} > {RTOL} * max |ref| {scale:.3g}"


def test_mixed_types_in_one_call() -> None:
    """One layer call whose experts (and parts) are of different new types: each as alone."""
    kinds = [(Q.Q2_K, Q.Q2_K, Q.Q4_1), (Q.Q1_0, Q.NVFP4, Q.TQ2_0), (Q.IQ4_XS, Q.Q3_K, Q.IQ4_NL), (Q.TQ1_0, Q.Q5_1, Q.Q5_0)]
    raw = [encoded(q, *s, seed=7 * e + k) for e, ts in enumerate(kinds) for k, (q, s) in
           enumerate(zip(ts, ((FF, D), (FF, D), (D, FF))))]
    base = np.frombuffer(b"".join(m.data.tobytes() for m in raw), dtype=np.uint8)
    mats, off = [], 0
    for m in raw:
        mats.append(qk.QMatrix(base[off:off + m.nbytes], m.qtype, m.n_out, m.n_in))
        off += m.nbytes
    experts = [tuple(mats[i:i + 3]) for i in range(0, len(mats), 3)]
    x = np.random.default_rng(3).standard_normal((6, D)).astype(np.float32)
    idx = [np.array([0, 4]), np.arange(3), np.array([5]), np.array([1, 2, 3, 5])]
    got = qk.swiglu_experts(x, qk.expert_table(base, experts), idx)
    for e, (r, ms) in enumerate(zip(idx, experts)):
        np.testing.assert_array_equal(got[e].view(np.uint32), qk.swiglu_expert(x[r], *ms).view(np.uint32))
