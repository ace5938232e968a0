"""Dequantize raw GGUF tensor bytes with torch, on whatever device the bytes live on.

`dequantize(data, qtype, shape)` is bit-exact against gguf-py's numpy reference
(`gguf.quants.dequantize`): every kernel repeats that code's float32 arithmetic in the same
order (scales widened from float16 first, one rounding per operation, no fused multiply-add).
`shape` is in ggml order (ne0 = row length first); the result has torch shape
`tuple(reversed(shape))`, float32, on `data.device`.

Kernels take `blocks: [n, type_size] uint8` and return `[n, block_size] float32`; the block
kernels for the simple formats live here, the 256-element super-block ("K") formats in
`dequant_k.py`.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from .dequant_k import K_KERNELS, as_dtype, f16_field, lut, nibbles, shifted

Kernel = Callable[[torch.Tensor], torch.Tensor]

# Decode in chunks of about this many input bytes on CPU, so intermediates stay in cache.
_CPU_CHUNK_BYTES = 1 << 20


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)  # [n, 1]
    return blocks[:, 2:].view(torch.int8) * d  # int8 * f32 -> f32, [n, 32]


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)  # [n, 1]
    q = nibbles(blocks[:, 2:]).to(torch.int8) - 8  # [n, 32]
    return d * q


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)  # [n, 1]
    q = nibbles(blocks[:, 4:])  # [n, 32]
    return (d * q) + m


def _q5_bits(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """5-bit codes: nibbles of `low` [n, 16] plus bit i of the little-endian u32 `high` [n, 4]."""
    qh = shifted(high.unsqueeze(-1), range(8), 1)  # [n, 4, 8, 1] -> element 8*byte + bit
    return nibbles(low) | (qh.reshape(low.shape[0], 32) << 4)  # [n, 32]


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)  # [n, 1]
    q = _q5_bits(blocks[:, 6:], blocks[:, 2:6]).to(torch.int8) - 16  # [n, 32]
    return d * q


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = f16_field(blocks, 0), f16_field(blocks, 2)  # [n, 1]
    q = _q5_bits(blocks[:, 8:], blocks[:, 4:8])  # [n, 32]
    return (d * q) + m


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    d = f16_field(blocks, 0)  # [n, 1]
    q = nibbles(blocks[:, 2:])  # [n, 32]
    return d * lut("iq4nl", blocks.device)[q.long()]


def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    e = blocks[:, :1].to(torch.int32)  # [n, 1]
    # e8m0 -> float32 / 2: subnormal 2**(e-128) for e < 2, else exponent field e - 1
    bits = torch.where(e < 2, (e + 1) * 0x00200000, (e - 1) * (1 << 23))
    d = bits.view(torch.float32)  # [n, 1]
    q = nibbles(blocks[:, 1:])  # [n, 32]
    return d * lut("mxfp4", blocks.device)[q.long()]


# type -> block kernel; F32/F16/BF16 are handled whole, without blocks
_KERNELS: dict[Q, Kernel] = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
    Q.IQ4_NL: _iq4_nl, Q.MXFP4: _mxfp4, **K_KERNELS,
}
_FLOATS = frozenset({Q.F32, Q.F16, Q.BF16})

SUPPORTED: frozenset[Q] = frozenset(_KERNELS) | _FLOATS


def _qtype_name(qtype: object) -> str:
    return getattr(qtype, "name", repr(qtype))


def byte_size(qtype: Q, shape: Sequence[int]) -> int:
    """Bytes a tensor of `shape` (ggml order) takes when stored as `qtype`."""
    if qtype not in GGML_QUANT_SIZES:
        raise ValueError(f"unknown quant type {_qtype_name(qtype)}")
    dims = tuple(shape)
    if not dims or any(not isinstance(n, int) or n < 0 for n in dims):
        raise ValueError(f"shape must be a non-empty sequence of non-negative ints, got {shape!r}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    if dims[0] % block:
        raise ValueError(f"row length {dims[0]} is not a multiple of the {qtype.name} block size {block}")
    return math.prod(dims) // block * type_size


def _check(data: torch.Tensor, qtype: Q, shape: Sequence[int], name: str) -> int:
    """Validate the request; return the number of blocks."""
    if qtype not in SUPPORTED:
        raise ValueError(f"tensor {name!r}: unsupported quant type {_qtype_name(qtype)}")
    if data.dtype != torch.uint8:
        raise ValueError(f"tensor {name!r}: expected raw bytes as torch.uint8, got {data.dtype}")
    try:
        expected = byte_size(qtype, shape)
    except ValueError as e:
        raise ValueError(f"tensor {name!r} ({qtype.name}): {e}") from None
    if data.numel() != expected:
        raise ValueError(f"tensor {name!r} ({qtype.name}, shape {tuple(shape)}): "
                         f"expected {expected} bytes, got {data.numel()}")
    return expected // GGML_QUANT_SIZES[qtype][1]


def _floats(flat: torch.Tensor, qtype: Q) -> torch.Tensor:
    if qtype == Q.F32:
        return as_dtype(flat, torch.float32).clone()  # clone: never alias the caller's buffer
    if qtype == Q.F16:
        return as_dtype(flat, torch.float16).float()
    # BF16 is the high half of a float32: shift the bits up (keeps NaN payloads, like gguf)
    return (as_dtype(flat, torch.int16).to(torch.int32) << 16).view(torch.float32)


def dequantize(data: torch.Tensor, qtype: Q, shape: Sequence[int], *, name: str = "tensor") -> torch.Tensor:
    """Decode the raw GGUF bytes of one tensor (or one expert's slice) to float32.

    `data` is uint8 on any device, `shape` in ggml order; returns float32 of torch shape
    `tuple(reversed(shape))` on `data.device`. Raises ValueError naming the tensor when the
    type is unsupported or the byte count or row length does not fit the shape.
    """
    n_blocks = _check(data, qtype, shape, name)
    flat = data.reshape(-1)  # [n_bytes]
    out_shape = tuple(reversed(tuple(shape)))
    if qtype in _FLOATS:
        return _floats(flat, qtype).reshape(out_shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = flat.view(n_blocks, type_size)  # [n, type_size]
    kernel = _KERNELS[qtype]
    chunk = max(1, _CPU_CHUNK_BYTES // type_size) if flat.device.type == "cpu" else n_blocks
    if n_blocks <= chunk:
        return kernel(blocks).reshape(out_shape)
    out = torch.empty(n_blocks, block, dtype=torch.float32, device=flat.device)  # [n, block]
    for i in range(0, n_blocks, chunk):  # chunks of many blocks, to bound temporaries
        out[i:i + chunk] = kernel(blocks[i:i + chunk])
    return out.reshape(out_shape)
