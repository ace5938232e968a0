"""Super-block (QK_K = 256) dequant kernels, plus the byte-unpacking helpers all kernels share.

Each kernel mirrors gguf-py's numpy `dequantize_blocks` for its type operation by operation
(see `blocks.py`); the bit-unpacking may differ in form but yields the same integers.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Iterable

import torch
from gguf import GGMLQuantizationType as Q

# A kernel decodes blocks [n, type_size] uint8 into out [n, block_size] float32, in place.
Kernel = Callable[[torch.Tensor, torch.Tensor], None]

# IQ4_NL / IQ4_XS non-linear code book; MXFP4 e2m1 values doubled (its scale is halved)
_TABLES = {
    "iq4nl": (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
    "mxfp4": (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12),
}


@lru_cache(maxsize=None)
def lut(name: str, device: torch.device) -> torch.Tensor:
    """A float32 code-book, built once per device."""
    return torch.tensor(_TABLES[name], dtype=torch.float32, device=device)  # [16]


@lru_cache(maxsize=None)
def _shift_amounts(shifts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(shifts, dtype=torch.uint8, device=device).reshape(-1, 1)  # [S, 1]


def shifted(q: torch.Tensor, shifts: Iterable[int], mask: int) -> torch.Tensor:
    """Bit fields of every byte: `[..., L] uint8 -> [..., S, L]`, `(q >> shifts[s]) & mask`."""
    amounts = _shift_amounts(tuple(shifts), q.device)  # [S, 1]
    return (q.unsqueeze(-2) >> amounts) & mask  # [..., S, L]


def nibbles(q: torch.Tensor) -> torch.Tensor:
    """`[..., L] uint8 -> [..., 2L]`: all low nibbles, then all high nibbles (ggml's order)."""
    return torch.cat([q & 0x0F, q >> 4], dim=-1)  # [..., 2L]


def lookup(table: torch.Tensor, codes: torch.Tensor, out: torch.Tensor) -> None:
    """out[...] = table[codes] for uint8 `codes` with as many elements as `out` (contiguous)."""
    torch.index_select(table, 0, codes.reshape(-1).to(torch.int32), out=out.view(-1))


def as_dtype(flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret 1-D bytes as `dtype`; copies first when the bytes are not aligned for it."""
    if flat.storage_offset() % dtype.itemsize:
        flat = flat.clone()
    return flat.view(dtype)


def f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, widened to float32: `[n, type_size] -> [n, 1]`."""
    field = blocks[:, start:start + 2]  # [n, 2]
    if field.storage_offset() % 2 or blocks.stride(0) % 2:
        field = field.clone(memory_format=torch.contiguous_format)  # dtype views need aligned rows
    return field.view(torch.float16).float()  # [n, 1]


def _q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]  # [n, 16], [n, 64]
    d, dmin = f16_field(blocks, 80), f16_field(blocks, 82)  # [n, 1]
    o = out.view(n, 16, 16)
    o.copy_(shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16))
    o.mul_((d * (scales & 0x0F)).unsqueeze(-1))  # * [n, 16, 1]
    o.sub_((dmin * (scales >> 4)).unsqueeze(-1))  # - [n, 16, 1]


def _q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    hmask, qs, scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    # 6-bit scales: low nibbles from bytes 0-7, high 2 bits from bytes 8-11
    low = nibbles(scales[:, :8])  # [n, 16]
    high = shifted(scales[:, 8:], (0, 2, 4, 6), 3).reshape(n, 16)
    dl = f16_field(blocks, 108) * ((low | (high << 4)).to(torch.int8) - 32)  # [n, 16]
    ql = shifted(qs.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16)
    qh = shifted(hmask, range(8), 1).reshape(n, 16, 16)
    o = out.view(n, 16, 16)
    o.copy_(ql | (qh << 2))
    o.sub_(4)  # ql - 4 where the mask bit is 0, ql where it is 1
    o.mul_(dl.unsqueeze(-1))  # * [n, 16, 1]


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 6-bit (scale, min) pairs packed in 12 bytes: `[n, 12] -> ([n, 8], [n, 8])`."""
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]  # [n, 4] each
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], dim=-1)
    mn = torch.cat([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], dim=-1)
    return sc, mn


def _apply_k4_scales(blocks: torch.Tensor, o: torch.Tensor) -> None:
    """o [n, 8, 32] holds the codes; make it d * sc * q - dmin * m."""
    sc, mn = _scale_min_k4(blocks[:, 4:16])  # [n, 8]
    o.mul_((f16_field(blocks, 0) * sc).unsqueeze(-1))  # * [n, 8, 1]
    o.sub_((f16_field(blocks, 2) * mn).unsqueeze(-1))  # - [n, 8, 1]


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    o = out.view(n, 8, 32)
    o.copy_(nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32))
    _apply_k4_scales(blocks, o)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    ql = nibbles(blocks[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = shifted(blocks[:, 16:48], range(8), 1)  # [n, 8, 32]
    o = out.view(n, 8, 32)
    o.copy_(ql | (qh << 4))
    _apply_k4_scales(blocks, o)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    low = nibbles(ql.reshape(n, 2, 64)).reshape(n, 16, 16)
    high = shifted(qh.reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 16, 16)
    dl = f16_field(blocks, 208) * blocks[:, 192:208].view(torch.int8)  # [n, 16]
    o = out.view(n, 16, 16)
    o.copy_(low | (high << 4))
    o.sub_(32)
    o.mul_(dl.unsqueeze(-1))  # * [n, 16, 1]


def _iq4_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    # 6-bit scales: a nibble each from bytes 4-7 (low first), 2 bits each from the u16 at 2-3
    low = shifted(blocks[:, 4:8].unsqueeze(-1), (0, 4), 0x0F).reshape(n, 8)
    high = shifted(blocks[:, 2:4].unsqueeze(-1), (0, 2, 4, 6), 3).reshape(n, 8)
    dl = f16_field(blocks, 0) * ((low | (high << 4)).to(torch.int8) - 32)  # [n, 8]
    lookup(lut("iq4nl", blocks.device), nibbles(blocks[:, 8:].reshape(n, 8, 16)), out)
    out.view(n, 8, 32).mul_(dl.unsqueeze(-1))  # * [n, 8, 1]


K_KERNELS: dict[Q, Kernel] = {
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.IQ4_XS: _iq4_xs,
}
