"""Torch dequant kernels for the grid ("i-quant") types IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
IQ3_XXS, IQ3_S, on any device; registered in `blocks.py`'s table.

Each kernel repeats gguf-py's numpy `dequantize_blocks` (`gguf/quants.py`; ggml-quants.c's
`dequantize_row_iq*`) operation by operation in float32, so the result is bit-exact: the scale
(d * (0.5 + s)) * 0.25 (IQ2), * 0.5 (IQ3_XXS), d * (1 + 2 s) (IQ3_S) or d * (2 s + 1) (IQ1), times
the code-book ("grid") entries, times +-1 signs (IQ1: times grid + delta). Block layouts: the
table in `rows_iq.py`. The code books are gguf-py's (ggml's iq*_grid), as float32 tables
looked up with index_select.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from .k import Kernel, f16_field, shifted

_GRIDS = {"iq2xxs": gq.IQ2_XXS, "iq2xs": gq.IQ2_XS, "iq2s": gq.IQ2_S, "iq3xxs": gq.IQ3_XXS, "iq3s": gq.IQ3_S,
          "iq1s": gq.IQ1_S}
_DELTA = float(gq.IQ1_S.delta)  # 0.125, exact in float32


@lru_cache(maxsize=None)
def _grid(name: str, device: torch.device) -> torch.Tensor:
    """gguf-py's code book as float32 [n_entries, entry_len] on `device`."""
    cls = _GRIDS[name]
    cls.init_grid()
    return torch.from_numpy(np.array(cls.grid, dtype=np.float32).reshape(cls.grid_shape)).to(device)


@lru_cache(maxsize=None)
def _signs(device: torch.device) -> torch.Tensor:
    """[256, 8] float32: -1 where bit k of the byte is set, else +1."""
    bits = (np.arange(256)[:, None] >> np.arange(8)) & 1
    return torch.from_numpy(np.where(bits == 0, 1.0, -1.0).astype(np.float32)).to(device)


@lru_cache(maxsize=None)
def _ksigns(device: torch.device) -> torch.Tensor:
    """[128] int64: ggml's ksigns_iq2xs, 7 sign bits -> the byte with an even count of set bits."""
    return torch.tensor(list(gq.IQ2_XXS.ksigns), dtype=torch.int64, device=device)


@lru_cache(maxsize=None)
def _arange(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _u16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian uint16 fields: `[..., 2k] uint8 -> [..., k] int64`."""
    b = b.to(torch.int64)
    return b[..., 0::2] | (b[..., 1::2] << 8)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 fields: `[..., 4k] uint8 -> [..., k] int64`."""
    h = _u16(b)
    return h[..., 0::2] | (h[..., 1::2] << 16)


def _rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """table[idx] for integer idx of any shape: [*idx.shape, table.shape[1]]."""
    return torch.index_select(table, 0, idx.reshape(-1).to(torch.int32)).reshape(*idx.shape, table.shape[1])


def _sign_rows(sign_bytes: torch.Tensor) -> torch.Tensor:
    return _rows(_signs(sign_bytes.device), sign_bytes)  # [..., 8]


def _scaled(d: torch.Tensor, s: torch.Tensor, bias: float, factor: float) -> torch.Tensor:
    """(d * (bias + s)) * factor in float32, gguf-py's order: d [n, 1], s [n, k] ints -> [n, k]."""
    return d * (s.to(torch.float32) + bias) * factor


def _nibbles_interleaved(b: torch.Tensor) -> torch.Tensor:
    """`[n, k] uint8 -> [n, 2k]`: low then high nibble of each byte, byte by byte (gguf's scales)."""
    return shifted(b.unsqueeze(-1), (0, 4), 0x0F).reshape(b.shape[0], -1)  # [n, 2k]


def _iq2_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs = blocks[:, 2:].reshape(n, 8, 8)  # per sub-block: 4 grid indices, then u32 aux
    aux = _u32(qs[:, :, 4:])  # [n, 8, 1]
    db = _scaled(f16_field(blocks, 0), aux[..., 0] >> 28, 0.5, 0.25)  # [n, 8]
    sign_idx = (aux >> _arange((0, 7, 14, 21), blocks.device)) & 127  # [n, 8, 4]
    o = out.view(n, 8, 4, 8)
    o.copy_(_rows(_grid("iq2xxs", blocks.device), qs[:, :, :4]))  # [n, 8, 4, 8]
    o.mul_(db[..., None, None]).mul_(_sign_rows(_ksigns(blocks.device)[sign_idx]))


def _iq2_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs = _u16(blocks[:, 2:66])  # [n, 32]: 9-bit grid index, 7-bit sign index
    db = _scaled(f16_field(blocks, 0), _nibbles_interleaved(blocks[:, 66:74]), 0.5, 0.25)  # [n, 16]
    o = out.view(n, 16, 2, 8)
    o.copy_(_rows(_grid("iq2xs", blocks.device), qs & 511).view(n, 16, 2, 8))
    o.mul_(db[..., None, None]).mul_(_sign_rows(_ksigns(blocks.device)[qs >> 9]).view(n, 16, 2, 8))


def _iq2_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs, signs, qh = blocks[:, 2:34], blocks[:, 34:66], blocks[:, 66:74]
    high = shifted(qh.unsqueeze(-1), (0, 2, 4, 6), 3).reshape(n, 32)  # 2 index bits per grid entry
    idx = qs.to(torch.int64) | (high.to(torch.int64) << 8)  # [n, 32]
    db = _scaled(f16_field(blocks, 0), _nibbles_interleaved(blocks[:, 74:82]), 0.5, 0.25)  # [n, 16]
    o = out.view(n, 16, 2, 8)
    o.copy_(_rows(_grid("iq2s", blocks.device), idx).view(n, 16, 2, 8))
    o.mul_(db[..., None, None]).mul_(_sign_rows(signs).view(n, 16, 2, 8))


def _iq3_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    aux = _u32(blocks[:, 66:98])  # [n, 8]: 4 x 7 sign bits, scale in bits 28-31
    db = _scaled(f16_field(blocks, 0), aux >> 28, 0.5, 0.5)  # [n, 8]
    sign_idx = (aux.unsqueeze(-1) >> _arange((0, 7, 14, 21), blocks.device)) & 127  # [n, 8, 4]
    o = out.view(n, 8, 4, 8)
    o.copy_(_rows(_grid("iq3xxs", blocks.device), blocks[:, 2:66]).view(n, 8, 4, 8))  # 64 entries of 4
    o.mul_(db[..., None, None]).mul_(_sign_rows(_ksigns(blocks.device)[sign_idx]))


def _iq3_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs, qh, signs = blocks[:, 2:66], blocks[:, 66:74], blocks[:, 74:106]
    high = shifted(qh.unsqueeze(-1), range(8), 1).reshape(n, 64)  # one index bit per grid entry
    idx = qs.to(torch.int64) | (high.to(torch.int64) << 8)  # [n, 64]
    sc = _nibbles_interleaved(blocks[:, 106:110]).to(torch.int32)  # [n, 8]
    db = f16_field(blocks, 0) * (1 + 2 * sc).to(torch.float32)  # [n, 8]
    o = out.view(n, 8, 4, 8)
    o.copy_(_rows(_grid("iq3s", blocks.device), idx).view(n, 8, 4, 8))
    o.mul_(db[..., None, None]).mul_(_sign_rows(signs).view(n, 8, 4, 8))


def _iq1_grid(out: torch.Tensor, idx: torch.Tensor, delta_neg: torch.Tensor) -> None:
    """out [n, 32, 8] = grid[idx] + delta, delta -0.125 where delta_neg, else +0.125 ([n, 32])."""
    out.copy_(_rows(_grid("iq1s", idx.device), idx))
    delta = torch.where(delta_neg, -_DELTA, _DELTA).to(torch.float32)  # [n, 32]
    out.add_(delta.unsqueeze(-1))


def _iq1_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qh = _u16(blocks[:, 34:50])  # [n, 8]: 4 x 3 index bits, 3-bit scale, delta sign
    high = (qh.unsqueeze(-1) >> _arange((0, 3, 6, 9), blocks.device)) & 7  # [n, 8, 4]
    idx = blocks[:, 2:34].to(torch.int64) | (high.reshape(n, 32) << 8)  # [n, 32]
    neg = ((qh & 0x8000) != 0).unsqueeze(-1).expand(n, 8, 4).reshape(n, 32)
    _iq1_grid(out.view(n, 32, 8), idx, neg)
    dl = f16_field(blocks, 0) * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)  # [n, 8]
    out.view(n, 8, 32).mul_(dl.unsqueeze(-1))


def _iq1_m_scale(sc: torch.Tensor) -> torch.Tensor:
    """The f16 d split over the top nibbles of the four u16 scales: [n, 4] -> [n, 1] float32."""
    bits = ((sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000))  # [n]
    halves = torch.stack([bits & 0xFF, bits >> 8], dim=-1).to(torch.uint8)  # [n, 2]
    return halves.view(torch.float16).to(torch.float32)  # [n, 1]


def _iq1_m(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    sc = _u16(blocks[:, 48:56])  # [n, 4]: four 3-bit scales each, d's nibble on top
    nib = _nibbles_interleaved(blocks[:, 32:48]).to(torch.int64)  # [n, 32]: 3 index bits, delta sign
    idx = blocks[:, :32].to(torch.int64) | ((nib & 7) << 8)
    _iq1_grid(out.view(n, 32, 8), idx, (nib & 8) != 0)
    s = ((sc.unsqueeze(-1) >> _arange((0, 3, 6, 9), blocks.device)) & 7).reshape(n, 16)
    dl = _iq1_m_scale(sc) * (2 * s + 1).to(torch.float32)  # [n, 16]
    out.view(n, 16, 16).mul_(dl.unsqueeze(-1))


IQ_KERNELS: dict[Q, Kernel] = {
    Q.IQ2_XXS: _iq2_xxs, Q.IQ2_XS: _iq2_xs, Q.IQ2_S: _iq2_s, Q.IQ3_XXS: _iq3_xxs, Q.IQ3_S: _iq3_s,
    Q.IQ1_S: _iq1_s, Q.IQ1_M: _iq1_m,
}
