"""Encoders from float32 rows to GGUF block bytes, and random block generators.

Two jobs, kept apart on purpose:
- `encode(values, qtype)` turns GIVEN floats into blocks whose `gguf.quants.dequantize`
  approximates them (exact for F32; the usual rounding error otherwise). gguf-py quantizes
  F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/TQ1_0/TQ2_0/MXFP4; it has no K-quant quantizer, so
  Q4_K and Q6_K use the simple round-to-nearest encoders below, and Q2_K, Q3_K, IQ4_NL, IQ4_XS,
  Q1_0 and NVFP4 those of `quantize_lo` (no importance matrix, no scale search: worse than
  llama.cpp's, fine for tests and small exports); the grid ("i-quant") types IQ1_S .. IQ3_S use
  `quantize_iq`'s nearest-grid encoders.
- `random_blocks(n_blocks, qtype, std, rng)` writes random codes with sane scales straight into
  block bytes, for random models: no float tensor is ever materialized, so multi-GiB files
  are written at disk speed. The decoded weights are ~uniform with the requested std.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gq

from . import quantize_lo
from .quantize_iq import GRID_TYPES, encode_grid, random_grid_blocks

QK_K = 256
_GGUF_PY = frozenset((Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4,
                      Q.TQ1_0, Q.TQ2_0))  # gguf-py quantizes these


def qtype_of(name: str | Q) -> Q:
    """`"Q8_0"` -> GGMLQuantizationType.Q8_0, with a clear error for unknown names."""
    if isinstance(name, Q):
        return name
    try:
        return Q[name.upper()]
    except KeyError:
        raise ValueError(f"unknown quant type {name!r} (writable: {writable()})") from None


def writable() -> str:
    """The names of the types encode() writes, for messages and --help."""
    return " ".join(t.name for t in sorted(ENCODABLE, key=lambda q: q.name))


def check_row(name: str, row_len: int, qtype: Q) -> None:
    """Raise a ValueError naming the tensor when its rows cannot be split into blocks."""
    if qtype not in ENCODABLE:
        raise ValueError(f"tensor {name!r}: cannot write quant type {qtype.name} (writable: {writable()})")
    block = GGML_QUANT_SIZES[qtype][0]
    if row_len % block:
        raise ValueError(f"tensor {name!r}: row length {row_len} is not a multiple of the "
                         f"{qtype.name} block size {block}")


def row_bytes(row_len: int, qtype: Q) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    return row_len // block * type_size


def encode(values: np.ndarray, qtype: Q, *, name: str = "tensor") -> np.ndarray:
    """Quantize float rows (last axis) to uint8 block bytes of shape [..., row_bytes] (deterministic)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    check_row(name, values.shape[-1], qtype)
    if qtype in _GGUF_PY:
        out = gq.quantize(values, qtype)
    else:
        out = _ENCODERS[qtype](values.reshape(-1, GGML_QUANT_SIZES[qtype][0]))  # [n, type_size]
    return np.ascontiguousarray(out).view(np.uint8).reshape(*values.shape[:-1], row_bytes(values.shape[-1], qtype))


def _f16_bytes(x: np.ndarray) -> np.ndarray:  # [n] -> [n, 2]
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _safe_inv(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(x == 0, 0.0, 1.0 / x).astype(np.float32)


def _encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] floats -> [n, 210] Q6_K blocks: 16 sub-blocks of 16, int8 scales, 6-bit codes."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    amax_i = np.abs(sub).argmax(axis=-1)[..., None]
    signed_max = np.take_along_axis(sub, amax_i, axis=-1)[..., 0]  # [n, 16]
    scale = -signed_max / 32.0  # q in [-32, 31]: map the extreme value to -32 as ggml does
    d = np.abs(scale).max(axis=-1) / 127.0  # [n]
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale * _safe_inv(d16)[:, None]), -127, 127).astype(np.int8)  # [n, 16]
    step = (d16[:, None] * sc).astype(np.float32)[..., None]  # [n, 16, 1]
    q = np.clip(np.rint(sub * _safe_inv(step)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, QK_K)
    lo, hi = q & 0x0F, q >> 4
    lo = lo.reshape(n, 2, 2, 64)
    ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(n, 128)
    hi = hi.reshape(n, 2, 4, 32)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=-1)


def _pack_q4_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> the 12-byte K_SCALE layout gguf's Q4_K unpacks."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    b0 = (sc[:, :4] & 0x3F) | ((sc[:, 4:] & 0x30) << 2)
    b1 = (m[:, :4] & 0x3F) | ((m[:, 4:] & 0x30) << 2)
    b2 = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([b0, b1, b2], axis=-1)


def _encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] floats -> [n, 144] Q4_K blocks: x ~ d*sc*q - dmin*m, 8 sub-blocks of 32."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)  # [n, 8]
    scale = (sub.max(axis=-1) - lo) / 15.0
    d = scale.max(axis=-1) / 63.0
    dmin = (-lo).max(axis=-1) / 63.0
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.ceil(scale * _safe_inv(d16)[:, None]), 0, 63)  # ceil: the range still fits in 0..15
    mn = np.clip(np.rint(-lo * _safe_inv(dmin16)[:, None]), 0, 63)
    step = (d16[:, None] * sc)[..., None]  # [n, 8, 1]
    offset = (dmin16[:, None] * mn)[..., None]
    q = np.clip(np.rint((sub + offset) * _safe_inv(step)), 0, 15).astype(np.uint8).reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_q4_k_scales(sc, mn), qs], axis=-1)


# Our own encoders: [n, block] float32 -> [n, type_size] uint8, one entry per type.
_ENCODERS = {Q.Q4_K: _encode_q4_k, Q.Q6_K: _encode_q6_k, **quantize_lo.ENCODERS,
             **{q: (lambda blocks, q=q: encode_grid(blocks, q)) for q in GRID_TYPES}}
# Types encode() and random_blocks() handle: gguf-py's, plus our own encoders.
ENCODABLE: frozenset[Q] = _GGUF_PY | frozenset(_ENCODERS)


# -- random models ------------------------------------------------------------------------
_UNIFORM = np.sqrt(3.0)  # a uniform variable on [-a, a] has std a / sqrt(3)


def random_blocks(n_blocks: int, qtype: Q, std: float, rng: np.random.Generator) -> np.ndarray:
    """`n_blocks` random blocks ([n_blocks, type_size] uint8) decoding to ~U(-a, a), std ~ `std`."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16, Q.BF16):
        return _random_floats(n_blocks * block, qtype, std * _UNIFORM, rng).view(np.uint8).reshape(n_blocks, type_size)
    raw = _random_bytes(rng, n_blocks * type_size).reshape(n_blocks, type_size)
    gen = _RANDOM.get(qtype)
    if gen is None:
        raise ValueError(f"cannot generate random blocks of quant type {qtype.name}")
    gen(raw, std * _UNIFORM)
    return raw


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    # raw 64-bit draws are ~10x faster than Generator.bytes; speed matters for multi-GiB files
    words = rng.bit_generator.random_raw(-(-n // 8))
    return np.asarray(words, dtype=np.uint64).view(np.uint8)[:n]


def _random_floats(n: int, qtype: Q, a: float, rng: np.random.Generator) -> np.ndarray:
    # uniform on [-a, a] from raw int32 draws (Generator.random + float16 casts are slow)
    x = _random_bytes(rng, 4 * n).view(np.int32).astype(np.float32)
    x *= np.float32(a / 2**31)
    if qtype == Q.F32:
        return x
    if qtype == Q.BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16)  # truncation: fine for random values
    return x.astype(np.float16)


def _fill_f16(raw: np.ndarray, start: int, value: float) -> None:
    raw[:, start:start + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)


def _rand_q8_0(raw: np.ndarray, a: float) -> None:
    _fill_f16(raw, 0, a / 127)  # d, then 32 int8 codes (already random)


def _rand_q4_0(raw: np.ndarray, a: float) -> None:
    _fill_f16(raw, 0, a / 8)  # codes 0..15 minus 8


def _rand_q4_1(raw: np.ndarray, a: float) -> None:
    _fill_f16(raw, 0, 2 * a / 15)  # d, then m = -a: x = d*q + m
    _fill_f16(raw, 2, -a)


def _rand_q5_0(raw: np.ndarray, a: float) -> None:
    _fill_f16(raw, 0, a / 16)


def _rand_q5_1(raw: np.ndarray, a: float) -> None:
    _fill_f16(raw, 0, 2 * a / 31)
    _fill_f16(raw, 2, -a)


def _rand_q4_k(raw: np.ndarray, a: float) -> None:
    # every sub-block: sc = 32, m = 32 -> x = d*32*q - dmin*32, q in 0..15, centred on 0
    _fill_f16(raw, 0, 2 * a / (15 * 32))
    _fill_f16(raw, 2, a / 32)
    raw[:, 4:16] = _pack_q4_k_scales(np.full((1, 8), 32), np.full((1, 8), 32))


def _rand_q6_k(raw: np.ndarray, a: float) -> None:
    # 16 int8 sub-block scales at 192..207 spread over 32..63, super-scale d at 208
    raw[:, 192:208] = 32 + (raw[:, 192:208] & 0x1F)
    _fill_f16(raw, 208, a / (32 * 48))


def _rand_mxfp4(raw: np.ndarray, a: float) -> None:
    # E8M0 exponent e: values 2^(e-128) * {0, +-1, ..., +-12} reach +-6 * 2^(e-127) ~ a
    raw[:, 0] = int(np.clip(127 + round(np.log2(a / 6)), 1, 254))


_RANDOM = {Q.MXFP4: _rand_mxfp4, Q.Q8_0: _rand_q8_0, Q.Q4_0: _rand_q4_0, Q.Q4_1: _rand_q4_1, Q.Q5_0: _rand_q5_0,
           Q.Q5_1: _rand_q5_1, Q.Q4_K: _rand_q4_k, Q.Q6_K: _rand_q6_k, **quantize_lo.RANDOM,
           **{q: (lambda raw, a, q=q: random_grid_blocks(raw, q, a)) for q in GRID_TYPES}}
