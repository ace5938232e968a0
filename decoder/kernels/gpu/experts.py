"""Fused MoE expert kernels in Triton: a layer's routed experts computed on raw GGUF blocks
straight from device slot memory.

Slot memory is a uint8 tensor ``blobs [n_slots, slot_bytes]``; every expert of a layer has its
gate/up/down parts at the same offsets (`slot_format.SlotLayout`). A `spare [n_spare,
slot_bytes]` tensor holds experts served without a slot (the cache full of pins): slot ids
>= n_slots index it. `mix(...)` computes sum_j w[t, j] * expert_{ids[t, j]}(x_t):

Decode (N <= DECODE_MAX_ROWS token rows): three launches, no host sync.
  1. `_gate_up_kernel`, grid (N*k assignments, ff tiles): h[a] = silu(gate x_t) * (up x_t),
     float32, each weight tile decoded in registers (`quant.decode`) and dotted with x_t.
  2. `_down_kernel`, grid (N*k, d tiles): y[a] = w[a] * (down h[a]), float32; then
     `_sum_kernel`, grid (N, d tiles): out[t] = the token's k rows of y summed in ascending
     expert order, one program per element: a fixed order, so the result does not depend on
     which slot an expert sits in or when it arrived (streamed == resident bit for bit), and
     no atomics. (Summing inside the down kernel would leave only N * d / BN programs: 128 for
     one token of d = 2048, a fraction of a large GPU's parallelism.)
  The kernels read the routed ids and look their slots up in the slot map (a device tensor)
  themselves, and `_sum_kernel` ranks each token's experts by id: no torch op around them.
Prefill (more rows): each routed expert's matrices are dequantized by one `quant`
launch each into the model dtype and multiplied by torch (tensor cores), summed in ascending
expert order; grouping rows by expert costs one host sync per layer. (Not measured against a
grouped tensor-core Triton kernel: no GPU was available when this was written.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gguf import GGMLQuantizationType

from ....common.arch import EXPERT_ACTS, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from . import quant as tq
from ...experts.gpu.slot_format import SlotLayout
from ...experts.source import activate

DECODE_MAX_ROWS = 4  # token rows per call up to which the fused matrix-vector kernels run
SUM_BLOCK = 1024  # elements per program of the ascending-expert sum


@triton.jit
def _slot_base(blobs, spare, slot, n_slots, slot_bytes):
    """Pointer to a slot's first byte: `blobs[slot]`, or `spare[slot - n_slots]` past the cache."""
    if slot < n_slots:
        base = blobs + slot * slot_bytes
    else:
        base = spare + (slot - n_slots) * slot_bytes
    return base


@triton.jit
def _matvec(mat, rows, v, n_in, row_bytes, lut, QT: tl.constexpr, BK: tl.constexpr):
    """float32 [BN]: rows [BN] (int64) of the quantized matrix at `mat` dotted with the vector
    at pointer v (n_in values, any float type), BK columns (BK // 32 groups) per step."""
    r3 = rows[:, None, None]  # [BN, 1, 1]
    cols = 32 * tl.arange(0, BK // 32)[None, :, None] + tl.arange(0, 32)[None, None, :]  # [1, G, 32]
    # per-element partial sums, reduced once after the loop: a reduction per step costs warp
    # shuffles wherever the decoder's loads lay a group's lanes across threads (sm_90 PTX, 16 x 256
    # tile: 6 shuffles per weight for Q8_0 and the IQ types, loop 23.8 -> 10.5 instructions per
    # weight for Q8_0), for 30-60 more registers (136-254). Not timed on a GPU yet.
    acc = tl.zeros([rows.shape[0], BK // 32, 32], dtype=tl.float32)  # [BN, G, 32]
    for k0 in range(0, n_in, BK):
        xv = tl.load(v + k0 + cols).to(tl.float32)  # [1, G, 32]
        acc += tq.decode(mat, r3, k0, row_bytes, lut, QT, BK // 32) * xv  # [BN, G, 32]
    return tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]


@triton.jit
def _expert_base(blobs, spare, ids, slot_map, a, n_slots, slot_bytes):
    """Slot memory of assignment a's expert: ids[a] looked up in the device slot map."""
    slot = tl.load(slot_map + tl.load(ids + a)).to(tl.int64)
    return _slot_base(blobs, spare, slot, n_slots, slot_bytes)


@triton.jit
def _part_offset(offs, ids, a, which, uniform, PER_EXPERT: tl.constexpr):
    """Where assignment a's expert keeps matrix `which` (0 gate, 1 up, 2 down) in its slot: the
    layer's one offset, or (experts laid out each their own way: leased arena slots read in
    place) its row of the offsets table [n_expert, 3]."""
    if PER_EXPERT:
        return tl.load(offs + tl.load(ids + a).to(tl.int64) * 3 + which)
    return uniform.to(tl.int64)


@triton.jit
def _bias(base, off, rows):
    """float32 [BN]: rows of the F32 bias vector at byte `off` of an expert's slot."""
    return tl.load((base + off).to(tl.pointer_type(tl.float32)) + rows)


@triton.jit
def _gate_up_kernel(blobs, spare, ids, slot_map, offs, x, h, lut_g, lut_u, n_slots, slot_bytes, gate_off, up_off,
                    g_row_bytes, u_row_bytes, d, ff, gb_off, ub_off, alpha, limit, K: tl.constexpr,
                    QG: tl.constexpr, QU: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    PER_EXPERT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr):
    a = tl.program_id(0)  # assignment (token a // K, its expert ids[a])
    t = (a // K).to(tl.int64)
    base = _expert_base(blobs, spare, ids, slot_map, a, n_slots, slot_bytes)
    gate_off = _part_offset(offs, ids, a, 0, gate_off, PER_EXPERT)
    up_off = _part_offset(offs, ids, a, 1, up_off, PER_EXPERT)
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN]
    mask = n < ff
    rows = tl.where(mask, n, 0).to(tl.int64)  # [BN]; masked rows read row 0
    g = _matvec(base + gate_off, rows, x + t * d, d, g_row_bytes, lut_g, QG, BK)  # [BN]
    u = _matvec(base + up_off, rows, x + t * d, d, u_row_bytes, lut_u, QU, BK)  # [BN]
    if HAS_BIAS:  # gpt-oss: biases added before the activation
        g += _bias(base, gb_off, rows)
        u += _bias(base, ub_off, rows)
    if ACT == 1:  # gpt-oss's clamped SwiGLU: g min'd at limit, u clamped to +-limit, (u + 1)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        act = g * tl.sigmoid(g * alpha) * (u + 1.0)
    else:
        act = g / (1.0 + tl.exp(-g)) * u
    tl.store(h + a * ff + n, act, mask=mask)


@triton.jit
def _down_kernel(blobs, spare, ids, slot_map, offs, weights, h, y, lut_d, n_slots, slot_bytes, down_off, row_bytes,
                 d, ff, db_off, QD: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PER_EXPERT: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    a = tl.program_id(0)  # assignment
    base = _expert_base(blobs, spare, ids, slot_map, a, n_slots, slot_bytes)
    down_off = _part_offset(offs, ids, a, 2, down_off, PER_EXPERT)
    n = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] output features
    mask = n < d
    rows = tl.where(mask, n, 0).to(tl.int64)  # [BN]
    acc = _matvec(base + down_off, rows, h + a * ff, ff, row_bytes, lut_d, QD, BK)  # [BN]
    if HAS_BIAS:
        acc += _bias(base, db_off, rows)
    tl.store(y + a * d + n, tl.load(weights + a).to(tl.float32) * acc, mask=mask)


@triton.jit
def _sum_kernel(y, ids, out, d, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < d
    # rank of each of the token's K experts by id (ties by position): the summation order
    j = tl.arange(0, KP)
    e = tl.load(ids + t * K + j, mask=j < K, other=0x7FFFFFFF).to(tl.int64)  # [KP]
    before = (e[None, :] < e[:, None]) | ((e[None, :] == e[:, None]) & (j[None, :] < j[:, None]))  # [KP, KP]
    rank = tl.sum(before.to(tl.int32), axis=1)  # [KP]
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in range(K):  # ascending expert id: a fixed order, whatever order the router gave
        pick = tl.sum(tl.where(rank == r, j, 0))  # the position holding the r-th smallest id
        acc += tl.load(y + (t * K + pick) * d + n, mask=mask, other=0.0)
    tl.store(out + t * d + n, acc.to(out.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Part:
    """One matrix of an expert inside its slot."""

    offset: int  # bytes from the slot's start
    qtype: int
    n_out: int
    n_in: int

    @property
    def row_bytes(self) -> int:
        block, size = tq.block_of(self.qtype)
        return self.n_in // block * size


@dataclass(frozen=True)
class ExpertMats:
    """gate, up, down of one layer's experts as slot offsets (a fused gate_up is split), and
    their F32 biases' offsets where the family has them (gpt-oss)."""

    gate: Part
    up: Part
    down: Part
    bias: tuple[int, int, int] | None = None  # byte offsets of the gate, up, down biases in the slot

    @property
    def d(self) -> int:
        return self.gate.n_in

    @property
    def ff(self) -> int:
        return self.gate.n_out


def expert_mats(lay: SlotLayout) -> ExpertMats | None:
    """The layer's matrices, or None where a part has no kernel (or an unknown part exists)."""
    mats, biases = {}, {}
    for p in lay.parts:
        off = lay.ranges[p.name][0]
        if p.name.endswith(".bias"):
            if p.qtype != GGMLQuantizationType.F32:
                return None  # (the files have F32 biases)
            name = p.name.removesuffix(".bias")
            if name == "gate_up":
                biases["gate"], biases["up"] = off, off + p.nbytes // 2
            else:
                biases[name] = off
            continue
        if not tq.has_kernel(p.qtype) or p.name not in ("gate", "up", "down", "gate_up"):
            return None
        n_in, n_out = p.shape[0], p.shape[1]
        if p.name == "gate_up":
            half = Part(off, int(p.qtype), n_out // 2, n_in)
            mats["gate"] = half
            mats["up"] = Part(half.offset + half.n_out * half.row_bytes, half.qtype, half.n_out, n_in)
        else:
            mats[p.name] = Part(off, int(p.qtype), n_out, n_in)
    if set(mats) != {"gate", "up", "down"} or (biases and set(biases) != {"gate", "up", "down"}):
        return None
    bias = (biases["gate"], biases["up"], biases["down"]) if biases else None
    return ExpertMats(mats["gate"], mats["up"], mats["down"], bias)


class SlotKernels:
    """The fused path of one slot store: `mix` for any layer whose types all have kernels."""

    def __init__(self, layouts: list[SlotLayout], device: torch.device, act: str = "swiglu") -> None:
        if act not in EXPERT_ACTS:
            raise ValueError(f"unknown expert activation {act!r} (have: {', '.join(EXPERT_ACTS)})")
        self.mats = [expert_mats(lay) for lay in layouts]  # per layer; None: torch fallback
        self.device, self.act = device, act
        self._luts: dict[int, torch.Tensor] = {}

    def supports(self, layer: int) -> bool:
        return self.mats[layer] is not None

    def lut(self, qtype: int) -> torch.Tensor:
        if qtype not in self._luts:
            self._luts[qtype] = tq.lut(qtype, self.device)
        return self._luts[qtype]

    def mix(self, layer: int, blobs: torch.Tensor, spare: torch.Tensor, slot_map: torch.Tensor,
            x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            offsets: torch.Tensor | None = None) -> torch.Tensor:
        """sum_j weights[:, j] * expert_{ids[:, j]}(x) -> [N, d] in x's dtype. `slot_map` [n_expert]
        (int32, contiguous, on the device) gives each routed expert's slot (>= n_slots: a row of
        `spare`); the kernels look it up themselves. `offsets` [n_expert, 3] (int64, on the
        device): where each expert's gate, up and down start inside its slot, for slots whose
        experts are not all laid out alike (the daemon's arena read in place); None: the
        layer's layout."""
        m = self.mats[layer]
        assert m is not None, f"layer {layer} has no kernel path"
        if x.shape[0] <= DECODE_MAX_ROWS:
            return self._decode(m, blobs, spare, slot_map, x, weights, ids, offsets)
        return self._prefill(m, blobs, spare, slot_map, x, weights, ids, offsets)

    def _decode(self, m: ExpertMats, blobs: torch.Tensor, spare: torch.Tensor, slot_map: torch.Tensor,
                x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                offsets: torch.Tensor | None) -> torch.Tensor:
        """Three launches and nothing else: slot lookup and expert order happen in the kernels."""
        n, k = ids.shape
        x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()  # [N, d], [N, k], [N, k]
        h = torch.empty(n * k, m.ff, dtype=torch.float32, device=x.device)  # [N*k, ff]
        common = {"n_slots": blobs.shape[0], "slot_bytes": blobs.shape[1], "num_warps": tq.NUM_WARPS,
                  "PER_EXPERT": offsets is not None, "HAS_BIAS": m.bias is not None}
        gb, ub, db = m.bias or (0, 0, 0)
        offs = ids if offsets is None else offsets  # (a pointer the kernels never read without PER_EXPERT)
        _gate_up_kernel[(n * k, triton.cdiv(m.ff, tq.TILE_ROWS))](
            blobs, spare, ids, slot_map, offs, x, h, self.lut(m.gate.qtype), self.lut(m.up.qtype),
            gate_off=m.gate.offset, up_off=m.up.offset, g_row_bytes=m.gate.row_bytes, u_row_bytes=m.up.row_bytes,
            d=m.d, ff=m.ff, gb_off=gb, ub_off=ub, alpha=SWIGLU_OAI_ALPHA, limit=SWIGLU_OAI_LIMIT, K=k,
            QG=m.gate.qtype, QU=m.up.qtype, BN=tq.TILE_ROWS, BK=tq.col_tile(m.d, tq.TILE_COLS),
            ACT=EXPERT_ACTS.index(self.act), **common)
        y = torch.empty(n * k, m.d, dtype=torch.float32, device=x.device)  # [N*k, d] weighted expert outputs
        _down_kernel[(n * k, triton.cdiv(m.d, tq.TILE_ROWS))](
            blobs, spare, ids, slot_map, offs, weights, h, y, self.lut(m.down.qtype), down_off=m.down.offset,
            row_bytes=m.down.row_bytes, d=m.d, ff=m.ff, db_off=db, QD=m.down.qtype, BN=tq.TILE_ROWS,
            BK=tq.col_tile(m.ff, tq.TILE_COLS), **common)
        out = torch.empty_like(x)  # [N, d]
        _sum_kernel[(n, triton.cdiv(m.d, SUM_BLOCK))](y, ids, out, m.d, K=k, KP=triton.next_power_of_2(k),
                                                     BLOCK=SUM_BLOCK)
        return out

    def _prefill(self, m: ExpertMats, blobs: torch.Tensor, spare: torch.Tensor, slot_map: torch.Tensor,
                 x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 offsets: torch.Tensor | None) -> torch.Tensor:
        """Dequantize each routed expert once (one launch per matrix), then torch matmuls; summed
        per row in ascending expert order (`index_put_` on distinct rows is exact)."""
        k = ids.shape[1]
        flat = ids.reshape(-1)  # [N*k]
        order = torch.argsort(flat, stable=True)  # [N*k] grouped by expert ascending, rows ascending
        counts = torch.zeros(slot_map.shape[0], dtype=torch.int64, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat))  # [n_expert] rows per expert (exact integer adds)
        table = [counts, slot_map.to(torch.int64)] + ([] if offsets is None else list(offsets.T))  # [2 | 5][E]
        plan = torch.stack(table).tolist()  # the layer's one host sync
        out = torch.zeros_like(x)  # [N, d]
        start = 0
        for e, (count, slot) in enumerate(zip(plan[0], plan[1])):
            if not count:
                continue
            pick = order[start:start + count]  # [n_e]
            start += count
            rows, j = pick // k, pick % k
            row = blobs[slot] if slot < blobs.shape[0] else spare[slot - blobs.shape[0]]  # [slot_bytes]
            parts = (m.gate, m.up, m.down) if offsets is None else \
                tuple(replace(p, offset=plan[2 + i][e]) for i, p in enumerate((m.gate, m.up, m.down)))
            gate, up, down = (self._weights(row, p, x.dtype) for p in parts)
            gb, ub, db = (None,) * 3 if m.bias is None else \
                (row[o:o + 4 * n].view(torch.float32).to(x.dtype) for o, n in zip(m.bias, (m.ff, m.ff, m.d)))
            h = activate(F.linear(x[rows], gate, gb), F.linear(x[rows], up, ub), self.act)  # [n_e, ff]
            y = F.linear(h, down, db)  # [n_e, d]
            out.index_put_((rows,), y * weights[rows, j, None], accumulate=True)
        return out

    @staticmethod
    def _weights(row: torch.Tensor, p: Part, dtype: torch.dtype) -> torch.Tensor:
        raw = row[p.offset:p.offset + p.n_out * p.row_bytes]  # [bytes]
        return tq.dequantize(raw, p.qtype, p.n_out, p.n_in, dtype)  # [n_out, n_in]


def available(device: torch.device) -> bool:
    """Whether the fused kernels can run on `device`: CUDA, or any device under TRITON_INTERPRET=1
    (tests on CPU)."""
    return torch.device(device).type == "cuda" or tq.interpreted()
