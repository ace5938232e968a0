"""Expert sources: where the MoE block gets a layer's experts computed.

The model never knows where experts live: the MoE block routes, then asks its `ExpertSource`
to `mix(layer, x, weights, ids)` (every routed expert's SwiGLU output, weighted and summed).

- CPU, the `quant` format: computed on the quantized GGUF blocks where they lie, the file's
  memory map (`quant_experts.QuantResidentExperts`) or a leased slot of the daemon's
  shared-memory arena (`arena_experts.ArenaExperts`); no dequantized copy is kept.
- `AcquireSource` family: float weights per expert, `acquire`d for a layer and `release`d
  after it: `ResidentExperts` below (dequantized at start, or raw and dequantized on use)
  and the device slot cache of `streamed.StreamedExperts` (the GPU path).

Every source sums its experts' outputs in ascending expert order (`combine`), whatever order
they were computed or arrived in, so streamed and resident decoding are bit-identical.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..common.layout import ExpertPart, ModelLayout
from .dequant import dequantize

Predictions = Mapping[int, Sequence[int]]  # layer -> experts predicted for it


def group_by_expert(ids: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """ids [N, k] -> {expert: (rows [n_e], slots [n_e])}, experts ascending, rows ascending.

    One stable sort and one host sync for the whole layer (not one per expert on a GPU).
    """
    k = ids.shape[1]
    flat = ids.flatten()  # [N*k]
    order = torch.argsort(flat, stable=True)  # [N*k] grouped by expert, token order kept
    counts = torch.bincount(flat).tolist()  # the one sync
    out, start = {}, 0
    for e, n in enumerate(counts):
        if n:
            pick = order[start:start + n]  # [n_e]
            out[e] = (pick // k, pick % k)
            start += n
    return out


def combine(x: torch.Tensor, outputs: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Sum weighted expert outputs {expert: (rows [n_e], y [n_e, d])} into [N, d], ascending experts.

    A fixed order makes the sum independent of arrival order. (index_put_ with accumulate,
    not index_add_: the latter's OpenMP path costs ~0.7 ms per call on a busy 2-core CPU;
    each call's rows are distinct, so both are exact and deterministic.)
    """
    out = torch.zeros_like(x)  # [N, d]
    for e in sorted(outputs):
        rows, y = outputs[e]
        out.index_put_((rows,), y, accumulate=True)
    return out


class ExpertSource(ABC):
    """Computes a layer's routed experts. Calls come from the compute thread."""

    def begin_step(self) -> None:
        """One forward pass starts (policy decay tick; prefetches of the last one are given up)."""

    def prefetch_ahead(self, predictions: Predictions, defer: bool = False,
                       if_cached: Predictions | None = None) -> None:
        """Hint that these layers' experts will probably be needed soon. With `defer` the
        hint waits until the next `mix` has requested its own experts. `if_cached`: less likely
        ones, worth having at hand only where that costs no read (a source may ignore them)."""

    @abstractmethod
    def mix(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[:, j] * expert_{ids[:, j]}(x) for rows x [N, d], weights/ids [N, k] -> [N, d]."""

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def __enter__(self) -> "ExpertSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class ExpertWeights:
    """One expert, ready for compute on the model's device, in the model's float dtype."""

    gate: torch.Tensor  # [ff, d]
    up: torch.Tensor  # [ff, d]
    down: torch.Tensor  # [d, ff]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down))


def blob_to_weights(
    parts: list[ExpertPart],
    blob: torch.Tensor,
    ranges: dict[str, tuple[int, int]],
    dtype: torch.dtype = torch.float32,
) -> ExpertWeights:
    """Dequantize one expert blob (uint8 bytes on the compute device) into `ExpertWeights`.

    `ranges[part.name] = (offset inside blob, nbytes)`. A fused `gate_up` part holds the gate
    rows first, then the up rows. Any other part is an error (no architecture has one).
    """
    mats: dict[str, torch.Tensor] = {}
    for part in parts:
        if part.name not in _PART_NAMES:
            raise ValueError(f"expert part {part.name!r} is not one of {', '.join(_PART_NAMES)}")
        if part.name not in ranges:
            raise ValueError(f"expert blob has no byte range for part {part.name!r} (has {sorted(ranges)})")
        off, n = ranges[part.name]
        if n != part.nbytes or off < 0 or off + n > blob.numel():
            raise ValueError(f"expert part {part.name!r}: range ({off}, {n}) does not fit a {part.nbytes}-byte part "
                             f"inside a {blob.numel()}-byte blob")
        w = dequantize(blob[off:off + n], part.qtype, part.shape, name=part.name)  # [n_out, n_in]
        mats[part.name] = w.to(dtype)
    if "gate_up" in mats:
        gate, up = mats.pop("gate_up").chunk(2, dim=0)  # [2ff, d] -> 2 x [ff, d]
    else:
        gate, up = mats.pop("gate"), mats.pop("up")
    return ExpertWeights(gate=gate, up=up, down=mats.pop("down"))


_PART_NAMES = ("gate", "up", "down", "gate_up")


class AcquireSource(ExpertSource):
    """A source of float weights per expert: `acquire` pins a layer's experts, `mix` computes
    them with torch, `release` unpins."""

    @abstractmethod
    def acquire(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]:
        """Block until every listed expert is present; pin them until `release`."""

    def release(self, layer: int, experts: Sequence[int]) -> None:
        """Unpin after the layer's compute."""

    def mix(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        groups = group_by_expert(ids)
        wanted = list(groups)
        got = self.acquire(layer, wanted)
        try:
            outputs = {}
            for e, (rows, slot) in groups.items():
                w = got[e]
                y = swiglu(x[rows], w.gate, w.up, w.down)  # [n_e, d]
                outputs[e] = (rows, y * weights[rows, slot, None])
        finally:
            self.release(layer, wanted)
        return combine(x, outputs)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x): x [n, d], gate/up [ff, d], down [d, ff] -> [n, d]."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def read_blob(layout: ModelLayout, layer: int,
              expert: int) -> tuple[list[ExpertPart], np.ndarray, dict[str, tuple[int, int]]]:
    """An expert's parts read straight from the file's memory map, packed back to back
    into one new uint8 array (the only host copy)."""
    parts = layout.experts.parts(layer, expert)
    data = layout.reader.data  # np.memmap of the whole file, uint8
    ranges, off = {}, 0
    for p in parts:
        ranges[p.name] = (off, p.nbytes)
        off += p.nbytes
    blob = np.concatenate([data[p.offset:p.offset + p.nbytes] for p in parts])  # [blob bytes]
    return parts, blob, ranges


class ResidentExperts(AcquireSource):
    """Every expert in process, no daemon: the reference streamed decoding must match.

    `slot_format="dequant"` dequantizes every expert once at start (fast compute, float
    memory); `"raw"` keeps the quantized bytes on the device and dequantizes on each acquire
    (as a raw-slot streamed cache does; cheap on a GPU, slow on a CPU).
    """

    def __init__(self, layout: ModelLayout, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, slot_format: str = "dequant", progress: bool = False):
        if slot_format not in ("raw", "dequant"):
            raise ValueError(f"slot_format must be 'raw' or 'dequant', got {slot_format!r}")
        self.layout, self.device, self.dtype = layout, torch.device(device), dtype
        self.slot_format = slot_format
        self._raw: dict[tuple[int, int], tuple[list[ExpertPart], torch.Tensor, dict[str, tuple[int, int]]]] = {}
        self._weights: dict[tuple[int, int], ExpertWeights] = {}
        self._acquired = 0
        self._load(progress)

    def _load(self, progress: bool) -> None:
        hp = self.layout.hparams
        keys = [(layer, e) for layer in range(hp.n_layer) for e in range(hp.n_expert)]
        if progress:
            from tqdm import tqdm

            keys = tqdm(keys, desc="experts", unit="expert", leave=False)
        for key in keys:
            parts, raw, ranges = read_blob(self.layout, *key)
            blob = torch.from_numpy(raw).to(self.device)  # [blob bytes]; on the CPU no copy
            if self.slot_format == "raw":
                self._raw[key] = (parts, blob, ranges)
            else:
                self._weights[key] = blob_to_weights(parts, blob, ranges, self.dtype)

    def acquire(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]:
        out = {}
        for e in experts:
            key = (layer, int(e))
            if self.slot_format == "raw":
                if key not in self._raw:
                    raise KeyError(f"no expert {key} in this model")
                out[int(e)] = blob_to_weights(*self._raw[key], self.dtype)
            else:
                if key not in self._weights:
                    raise KeyError(f"no expert {key} in this model")
                out[int(e)] = self._weights[key]
        self._acquired += len(out)
        return out

    def stats(self) -> dict:
        held = self._raw.values() if self.slot_format == "raw" else self._weights.values()
        nbytes = sum(v[1].numel() for v in held) if self.slot_format == "raw" else sum(w.nbytes for w in held)
        return {"source": "resident", "slot_format": self.slot_format, "experts": len(held),
                "bytes": nbytes, "acquired": self._acquired}

    def close(self) -> None:
        self._raw.clear()
        self._weights.clear()
