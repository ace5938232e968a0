"""Encoders for the grid ("i-quant") types: float32 rows -> GGUF blocks, and random blocks.

A simple, correct quantizer (no importance matrix, no neighbour tables: worse than llama.cpp's,
fine for tests and small exports). Per super-block of 256 weights:
  1. signs (IQ2/IQ3): the weights' own, except that where the code stores 7 sign bits per 8
     weights (ksigns: an even number of minus signs), the smallest |x| of an odd group is flipped;
  2. each scale group (16 or 32 weights) tries a few scales, each with the nearest code-book
     ("grid") entry for every 8 (or 4) weights, and keeps the one with the smallest squared error;
  3. the group scales are quantized against one f16 super-scale d, as the format stores them,
     and every group's nearest grid entries are chosen again for the scale the file will hold.
IQ1 types have no signs: grid values {-1, 0, 1} plus a delta of +-1/8, whose sign is one more
choice (per 32 weights for IQ1_S, per 8 for IQ1_M). The code books and the dequantization
formulas are gguf-py's (`gguf/quants.py`); block layouts: decoder/kernels/cpu/rows_iq.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gq

_TRIES = np.linspace(0.7, 1.3, 7)  # scale candidates, times the scale that maps max |x| to the grid's max
_KSIGN_TYPES = (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ3_XXS)


@dataclass(frozen=True)
class _Format:
    cls: type  # gguf-py's quant class (its code book and dequantizer)
    group: int  # weights per stored scale
    levels: int  # scale codes 0 .. levels - 1
    bias: float  # db = d * (bias + step * s) * factor, gguf-py's order of operations
    step: float
    factor: float


_FORMATS = {
    Q.IQ2_XXS: _Format(gq.IQ2_XXS, 32, 16, 0.5, 1, 0.25), Q.IQ2_XS: _Format(gq.IQ2_XS, 16, 16, 0.5, 1, 0.25),
    Q.IQ2_S: _Format(gq.IQ2_S, 16, 16, 0.5, 1, 0.25), Q.IQ3_XXS: _Format(gq.IQ3_XXS, 32, 16, 0.5, 1, 0.5),
    Q.IQ3_S: _Format(gq.IQ3_S, 32, 16, 1, 2, 1), Q.IQ1_S: _Format(gq.IQ1_S, 32, 8, 1, 2, 1),
    Q.IQ1_M: _Format(gq.IQ1_M, 16, 8, 1, 2, 1),
}
GRID_TYPES = frozenset(_FORMATS)


@lru_cache(maxsize=None)
def _grid(qtype: Q) -> np.ndarray:
    """[n_entries, entry_len] float64 code book; IQ1_M's has the delta in (+1/8 entries, then -1/8)."""
    cls = _FORMATS[qtype].cls
    cls.init_grid()
    g = np.asarray(cls.grid, dtype=np.float64).reshape(cls.grid_shape)
    if qtype == Q.IQ1_M:
        return np.concatenate([g + gq.IQ1_S.delta, g - gq.IQ1_S.delta])
    return g


def _nearest(t: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest grid row for every row of t ([..., E] -> [...]), in chunks."""
    flat = t.reshape(-1, grid.shape[1])
    norms = (grid * grid).sum(axis=1)  # [N]
    out = np.empty(len(flat), np.int64)
    step = max(1, (1 << 22) // len(grid))
    for i in range(0, len(flat), step):
        out[i:i + step] = (norms - 2.0 * flat[i:i + step] @ grid.T).argmin(axis=1)
    return out.reshape(t.shape[:-1])


def _fit(x: np.ndarray, db: np.ndarray, grid: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Nearest grid entries for x [..., group] at scales db [...] (+ delta): (idx, squared error)."""
    e = grid.shape[1]
    safe = np.where(db == 0, 1.0, db)[..., None]
    idx = _nearest((x / safe - delta).reshape(*x.shape[:-1], -1, e), grid)  # [..., group / e]
    rec = (grid[idx].reshape(x.shape) + delta) * db[..., None]
    return idx, ((x - rec) ** 2).sum(axis=-1)


def _signs(x: np.ndarray, qtype: Q) -> np.ndarray:
    """[n, 256] bool: negative signs to store (ksigns types: even per 8, smallest |x| flipped)."""
    neg = x < 0
    if qtype in _KSIGN_TYPES:
        g, a = neg.reshape(-1, 8), np.abs(x).reshape(-1, 8)
        odd = g.sum(axis=1) % 2 == 1
        g[np.flatnonzero(odd), a[odd].argmin(axis=1)] ^= True
    return neg


def _best_scales(target: np.ndarray, qtype: Q, deltas: tuple[float, ...]) -> np.ndarray:
    """Per scale group of target [n, S, group], the tried scale with the least error: [n, S]."""
    grid = _grid(qtype)
    top = np.abs(grid).max() + (abs(deltas[0]) if qtype == Q.IQ1_S else 0.0)
    base = np.abs(target).max(axis=-1) / top  # [n, S]
    best, best_err = base.copy(), np.full(base.shape, np.inf)
    for t in _TRIES:
        for delta in deltas:
            _, err = _fit(target, base * t, grid, delta)
            better = err < best_err
            best[better], best_err[better] = (base * t)[better], err[better]
    return best


def _scale_codes(db: np.ndarray, f: _Format) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group scales [n, S] -> (d as float16 [n], codes [n, S], the scales as the file gives them)."""
    top = (f.bias + f.step * (f.levels - 1)) * f.factor
    d16 = (db.max(axis=1) / top).astype(np.float16)  # [n]
    d = d16.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.rint((db / (d * f.factor) - f.bias) / f.step)
    s = np.clip(np.nan_to_num(s), 0, f.levels - 1).astype(np.int64)
    actual = d * (np.float32(f.bias) + np.float32(f.step) * s.astype(np.float32)) * np.float32(f.factor)
    return d16, s, actual.astype(np.float64)


def encode_grid(blocks: np.ndarray, qtype: Q) -> np.ndarray:
    """[n, 256] float32 -> [n, type_size] uint8 blocks of grid type `qtype`."""
    f, grid, n = _FORMATS[qtype], _grid(qtype), blocks.shape[0]
    x = blocks.astype(np.float64)
    neg = None if qtype in (Q.IQ1_S, Q.IQ1_M) else _signs(x, qtype)
    target = (x if neg is None else np.where(neg, -x, x)).reshape(n, 256 // f.group, f.group)
    delta = gq.IQ1_S.delta if qtype == Q.IQ1_S else 0.0
    d16, s, db = _scale_codes(_best_scales(target, qtype, (delta, -delta) if delta else (0.0,)), f)
    idx, err = _fit(target, db, grid, delta)
    neg_delta = None
    if qtype == Q.IQ1_S:  # the delta's sign: per sub-block, whichever fits better
        idx_m, err_m = _fit(target, db, grid, -delta)
        neg_delta = err_m < err
        idx = np.where(neg_delta[..., None], idx_m, idx)
    sign_bytes = None if neg is None else np.packbits(neg.reshape(n, 32, 8), axis=-1, bitorder="little")[..., 0]
    return _PACK[qtype](d16, s, idx.reshape(n, -1), sign_bytes, neg_delta)


def _u8(a: np.ndarray, dtype: type) -> np.ndarray:
    """Little-endian bytes of integer fields: [n, k] -> [n, k * itemsize] uint8."""
    return np.ascontiguousarray(a.astype(dtype)).view(np.uint8).reshape(a.shape[0], -1)


def _d(d16: np.ndarray) -> np.ndarray:
    return d16.reshape(-1, 1).view(np.uint8)  # [n, 2]


def _pairs(s: np.ndarray) -> np.ndarray:
    """4-bit codes, two per byte, low nibble first: [n, 2k] -> [n, k]."""
    return (s[:, 0::2] | (s[:, 1::2] << 4)).astype(np.uint8)


def _aux(sign_bytes: np.ndarray, s: np.ndarray) -> np.ndarray:
    """IQ2_XXS / IQ3_XXS u32 per sub-block: 4 x 7 sign bits, the 4-bit scale on top: [n, 8]."""
    s7 = (sign_bytes.reshape(-1, 8, 4) & 127).astype(np.int64)
    return s7[..., 0] | (s7[..., 1] << 7) | (s7[..., 2] << 14) | (s7[..., 3] << 21) | (s << 28)


def _pack_iq2_xxs(d16, s, idx, signs, _):
    n = len(d16)
    aux = _u8(_aux(signs, s), np.uint32).reshape(n, 8, 4)
    per_sub = np.concatenate([idx.reshape(n, 8, 4).astype(np.uint8), aux], axis=-1)  # 4 grid bytes, aux
    return np.concatenate([_d(d16), per_sub.reshape(n, 64)], axis=1)


def _pack_iq2_xs(d16, s, idx, signs, _):
    qs = idx | ((signs & 127).astype(np.int64) << 9)  # [n, 32]
    return np.concatenate([_d(d16), _u8(qs, np.uint16), _pairs(s)], axis=1)


def _pack_iq2_s(d16, s, idx, signs, _):
    high = ((idx >> 8) & 3).reshape(-1, 8, 4) << np.array([0, 2, 4, 6])
    return np.concatenate([_d(d16), (idx & 255).astype(np.uint8), signs, high.sum(-1).astype(np.uint8), _pairs(s)], 1)


def _pack_iq3_xxs(d16, s, idx, signs, _):
    return np.concatenate([_d(d16), idx.astype(np.uint8), _u8(_aux(signs, s), np.uint32)], axis=1)


def _pack_iq3_s(d16, s, idx, signs, _):
    high = ((idx >> 8) & 1).reshape(-1, 8, 8) << np.arange(8)
    return np.concatenate([_d(d16), (idx & 255).astype(np.uint8), high.sum(-1).astype(np.uint8), signs, _pairs(s)], 1)


def _pack_iq1_s(d16, s, idx, _, neg_delta):
    high = ((idx >> 8) & 7).reshape(-1, 8, 4) << np.array([0, 3, 6, 9])
    qh = high.sum(-1) | (s << 12) | (neg_delta.astype(np.int64) << 15)  # [n, 8]
    return np.concatenate([_d(d16), (idx & 255).astype(np.uint8), _u8(qh, np.uint16)], axis=1)


def _pack_iq1_m(d16, s, idx, _, __):
    neg_delta, idx = idx >= 2048, idx % 2048  # the +1/8 entries come first in IQ1_M's grid
    nib = ((idx >> 8) & 7) | (neg_delta.astype(np.int64) << 3)  # [n, 32]
    dbits = d16.view(np.uint16).astype(np.int64)[:, None] >> np.array([0, 4, 8, 12])  # [n, 4] d's nibbles
    sc = (s.reshape(-1, 4, 4) << np.array([0, 3, 6, 9])).sum(-1) | ((dbits & 15) << 12)
    return np.concatenate([(idx & 255).astype(np.uint8), _pairs(nib), _u8(sc, np.uint16)], axis=1)


_PACK = {Q.IQ2_XXS: _pack_iq2_xxs, Q.IQ2_XS: _pack_iq2_xs, Q.IQ2_S: _pack_iq2_s, Q.IQ3_XXS: _pack_iq3_xxs,
         Q.IQ3_S: _pack_iq3_s, Q.IQ1_S: _pack_iq1_s, Q.IQ1_M: _pack_iq1_m}


# -- random models --------------------------------------------------------------------------
def set_d(raw: np.ndarray, qtype: Q, d: float) -> None:
    """Set the f16 super-scale of every block of raw [n, type_size] (in place)."""
    bits = int(np.float16(d).view(np.uint16))
    if qtype == Q.IQ1_M:  # one nibble on top of each of the four u16 scales (bytes 49, 51, 53, 55)
        for i in range(4):
            raw[:, 49 + 2 * i] = (raw[:, 49 + 2 * i] & 0x0F) | (((bits >> (4 * i)) & 15) << 4)
    else:
        raw[:, 0:2] = np.frombuffer(np.uint16(bits).tobytes(), dtype=np.uint8)


@lru_cache(maxsize=None)
def _std_at_unit_d(qtype: Q) -> float:
    """Std of the weights of random blocks of `qtype` with d = 1 (measured once with gguf-py)."""
    raw = np.random.default_rng(0).integers(0, 256, size=(256, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    set_d(raw, qtype, 1.0)
    return float(gq.dequantize(raw, qtype).std())


def random_grid_blocks(raw: np.ndarray, qtype: Q, a: float) -> None:
    """Random bytes [n, type_size] made blocks of std ~ a / sqrt(3) (every byte pattern is a valid
    block: only the super-scale d is set)."""
    set_d(raw, qtype, a / np.sqrt(3.0) / _std_at_unit_d(qtype))
