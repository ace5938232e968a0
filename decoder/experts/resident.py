"""Experts computed on their quantized GGUF blocks where they lie (CPU).

An expert's gate/up/down parts are byte views — into the file's read-only memory map
(`QuantResidentExperts`) or into a leased slot of the daemon's shared-memory arena
(`arena_experts.ArenaExperts`) — and `qkernels.swiglu_expert` reads the blocks as they are:
no dequantized copy of an expert exists, so resident mode costs the file's expert bytes (in
the page cache, shared with every process mapping the file) and a streamed decoder holds no
expert memory of its own.

Both sources compute a layer call through `kernels.cpu.moe` (its routing grouped once, one kernel
call for a layer's experts or for those that arrived together, outputs summed in ascending expert
order), so they are bit-identical.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ...common.layout import ExpertPart, ModelLayout
from .source import ExpertBackend
from .stats import ResidentStats
from ..kernels.cpu.ffn import Bias, ExpertTable, QMatrix, expert_table
from ..kernels.cpu.moe import combine_rows, cpu_inputs, run_experts

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
