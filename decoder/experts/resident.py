"""Experts computed on their quantized GGUF blocks where they lie (CPU).

An expert's gate/up/down parts are byte views — into the file's read-only memory map
(`QuantResidentExperts`) or into a leased slot of the daemon's shared-memory arena
(`arena_experts.ArenaExperts`) — and `qkernels.swiglu_expert` reads the blocks as they are:
no dequantized copy of an expert exists, so resident mode costs the file's expert bytes (in
the page cache, shared with every process mapping the file) and a streamed decoder holds no
expert memory of its own.

Both sources group a layer's routing by expert once (`Routed`), compute experts with
`run_experts` (one kernel call for a layer's experts, or for those that arrived together) and
sum with `combine_rows` in ascending expert order, so they are bit-identical.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ...common.layout import ExpertPart, ModelLayout
from .source import ExpertBackend
from .stats import ResidentStats
from ..kernels.cpu.ffn import Bias, ExpertTable, QMatrix, expert_table, swiglu_rows
from ..kernels.cpu.routing import group_by_expert, scatter_add, weigh

Mats = tuple  # (gate, up, down) QMatrix, or (gate, up, down, Bias) for experts with biases (qkernels.Bias)
_WEIGHTS = ("gate", "up", "down", "gate_up")
_BIASES = ("gate.bias", "up.bias", "down.bias", "gate_up.bias")


def expert_mats(parts: list[ExpertPart], views: Mapping[str, np.ndarray]) -> Mats:
    """(gate, up, down) matrices over one expert's part bytes `views[name]` (uint8, 1-D), plus
    their biases (decoded, a few KB) when the expert has them: (gate, up, down, Bias).

    A fused `gate_up` part holds the gate rows first, then the up rows: two halves of one view.
    """
    mats: dict[str, QMatrix] = {}
    biases: dict[str, np.ndarray] = {}
    for p in parts:
        if p.name not in _WEIGHTS + _BIASES:
            raise ValueError(f"expert part {p.name!r} is not one of {', '.join(_WEIGHTS + _BIASES)}")
        data = views[p.name]
        if data.size != p.nbytes:
            raise ValueError(f"expert part {p.name!r}: {data.size} bytes, expected {p.nbytes}")
        if p.name in _BIASES:
            biases[p.name.removesuffix(".bias")] = _vector(data, p)  # [n]
            continue
        n_in, n_out = p.shape[0], p.shape[1]
        if p.name == "gate_up":
            half = p.nbytes // 2
            mats["gate"] = QMatrix(data[:half], int(p.qtype), n_out // 2, n_in)
            mats["up"] = QMatrix(data[half:], int(p.qtype), n_out // 2, n_in)
        else:
            mats[p.name] = QMatrix(data, int(p.qtype), n_out, n_in)
    missing = {"gate", "up", "down"} - set(mats)
    if missing:
        raise ValueError(f"expert has no {', '.join(sorted(missing))} part (has {[p.name for p in parts]})")
    if not biases:
        return mats["gate"], mats["up"], mats["down"]
    return mats["gate"], mats["up"], mats["down"], _bias(biases, [p.name for p in parts])


def _vector(data: np.ndarray, p: ExpertPart) -> np.ndarray:
    """A bias part's bytes as float32 (a small copy: numpy, not a kernel launch per part)."""
    if p.qtype == GGMLQuantizationType.F32:
        return data.view("<f4").astype(np.float32)
    if p.qtype == GGMLQuantizationType.F16:
        return data.view("<f2").astype(np.float32)
    if p.qtype == GGMLQuantizationType.BF16:
        return (data.view("<u2").astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"expert part {p.name!r}: biases of type {p.qtype.name} are not supported (F32, F16, BF16)")


def _bias(biases: dict[str, np.ndarray], names: list[str]) -> Bias:
    """(gate, up, down) biases from the parts' (a fused gate_up bias: gate half first)."""
    if "gate_up" in biases:
        biases["gate"], biases["up"] = np.split(biases.pop("gate_up"), 2)
    missing = {"gate", "up", "down"} - set(biases)
    if missing:
        raise ValueError(f"expert has biases but no {', '.join(sorted(missing))} bias (has {names})")
    return biases["gate"], biases["up"], biases["down"]


@dataclass(frozen=True)
class Routed:
    """A layer call's routing grouped by expert, as the CPU kernels take it: no per-expert objects.

    experts [U] ascending; pair i of expert experts[j] (i in row_ptr[j] .. row_ptr[j + 1]) is
    token row rows[i] (ascending within an expert) and routing slot picks[i] of ids.reshape(-1).
    """

    experts: np.ndarray  # [U] int64
    row_ptr: np.ndarray  # [U + 1] int64
    rows: np.ndarray  # [R] int64
    picks: np.ndarray  # [R] int64

    @classmethod
    def of(cls, ids: np.ndarray) -> "Routed":
        """From ids [N, k]: one stable sort for the whole layer (compiled: `routing`)."""
        return cls(*group_by_expert(np.ascontiguousarray(ids, np.int64)))

    def only(self, keep: Sequence[int]) -> "Routed":
        """The same routing for the experts `keep` only (those of one arrival batch)."""
        return self if len(keep) == self.experts.size else self.select(keep)[0]

    def select(self, keep: Sequence[int]) -> tuple["Routed", np.ndarray]:
        """`only(keep)` and the mask [R] of the pairs it kept."""
        sel = np.isin(self.experts, np.asarray(keep, np.int64))  # [U]
        counts = np.diff(self.row_ptr)  # [U]
        pairs = np.repeat(sel, counts)  # [R]
        row_ptr = np.zeros(int(sel.sum()) + 1, np.int64)
        np.cumsum(counts[sel], out=row_ptr[1:])
        return Routed(self.experts[sel], row_ptr, self.rows[pairs], self.picks[pairs]), pairs


@dataclass(frozen=True)
class ExpertRows:
    """Weighted outputs of a layer call's experts: ys[i] = weight x y of pair i of `routed`."""

    routed: Routed
    ys: np.ndarray  # [R, d] float32

    def without(self, drop: Sequence[int]) -> "ExpertRows":
        """These outputs less those of the experts `drop` (computed from a slot that changed)."""
        if not drop:
            return self
        gone = set(drop)
        routed, pairs = self.routed.select([e for e in self.routed.experts.tolist() if e not in gone])
        return ExpertRows(routed, self.ys[pairs])


def run_experts(x: np.ndarray, r: Routed, weights: np.ndarray, table: ExpertTable,
                act: str = "swiglu") -> ExpertRows:
    """The experts of `r` (`table` holds them, in `r.experts`' order) in one kernel call (two
    parallel regions in all), each output row scaled by its routing weight (weights [N*k]
    float32). Each expert's output is the same bits whichever experts share the call, so
    arrival batches do not matter."""
    ys = swiglu_rows(x, table, r.row_ptr, r.rows, act)  # [R, d]
    weigh(ys, weights, r.picks)  # ys[i] *= weights[picks[i]]
    return ExpertRows(r, ys)


def combine_rows(n: int, d: int, outputs: Sequence[ExpertRows]) -> np.ndarray:
    """Sum the weighted outputs into [n, d], per row in ascending expert order whatever batches
    they came in (resident's one batch and the arena's arrival batches add the same floats in the
    same order: bit-identical)."""
    out = np.zeros((n, d), np.float32)  # [n, d]
    outputs = [o for o in outputs if o.ys.shape[0]]
    if not outputs:
        return out
    if len(outputs) == 1:
        rows, ys = outputs[0].routed.rows, outputs[0].ys
    else:
        expert_of = np.concatenate([np.repeat(o.routed.experts, np.diff(o.routed.row_ptr)) for o in outputs])  # [R]
        order = np.argsort(expert_of, kind="stable")  # [R] expert-major, each expert's rows ascending
        rows = np.concatenate([o.routed.rows for o in outputs])[order]
        ys = np.concatenate([o.ys for o in outputs])[order]
    scatter_add(out, rows, ys)  # in order: out[rows[i]] += ys[i]
    return out


def cpu_inputs(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray, Routed]:
    """What the CPU kernels take of a layer call: x [N, d] and the weights [N*k] as float32
    arrays, and the routing grouped by expert."""
    return _f32(x), _f32(weights).reshape(-1), Routed.of(ids.numpy())  # [N, d], [N*k]


def _f32(t: torch.Tensor) -> np.ndarray:
    """`t` as a C-contiguous float32 array (no conversion calls when it already is one: a decode
    step's tensors are, and each call costs microseconds, per layer)."""
    if t.dtype != torch.float32 or not t.is_contiguous():
        t = t.to(torch.float32).contiguous()
    return t.numpy()


class QuantResidentExperts(ExpertBackend):
    """Every expert resident as the file's own quantized bytes (a read-only memory map).

    The reference the streamed CPU source must match bit for bit; memory is the file's
    expert bytes, in the page cache, as llama.cpp's mmap has them. A split model's layer may keep
    its gate, up and down tensors in three parts: the kernels then get each one's own map.
    """

    kind = "cpu-mmap"

    def __init__(self, layout: ModelLayout):
        if any(r.data is None for r in layout.readers):
            raise ValueError(f"{layout.path}: no memory map of the file")
        self.layout = layout
        self._bases = {layer: self._layer_bases(layer) for layer in layout.experts.moe_layers}
        self._mats: dict[tuple[int, int], Mats] = {}
        self._tables: dict[int, ExpertTable] = {}
        ex = layout.experts
        nbytes = sum(ex.blob_bytes(layer) * ex.n_expert for layer in ex.moe_layers)
        self.counts = ResidentStats(self.kind, "quant", experts=ex.n_blobs, bytes=nbytes)

    def mats(self, layer: int, expert: int) -> Mats:
        key = (layer, expert)
        got = self._mats.get(key)
        if got is None:
            parts = self.layout.experts.parts(layer, expert)
            views = {p.name: self.layout.bytes_of(p) for p in parts}  # views, no copy
            got = self._mats[key] = expert_mats(parts, views)
        return got

    def mix(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        xs, w, routed = cpu_inputs(x, weights, ids)
        out = run_experts(xs, routed, w, self._table(layer).take(routed.experts), self.layout.spec.expert_act)
        self.counts.acquired += routed.experts.size
        self.counts.compute_s += time.perf_counter() - t0
        return torch.from_numpy(combine_rows(*xs.shape, [out])).to(x.dtype)  # [N, d]

    def _table(self, layer: int) -> ExpertTable:
        """Every expert of `layer` as one table, built (and checked) on the layer's first call."""
        table = self._tables.get(layer)
        if table is None:
            mats = [self.mats(layer, e) for e in range(self.layout.experts.n_expert)]
            table = self._tables[layer] = expert_table(self._bases[layer], mats)
        return table

    def _layer_bases(self, layer: int) -> np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The memory map(s) `layer`'s experts lie in: the file's, or (gate's, up's, down's) parts'."""
        files = {p.name: p.file for p in self.layout.experts.parts(layer, 0)}
        gate, up = (files["gate_up"],) * 2 if "gate_up" in files else (files["gate"], files["up"])
        which = (gate, up, files["down"])
        if len(set(which)) == 1:
            return self.layout.data(which[0])
        return tuple(self.layout.data(f) for f in which)

    def stats(self) -> ResidentStats:
        return replace(self.counts)  # a snapshot

    def close(self) -> None:
        self._mats.clear()
        self._tables.clear()
