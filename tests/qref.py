"""Reference dequantization for the tests: gguf-py's numpy code, and for Q1_0 (which gguf-py
does not dequantize) an independent numpy version written from ggml's block layout.

Q1_0 (ggml type 41), from llama.cpp ggml/src/ggml-common.h `block_q1_0` and
ggml/src/ggml-quants.c `dequantize_row_q1_0`: 128 weights in 18 bytes, an fp16 scale d, then
16 bytes of sign bits, weight j in bit j % 8 of byte j // 8; a set bit is +d, a clear one -d.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize


def q1_0_dequantize(raw: np.ndarray) -> np.ndarray:
    """[..., n_blocks * 18] uint8 -> [..., n_blocks * 128] float32."""
    lead = raw.shape[:-1]
    blocks = np.ascontiguousarray(raw).reshape(-1, 18)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    bits = np.unpackbits(blocks[:, 2:], axis=-1, bitorder="little")  # [n, 128]: bit j of the block
    out = np.where(bits == 1, d, -d)
    return out.reshape(*lead, -1)


def dequantize(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """Raw block bytes (rows on the last axis) -> float32 values, by gguf-py (or the Q1_0 reference)."""
    if Q(qtype) == Q.Q1_0:
        return q1_0_dequantize(raw)
    with np.errstate(over="ignore", invalid="ignore"):  # big random scales overflow to inf, in both
        return np.asarray(gguf_dequantize(raw, Q(qtype)), dtype=np.float32)
