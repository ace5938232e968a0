"""decoder.dequant against gguf-py's numpy dequantizers, bit for bit."""

from __future__ import annotations

import moestream.decoder.kernels.dequant.blocks as dq
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import quant_shape_to_byte_shape
from moestream.common.layout import SUPPORTED_QTYPES
from moestream.decoder.kernels.dequant.blocks import SUPPORTED, byte_size, dequantize

import qref

# byte offsets of the float16 scale fields inside one block (from ggml's block structs)
F16_FIELDS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.IQ4_NL: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ4_XS: (0,), Q.MXFP4: (), Q.TQ1_0: (52,), Q.TQ2_0: (64,), Q.Q1_0: (0,), Q.NVFP4: (),
    Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,), Q.IQ1_S: (0,),
    Q.IQ1_M: (),  # its f16 d is spread over four nibbles: made finite in random_tensor
}
FLOATS = (Q.F32, Q.F16, Q.BF16)
ALL = sorted(SUPPORTED, key=lambda q: q.name)


def _finite_bits(rng: np.random.Generator, n: int, bits: int, exp_mask: int) -> np.ndarray:
    """Random float bit patterns (any sign, subnormals included) with inf/NaN ones made finite."""
    dtype = {16: np.uint16, 32: np.uint32}[bits]
    u = rng.integers(0, 1 << bits, size=n, dtype=np.uint64).astype(dtype)
    bad = (u & exp_mask) == exp_mask
    u[bad] &= dtype(~(exp_mask ^ (exp_mask >> 1)) & ((1 << bits) - 1))  # clear the top exponent bit
    return u


def random_tensor(qtype: Q, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Raw bytes [*reversed(shape)[:-1], row_bytes] of a random tensor with finite scales."""
    rng = np.random.default_rng(seed)
    byte_shape = quant_shape_to_byte_shape(tuple(reversed(shape)), qtype)
    n_bytes = int(np.prod(byte_shape))
    if qtype in FLOATS:
        bits, exp_mask = {Q.F32: (32, 0x7F800000), Q.F16: (16, 0x7C00), Q.BF16: (16, 0x7F80)}[qtype]
        words = _finite_bits(rng, n_bytes * 8 // bits, bits, exp_mask)
        return words.view(np.uint8).reshape(byte_shape)
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(n_bytes // type_size, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        blocks[:, off:off + 2] = _finite_bits(rng, len(blocks), 16, 0x7C00).view(np.uint8).reshape(-1, 2)
    if qtype == Q.IQ1_M:
        blocks[:, 55] &= 0xBF  # bit 14 of the scattered f16 d: the top exponent bit, so d is finite
    if qtype == Q.MXFP4 and len(blocks) > 2:
        blocks[:2, 0] = (0, 1)  # the subnormal branch of the e8m0 scale
    return blocks.reshape(byte_shape)


def reference(raw: np.ndarray, qtype: Q) -> np.ndarray:
    return qref.dequantize(raw, qtype)  # gguf-py's numpy code; Q1_0: the reference from ggml's layout


def assert_bit_equal(got: torch.Tensor, want: np.ndarray) -> None:
    assert got.dtype == torch.float32
    assert tuple(got.shape) == want.shape
    g, w = got.cpu().contiguous().numpy().view(np.uint32), want.view(np.uint32)
    if not np.array_equal(g, w):
        i = np.flatnonzero(g.ravel() != w.ravel())
        pytest.fail(f"{i.size} elements differ, first at {i[0]}: "
                    f"got {got.reshape(-1)[i[0]].item()!r}, want {w.view(np.float32).ravel()[i[0]]!r}")


def _shapes(qtype: Q) -> list[tuple[int, ...]]:
    b = GGML_QUANT_SIZES[qtype][0]
    return [(b,), (4 * b,), (2 * b, 3), (b, 5, 3)]  # ggml order: one block, one row, rows, experts


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_matches_gguf_bit_exact(qtype: Q) -> None:
    for seed, shape in enumerate(_shapes(qtype)):
        raw = random_tensor(qtype, shape, seed)
        got = dequantize(torch.from_numpy(raw.reshape(-1)), qtype, shape, name="t")
        assert got.is_contiguous()
        assert_bit_equal(got, reference(raw, qtype))


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_unaligned_and_chunked(qtype: Q, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes at an odd offset of a bigger buffer (an expert in the arena), decoded in chunks."""
    shape = (GGML_QUANT_SIZES[qtype][0] * 3, 7)
    raw = random_tensor(qtype, shape, seed=42)
    buf = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(raw.reshape(-1))
    monkeypatch.setattr(dq, "_CPU_CHUNK_BYTES", GGML_QUANT_SIZES[qtype][1] * 4)  # 21 blocks: 6 chunks
    got = dequantize(buf[1:], qtype, shape)
    assert_bit_equal(got, reference(raw, qtype))
    assert_bit_equal(dequantize(torch.from_numpy(raw), qtype, shape), reference(raw, qtype))  # 2-D input


def test_result_does_not_alias_input() -> None:
    data = torch.from_numpy(np.arange(8, dtype=np.float32).view(np.uint8).copy())
    out = dequantize(data, Q.F32, (8,))
    data.zero_()
    assert out.tolist() == list(range(8))


def test_plain_int_type_and_numpy_shape() -> None:
    raw = random_tensor(Q.Q4_K, (256, 2), seed=3)
    got = dequantize(torch.from_numpy(raw), int(Q.Q4_K), np.array([256, 2], dtype=np.uint64))
    assert_bit_equal(got, reference(raw, Q.Q4_K))


def test_zero_rows() -> None:
    out = dequantize(torch.empty(0, dtype=torch.uint8), Q.Q4_K, (256, 0))
    assert out.shape == (0, 256) and out.dtype == torch.float32


def test_supported_and_byte_size() -> None:
    assert SUPPORTED == SUPPORTED_QTYPES
    for qtype in ALL:
        shape = (GGML_QUANT_SIZES[qtype][0] * 2, 3, 5)
        want = int(np.prod(quant_shape_to_byte_shape(tuple(reversed(shape)), qtype)))
        assert byte_size(qtype, shape) == want


@pytest.mark.parametrize("qtype", [Q.Q8_1, Q.Q8_K, 9999])
def test_unsupported_type(qtype: object) -> None:
    with pytest.raises(ValueError, match=r"blk\.0\.x.*unsupported quant type"):
        dequantize(torch.zeros(64, dtype=torch.uint8), qtype, (32,), name="blk.0.x")  # type: ignore[arg-type]


def test_wrong_byte_count_names_tensor_and_numbers() -> None:
    data = torch.zeros(34 * 3 - 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"'blk\.3\.ffn_up'.*expected 102 bytes, got 101"):
        dequantize(data, Q.Q8_0, (96,), name="blk.3.ffn_up")


def test_row_not_multiple_of_block() -> None:
    with pytest.raises(ValueError, match=r"'w'.*row length 100 is not a multiple of the Q4_K block size 256"):
        dequantize(torch.zeros(144, dtype=torch.uint8), Q.Q4_K, (100, 1), name="w")


@pytest.mark.parametrize("data, shape, match", [
    (torch.zeros(34, dtype=torch.int8), (32,), "torch.uint8"),
    (torch.zeros(34, dtype=torch.uint8), (), "non-empty"),
    (torch.zeros(34, dtype=torch.uint8), (32, -1), "non-negative"),
    (torch.zeros(34, dtype=torch.uint8), (32.0,), "non-negative ints"),
])
def test_bad_input(data: torch.Tensor, shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dequantize(data, Q.Q8_0, shape)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_cuda_matches_gguf(qtype: Q) -> None:
    shape = (GGML_QUANT_SIZES[qtype][0] * 4, 5, 3)
    raw = random_tensor(qtype, shape, seed=7)
    buf = torch.zeros(raw.size + 1, dtype=torch.uint8, device="cuda")
    buf[1:] = torch.from_numpy(raw.reshape(-1)).cuda()
    for data in (buf[1:].clone(), buf[1:]):  # aligned, then at an odd offset
        got = dequantize(data, qtype, shape)
        assert got.device.type == "cuda"
        assert_bit_equal(got, reference(raw, qtype))
