"""Round-to-nearest encoders for the types gguf-py cannot quantize: Q2_K, Q3_K, IQ4_NL, IQ4_XS,
Q1_0 and NVFP4, plus their random-block generators (`RANDOM`). Each takes [n, block] float32
and returns [n, type_size] uint8 in the layout `decoder/kernels/cpu/rows_q.py` documents.

No importance matrix and no scale search (llama.cpp's quantizers do better): the scales are
set from each (sub-)block's extreme value, codes rounded to the nearest level. Q1_0 and NVFP4
follow llama.cpp's reference quantizers (ggml/src/ggml-quants.c `quantize_row_q1_0_ref`,
`quantize_row_nvfp4_ref`), which are that simple too.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

_KV_IQ4NL = np.array((-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113), np.float32)
_KV_E2M1X2 = np.array((0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12), np.float32)


def _f16(x: np.ndarray) -> np.ndarray:
    """[n] -> ([n, 2] bytes, [n] the float16 value as float32)."""
    h = x.astype(np.float16)
    return h.reshape(-1, 1).view(np.uint8), h.astype(np.float32)


def _inv(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x == 0, 0.0, 1.0 / x).astype(np.float32)


def _signed_max(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis, with its sign: [..., k] -> [...]."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _crumbs(q: np.ndarray) -> np.ndarray:
    """2-bit codes [n, 256] -> [n, 64]: element 128h + 32s + l at bits 2s of byte 32h + l."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _nibbles(q: np.ndarray, half: int) -> np.ndarray:
    """4-bit codes [n, G * 2 * half] -> [n, G * half]: per group, the first half in low nibbles."""
    q = q.reshape(q.shape[0], -1, 2, half).astype(np.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], -1)


def _nearest(x: np.ndarray, step: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Index of the level nearest x / step (first of ties, as ggml's best_index loops): x [..., k], step [..., 1]."""
    return np.abs(step[..., None] * levels - x[..., None]).argmin(axis=-1)


def encode_q2_k(blocks: np.ndarray) -> np.ndarray:
    """x ~ d*sc*q - dmin*m per 16 values, q in 0..3, sc and m in 0..15."""
    n, sub = blocks.shape[0], blocks.reshape(-1, 16, 16)
    lo = np.minimum(sub.min(axis=-1), 0.0)  # [n, 16]
    scale = (sub.max(axis=-1) - lo) / 3.0
    (db, d), (mb, dmin) = _f16(scale.max(axis=-1) / 15.0), _f16((-lo).max(axis=-1) / 15.0)
    sc = np.clip(np.ceil(scale * _inv(d)[:, None]), 0, 15)  # ceil: the range still fits in 0..3
    m = np.clip(np.rint(-lo * _inv(dmin)[:, None]), 0, 15)
    q = np.rint((sub + (dmin[:, None] * m)[..., None]) * _inv(d[:, None] * sc)[..., None])
    q = np.clip(q, 0, 3).reshape(n, 256)
    scales = (sc.astype(np.uint8) | (m.astype(np.uint8) << 4))
    return np.concatenate([scales, _crumbs(q), db, mb], axis=-1)


def encode_q3_k(blocks: np.ndarray) -> np.ndarray:
    """x ~ d*(sc - 32)*q per 16 values, q in -4..3 (the extreme value maps to -4)."""
    n, sub = blocks.shape[0], blocks.reshape(-1, 16, 16)
    scale = -_signed_max(sub) / 4.0  # [n, 16]
    db, d = _f16(np.abs(scale).max(axis=-1) / 31.0)
    s = np.clip(np.rint(scale * _inv(d)[:, None]), -32, 31)
    u = (np.clip(np.rint(sub * _inv(d[:, None] * s)[..., None]), -4, 3) + 4).astype(np.uint8).reshape(n, 256)
    hbits = (u >> 2).reshape(n, 8, 32)  # bit j of hmask[l]: element 32j + l
    hmask = np.bitwise_or.reduce(hbits << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)
    v = (s + 32).astype(np.uint8)  # [n, 16] 6-bit scales
    low = v[:, :8] & 0x0F | ((v[:, 8:] & 0x0F) << 4)
    hi = (v >> 4).reshape(n, 4, 4)  # scale 4r + b: bits 2r of byte 8 + b
    high = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    return np.concatenate([hmask, _crumbs(u & 3), low, high, db], axis=-1)


def encode_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """x ~ d * KV[q] per 32 values (the extreme value maps to -127)."""
    db, d = _f16(_signed_max(blocks) / -127.0)
    q = _nearest(blocks, d[:, None], _KV_IQ4NL)
    return np.concatenate([db, _nibbles(q, 16)], axis=-1)


def encode_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """x ~ d*(sc - 32)*KV[q] per 32 values, 6-bit sc."""
    n, sub = blocks.shape[0], blocks.reshape(-1, 8, 32)
    scale = _signed_max(sub) / -127.0  # [n, 8]
    db, d = _f16(np.abs(scale).max(axis=-1) / 31.0)
    s = np.clip(np.rint(scale * _inv(d)[:, None]), -32, 31)
    q = _nearest(sub, (d[:, None] * s)[..., None], _KV_IQ4NL).reshape(n, 256)
    v = (s + 32).astype(np.uint16)
    high = np.bitwise_or.reduce((v >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=-1).astype(np.uint16)
    low = _nibbles((v & 0x0F).astype(np.uint8), 1)  # scale j: nibble j % 2 of byte j // 2
    return np.concatenate([db, high.reshape(-1, 1).view(np.uint8), low, _nibbles(q, 16)], axis=-1)


def encode_q1_0(blocks: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q1_0_ref: d = mean |x| over 128 values, bit j = x_j >= 0."""
    db, _ = _f16(np.abs(blocks).sum(axis=-1, dtype=np.float32) / np.float32(128))
    return np.concatenate([db, np.packbits(blocks >= 0, axis=-1, bitorder="little")], axis=-1)


def encode_nvfp4(blocks: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_nvfp4_ref: per 16 values a UE4M3 scale of amax / 6, E2M1 codes."""
    n, sub = blocks.shape[0], blocks.reshape(-1, 4, 16)
    ue = gq.NVFP4.fp32_to_ue4m3(np.abs(sub).max(axis=-1) / np.float32(6.0)).astype(np.uint8)  # [n, 4]
    d = gq.NVFP4.ue4m3_to_fp32(ue).astype(np.float32)  # halved: E2M1 values are doubled
    q = _nearest(sub, d[..., None], _KV_E2M1X2).reshape(n, 64)
    return np.concatenate([ue, _nibbles(q, 8)], axis=-1)


ENCODERS = {Q.Q2_K: encode_q2_k, Q.Q3_K: encode_q3_k, Q.IQ4_NL: encode_iq4_nl, Q.IQ4_XS: encode_iq4_xs,
            Q.Q1_0: encode_q1_0, Q.NVFP4: encode_nvfp4}


# -- random blocks: raw random bytes with the scale fields set so values are ~U(-a, a) -----------
def _fill(raw: np.ndarray, start: int, value: float) -> None:
    raw[:, start:start + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)


def _rand_q2_k(raw: np.ndarray, a: float) -> None:
    b = a * 0.775  # x = (2b/3) q - b, q in 0..3 (sc = m = 8): std 0.745 b = a / sqrt(3)
    raw[:, :16] = 0x88
    _fill(raw, 80, 2 * b / 24)
    _fill(raw, 82, b / 8)


def _rand_q3_k(raw: np.ndarray, a: float) -> None:
    # 6-bit scales 48, 16 (sc - 32 = +-16) by fours: q in -4..3 averages -0.5, so the signs cancel it
    raw[:, 96:104], raw[:, 104:108] = 0x00, 0x77
    _fill(raw, 108, a / 64)


def _rand_iq4_xs(raw: np.ndarray, a: float) -> None:
    raw[:, 2:4], raw[:, 4:8] = 0xFF, 0x00  # every scale 48 (sc - 32 = 16)
    _fill(raw, 0, a / (16 * 127))


def _rand_nvfp4(raw: np.ndarray, a: float) -> None:
    # uniform codes: rms of the doubled E2M1 values is 5.85, so the (halved) scale is a / (sqrt(3) 5.85)
    raw[:, :4] = gq.NVFP4.fp32_to_ue4m3(np.array([a / 5.07], np.float32))[0]


def _rand_tq2_0(raw: np.ndarray, a: float) -> None:
    both = (raw[:, :64] >> 1) & raw[:, :64] & 0x55  # low bit of every 2-bit code 3
    raw[:, :64] &= ~(both << 1)  # 3 -> 1 (zero): codes -1, 0, 0, +1, std d / sqrt(2), mean 0
    _fill(raw, 64, a * np.sqrt(2.0 / 3.0))


RANDOM = {
    Q.Q2_K: _rand_q2_k, Q.Q3_K: _rand_q3_k, Q.IQ4_XS: _rand_iq4_xs, Q.NVFP4: _rand_nvfp4,
    Q.IQ4_NL: lambda raw, a: _fill(raw, 0, a / 127),
    Q.TQ1_0: lambda raw, a: _fill(raw, 52, a / np.sqrt(2.0)),  # any byte holds five digits 0..2
    Q.TQ2_0: _rand_tq2_0,
    Q.Q1_0: lambda raw, a: _fill(raw, 0, a / np.sqrt(3.0)),  # +-d: the same std as U(-a, a)
}
