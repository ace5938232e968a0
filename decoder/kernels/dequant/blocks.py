"""Dequantize raw GGUF tensor bytes with torch, on whatever device the bytes live on.

`dequantize(data, qtype, shape)` is bit-exact against gguf-py's numpy reference
(`gguf.quants.dequantize`): every kernel repeats that code's float32 arithmetic in the same
order (scales widened from float16 first, one rounding per operation, no fused multiply-add).
`shape` is in ggml order (ne0 = row length first); the result has torch shape
`tuple(reversed(shape))`, float32, on `data.device`.

Kernels take `blocks: [n, type_size] uint8` and fill `out: [n, block_size] float32` in place
(integer codes are copied in, then scaled in place: no float temporaries); the kernels for
the simple formats live here, the 256-element super-block ("K") formats in
`k.py`, the grid ("i-quant") formats in `iq.py`.
"""

from __future__ import annotations

import math
import operator
from functools import lru_cache
from typing import Sequence

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from .iq import IQ_KERNELS
from .k import K_KERNELS, Kernel, as_dtype, f16_field, lookup, lut, nibbles, shifted

# Decode in chunks of about this many input bytes on CPU, so intermediates stay in cache.
_CPU_CHUNK_BYTES = 1 << 20


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks[:, 2:].view(torch.int8))  # [n, 32]
    out.mul_(f16_field(blocks, 0))  # [n, 32] * [n, 1]


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(nibbles(blocks[:, 2:]))  # [n, 32]
    out.sub_(8)  # exact on small integers, so the same as gguf's int8 subtraction
    out.mul_(f16_field(blocks, 0))


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(nibbles(blocks[:, 4:]))  # [n, 32]
    out.mul_(f16_field(blocks, 0)).add_(f16_field(blocks, 2))


def _q5_bits(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """5-bit codes: nibbles of `low` [n, 16] plus bit i of the little-endian u32 `high` [n, 4]."""
    qh = shifted(high.unsqueeze(-1), range(8), 1)  # [n, 4, 8, 1] -> element 8*byte + bit
    return nibbles(low) | (qh.reshape(low.shape[0], 32) << 4)  # [n, 32]


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_q5_bits(blocks[:, 6:], blocks[:, 2:6]))  # [n, 32]
    out.sub_(16)
    out.mul_(f16_field(blocks, 0))


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_q5_bits(blocks[:, 8:], blocks[:, 4:8]))  # [n, 32]
    out.mul_(f16_field(blocks, 0)).add_(f16_field(blocks, 2))


def _iq4_nl(blocks: torch.Tensor, out: torch.Tensor) -> None:
    lookup(lut("iq4nl", blocks.device), nibbles(blocks[:, 2:]), out)  # [n, 32]
    out.mul_(f16_field(blocks, 0))


def _mxfp4(blocks: torch.Tensor, out: torch.Tensor) -> None:
    e = blocks[:, :1].to(torch.int32)  # [n, 1]
    # e8m0 -> float32 / 2: subnormal 2**(e-128) for e < 2, else exponent field e - 1
    bits = torch.where(e < 2, (e + 1) * 0x00200000, (e - 1) * (1 << 23))
    lookup(lut("mxfp4", blocks.device), nibbles(blocks[:, 1:]), out)  # [n, 32]
    out.mul_(bits.view(torch.float32))  # [n, 32] * [n, 1]


def _tq1_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    pow3 = _pow3(blocks.device)  # [5, 1] uint8: products wrap mod 256, as gguf-py's uint8 ones
    qs0 = (blocks[:, :32].unsqueeze(1) * pow3).reshape(n, 160)  # digit p of byte l -> 32p + l
    qs1 = (blocks[:, 32:48].unsqueeze(1) * pow3).reshape(n, 80)
    qh = (blocks[:, 48:52].unsqueeze(1) * pow3[:4]).reshape(n, 16)
    q = torch.cat([qs0, qs1, qh], dim=-1).to(torch.int16)  # [n, 256]
    out.copy_((q * 3) >> 8)
    out.sub_(1)
    out.mul_(f16_field(blocks, 52))


@lru_cache(maxsize=None)
def _pow3(device: torch.device) -> torch.Tensor:
    return torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8, device=device).reshape(5, 1)


def _tq2_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    out.copy_(shifted(blocks[:, :64].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 256))
    out.sub_(1)
    out.mul_(f16_field(blocks, 64))


def _q1_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """ggml's dequantize_row_q1_0 (llama.cpp ggml/src/ggml-quants.c): bit j%8 of qs[j//8]
    set -> +d, clear -> -d."""
    n = blocks.shape[0]
    bits = shifted(blocks[:, 2:18], range(8), 1).transpose(1, 2).reshape(n, 128)  # [n, 128]
    d = f16_field(blocks, 0)  # [n, 1]
    torch.where(bits.bool(), d, -d, out=out)


def _nvfp4(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    x = blocks[:, :4].to(torch.int32)  # [n, 4] UE4M3 scales, one per 16 values
    ex, man = (x >> 3) & 0xF, x & 7
    normal = (((ex + 119) << 23) | (man << 20)).view(torch.float32)  # (1 + man/8) * 2^(ex-7) / 2
    d = torch.where(ex == 0, man.to(torch.float32) * 2.0 ** -10, normal)
    d = torch.where((x == 0) | (x == 0x7F), torch.zeros_like(d), d)  # [n, 4]
    lookup(lut("mxfp4", blocks.device), nibbles(blocks[:, 4:].reshape(n, 4, 8)), out)  # [n, 64]
    out.view(n, 4, 16).mul_(d.unsqueeze(-1))  # * [n, 4, 1]


# type -> block kernel; F32/F16/BF16 are handled whole, without blocks
_KERNELS: dict[Q, Kernel] = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
    Q.IQ4_NL: _iq4_nl, Q.MXFP4: _mxfp4, Q.TQ1_0: _tq1_0, Q.TQ2_0: _tq2_0, Q.Q1_0: _q1_0, Q.NVFP4: _nvfp4,
    **K_KERNELS, **IQ_KERNELS,
}
_FLOATS = frozenset({Q.F32, Q.F16, Q.BF16})

SUPPORTED: frozenset[Q] = frozenset(_KERNELS) | _FLOATS


def _as_qtype(qtype: object) -> Q | None:
    """The enum member for `qtype` (plain ints from a reader are accepted), or None if unknown."""
    try:
        return Q(qtype)  # type: ignore[arg-type]
    except ValueError:
        return None


def _dims(shape: Sequence[int]) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(n) for n in shape)  # numpy ints welcome, floats not
    except TypeError:
        dims = ()
    if not dims or min(dims) < 0:
        raise ValueError(f"shape must be a non-empty sequence of non-negative ints, got {shape!r}")
    return dims


def byte_size(qtype: Q, shape: Sequence[int]) -> int:
    """Bytes a tensor of `shape` (ggml order) takes when stored as `qtype` (any ggml type)."""
    q = _as_qtype(qtype)
    if q is None or q not in GGML_QUANT_SIZES:
        raise ValueError(f"unknown quant type {qtype!r}")
    dims = _dims(shape)
    block, type_size = GGML_QUANT_SIZES[q]
    if dims[0] % block:
        raise ValueError(f"row length {dims[0]} is not a multiple of the {q.name} block size {block}")
    return math.prod(dims) // block * type_size


def _check(data: torch.Tensor, qtype: object, shape: Sequence[int], name: str) -> tuple[Q, int]:
    """Validate the request; return the type and the number of blocks."""
    q = _as_qtype(qtype)
    if q not in SUPPORTED:
        raise ValueError(f"tensor {name!r}: unsupported quant type {getattr(q, 'name', repr(qtype))}")
    if data.dtype != torch.uint8:
        raise ValueError(f"tensor {name!r}: expected raw bytes as torch.uint8, got {data.dtype}")
    try:
        expected = byte_size(q, shape)
    except ValueError as e:
        raise ValueError(f"tensor {name!r} ({q.name}): {e}") from None
    if data.numel() != expected:
        raise ValueError(f"tensor {name!r} ({q.name}, shape {tuple(shape)}): "
                         f"expected {expected} bytes, got {data.numel()}")
    return q, expected // GGML_QUANT_SIZES[q][1]


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
    qtype, n_blocks = _check(data, qtype, shape, name)
    flat = data.reshape(-1)  # [n_bytes]
    out_shape = tuple(reversed(_dims(shape)))
    if qtype in _FLOATS:
        return _floats(flat, qtype).reshape(out_shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = flat.view(n_blocks, type_size)  # [n, type_size]
    kernel = _KERNELS[qtype]
    out = torch.empty(n_blocks, block, dtype=torch.float32, device=flat.device)  # [n, block]
    chunk = max(1, _CPU_CHUNK_BYTES // type_size) if flat.device.type == "cpu" else max(n_blocks, 1)
    for i in range(0, n_blocks, chunk):  # chunks of many blocks, to bound temporaries
        kernel(blocks[i:i + chunk], out[i:i + chunk])
    return out.reshape(out_shape)
