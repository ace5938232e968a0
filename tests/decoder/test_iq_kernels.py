"""The grid ("i-quant") types IQ1_S .. IQ3_S: numba row decoders and torch dequantizers bit for
bit against gguf-py's numpy dequantizers, the fused expert kernels against float64 math on the
gguf-py-dequantized weights, and the encoders' round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from moestream.authoring.quantize import encode, random_blocks
from moestream.authoring.quantize_iq import set_d
from moestream.decoder.kernels.cpu import ffn as qk
from moestream.decoder.kernels.cpu import rows_iq as iq
from moestream.decoder.kernels.dequant.blocks import dequantize as torch_dequantize

GRID = (Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S)
SHAPES = ((1, 256), (3, 512), (16, 1024))  # (n_out, n_in)
RTOL = 2e-5
# relative RMS error of the encoders on N(0, 1) rows (measured 0.47 0.42 0.33 0.29 0.24 0.18 0.13)
MAX_REL_RMS = {Q.IQ1_S: 0.55, Q.IQ1_M: 0.5, Q.IQ2_XXS: 0.4, Q.IQ2_XS: 0.35, Q.IQ2_S: 0.3, Q.IQ3_XXS: 0.22,
               Q.IQ3_S: 0.17}


def random_valid(qtype: Q, n_out: int, n_in: int, seed: int) -> np.ndarray:
    """[n_out, row_bytes] uint8: random bytes (every pattern is a valid grid block) with a finite
    f16 super-scale of any sign, subnormals included."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_out * n_in // 256, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    if qtype == Q.IQ1_M:
        raw[:, 55] &= 0xBF  # d's top exponent bit (d is spread over the top nibbles of bytes 49-55)
    else:
        raw[:, 1] &= 0xBF  # f16 d at bytes 0-1: no inf / NaN
    if qtype != Q.IQ1_M and len(raw) > 1:
        raw[0, :2] = (0x01, 0x00)  # a subnormal d
    return raw.reshape(n_out, -1)


def gguf_ref(raw: np.ndarray, qtype: Q) -> np.ndarray:
    return np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32)


def assert_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def matrix(raw: np.ndarray, qtype: Q, n_in: int) -> qk.QMatrix:
    return qk.QMatrix(np.ascontiguousarray(raw).reshape(-1), int(qtype), raw.shape[0], n_in)


def test_code_books_are_ggml_s() -> None:
    """A few entries of ggml-common.h's tables (uint64 / uint32 little-endian: byte k = element k)."""
    def row(grid, i, n):
        return grid[i * n:(i + 1) * n].astype(np.int64).tolist()

    def le(word, n):
        return [np.int8(np.uint8((word >> (8 * k)) & 0xFF)).item() for k in range(n)]

    assert row(iq.GRID_IQ2_XXS, 1, 8) == le(0x080808080808082B, 8)
    assert row(iq.GRID_IQ2_XXS, 255, 8) == le(0x2B2B2B1908081908, 8)
    assert row(iq.GRID_IQ2_XS, 7, 8) == le(0x080808080819192B, 8)
    assert row(iq.GRID_IQ3_XXS, 5, 4) == le(0x04040C3E, 4)
    assert row(iq.GRID_IQ1_S, 2046, 8) == le(0x01010101010101FF, 8)
    assert row(iq.GRID_IQ1_S, 2047, 8) == le(0x0101010101010101, 8)
    assert iq.KSIGNS[:4].tolist() == [0, 129, 130, 3] and iq.KSIGNS[127] == 255


@pytest.mark.parametrize("qtype", GRID, ids=lambda q: q.name)
def test_row_decoders_bit_exact_on_random_blocks(qtype: Q) -> None:
    assert qk.has_kernel(int(qtype))
    for seed, (n_out, n_in) in enumerate(SHAPES):
        raw = random_valid(qtype, n_out, n_in, seed)
        want = gguf_ref(raw, qtype)
        assert_bits(qk.dequantize(matrix(raw, qtype, n_in)), want)
        got = torch_dequantize(torch.from_numpy(raw.reshape(-1)), qtype, (n_in, n_out))
        assert_bits(got.numpy(), want)


@pytest.mark.parametrize("qtype", GRID, ids=lambda q: q.name)
def test_encoder_round_trip(qtype: Q) -> None:
    """encode -> blocks that gguf-py decodes close to the input; both our decoders bit-exact on them."""
    x = np.random.default_rng(3).standard_normal((8, 512)).astype(np.float32)
    x[1] *= 1e-3  # rows of very different scales, and an all-zero block
    x[2, :256] = 0.0
    raw = encode(x, qtype)
    assert raw.shape == (8, 512 // 256 * GGML_QUANT_SIZES[qtype][1]) and raw.dtype == np.uint8
    y = gguf_ref(raw, qtype)
    assert np.isfinite(y).all() and not y[2, :256].any()
    for r in (0, 1, 3):
        rel = np.sqrt(((y[r] - x[r]) ** 2).mean() / (x[r] ** 2).mean())
        assert rel <= MAX_REL_RMS[qtype], f"{qtype.name} row {r}: relative RMS error {rel:.3f}"
    assert_bits(qk.dequantize(matrix(raw, qtype, 512)), y)
    assert_bits(torch_dequantize(torch.from_numpy(raw.reshape(-1)), qtype, (512, 8)).numpy(), y)


def test_more_bits_fit_better() -> None:
    x = np.random.default_rng(4).standard_normal((4, 1024)).astype(np.float32)
    err = {q: np.sqrt(((gguf_ref(encode(x, q), q) - x) ** 2).mean()) for q in (Q.IQ1_S, Q.IQ2_XXS, Q.IQ3_S)}
    assert err[Q.IQ1_S] > err[Q.IQ2_XXS] > err[Q.IQ3_S]


def test_random_blocks_have_the_requested_std() -> None:
    rng = np.random.default_rng(5)
    for qtype in GRID:
        w = gguf_ref(random_blocks(64, qtype, 0.02, rng), qtype)
        assert np.isfinite(w).all() and 0.016 < w.std() < 0.024, (qtype.name, w.std())


def _expert(types: tuple[Q, Q, Q], d: int, ff: int, seed: int) -> tuple[qk.QMatrix, ...]:
    shapes = ((ff, d), (ff, d), (d, ff))
    return tuple(matrix(random_valid(q, n_out, n_in, seed + i) if q != Q.Q4_K else
                        random_blocks(n_out * n_in // 256, q, 0.02, np.random.default_rng(seed + i)).reshape(n_out, -1),
                        q, n_in) for i, (q, (n_out, n_in)) in enumerate(zip(types, shapes)))


def _reference(x: np.ndarray, gate, up, down) -> np.ndarray:
    w = [gguf_ref(m.data.reshape(m.n_out, -1), Q(m.qtype)).astype(np.float64) for m in (gate, up, down)]
    g, u = x.astype(np.float64) @ w[0].T, x.astype(np.float64) @ w[1].T  # [n, ff]
    return (g / (1.0 + np.exp(-g)) * u) @ w[2].T  # [n, d]


def _scale_d(raw_expert: tuple[qk.QMatrix, ...]) -> None:
    """Random super-scales make weights of any size: set every block's d to ~1e-3 (in place)."""
    for m in raw_expert:
        if Q(m.qtype) in GRID:
            blocks = m.data.reshape(-1, GGML_QUANT_SIZES[Q(m.qtype)][1])
            set_d(blocks, Q(m.qtype), 1e-3)


@pytest.mark.parametrize("dense", [False, True], ids=["fused", "dense"])
def test_expert_kernels_match_float64(dense: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One call for a layer's experts of mixed types (IQ1_S gate/up with Q4_K down, ...)."""
    monkeypatch.setattr(qk, "DENSE_MIN_ROWS", 0 if dense else 1 << 30)
    d, ff = 256, 512
    kinds = [(Q.IQ1_S, Q.IQ1_S, Q.Q4_K), (Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS), (Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S),
             (Q.IQ3_S, Q.IQ2_XXS, Q.IQ1_M)]
    experts = [_expert(k, d, ff, 10 * i) for i, k in enumerate(kinds)]
    for e in experts:
        _scale_d(e)
    base = np.concatenate([m.data for e in experts for m in e])  # one buffer, as a file map
    offs = np.cumsum([0] + [m.nbytes for e in experts for m in e])
    pool = [tuple(qk.QMatrix(base[offs[3 * i + j]:offs[3 * i + j + 1]], m.qtype, m.n_out, m.n_in)
                  for j, m in enumerate(e)) for i, e in enumerate(experts)]
    x = np.random.default_rng(9).standard_normal((7, d)).astype(np.float32)  # [7, d]
    rows = [np.arange(7), np.array([0, 3]), np.array([5]), np.arange(1, 6)]
    ys = qk.swiglu_experts(x, qk.expert_table(base, pool), rows)
    for e, r, got in zip(pool, rows, ys):
        want = _reference(x[r], *e)
        err, scale = np.abs(got - want).max(), np.abs(want).max()
        assert scale > 0 and err <= RTOL * scale, f"{[Q(m.qtype).name for m in e]}: {err:.3g} > {RTOL} * {scale:.3g}"


def test_cached_kernels_are_stamped_with_every_row_file() -> None:
    """numba's cache must see a change to any rows*.py (or simd/*.py, attention.py) in the kernels of rows.py that
    inline its decoders (and the other way round): every file's functions carry all the hashes."""
    import hashlib
    from pathlib import Path

    from moestream.decoder.kernels.cpu import attention, rows, rows_base, rows_dot, rows_int, rows_q
    from moestream.decoder.kernels.cpu.simd import blocks, integer, vectors

    files = [Path(m.__file__) for m in (rows_base, rows, rows_q, iq, rows_dot, vectors, rows_int,
                                        integer, attention, blocks)]
    want = hashlib.sha256(b"".join(f.read_bytes() for f in files)).digest()
    for fn in (rows.gate_up_kernel, rows.decode_row, iq.decode_grid_row, rows_q._row_q2_k,
               rows_dot.fused_dots, rows_int.int_dots, attention._chunk):
        assert fn._cache._impl.locator.get_source_stamp() == want, fn
