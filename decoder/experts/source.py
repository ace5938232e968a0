"""Expert backends: where an `ExpertBank` gets a layer's experts computed.

The model never knows where experts live: the MoE block routes, then asks its `ExpertBank`
(`bank.py`) to `mix(layer, x, weights, ids)` (every routed expert's SwiGLU output, weighted and
summed); the bank hands that to its backend, an `ExpertBackend` (this module's ABC).

- CPU, the `quant` format: computed on the quantized GGUF blocks where they lie, the file's
  memory map (`resident.QuantResidentExperts`, `cpu-mmap`) or a leased slot of the daemon's
  shared-memory arena (`arena.ArenaExperts`, `cpu-arena`); no dequantized copy is kept.
- `AcquireSource` family: raw slots of quantized blocks on the device, `acquire`d for a layer
  and `release`d after it: `ResidentExperts` below (`gpu-resident`) and the device slot cache of
  `streamed.StreamedExperts` (`gpu-slots`). On CUDA both override `mix` to run the fused Triton
  kernels (`kernels.gpu.experts`) on the slot memory: nothing is dequantized into a copy, and the
  (layer, expert) -> slot map is a device tensor; elsewhere an acquired expert is dequantized
  for its layer only.

Every backend sums its experts' outputs in ascending expert order (`combine` here, the CPU
backends' `kernels.cpu.moe.combine_rows`), whatever order they were computed or arrived in, so
streamed and resident decoding are bit-identical.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ...common.arch import EXPERT_ACTS, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from ...common.layout import ExpertPart, ModelLayout
from ..kernels.dequant.blocks import dequantize
from .stats import ResidentStats

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


class ExpertBackend(ABC):
    """Computes a layer's routed experts for an `ExpertBank` (`bank.py`). Calls come from the
    compute thread. `kind` names it in the bank's table."""

    kind: str = ""

    def begin_step(self) -> None:
        """One forward pass starts (policy decay tick; prefetches of the last one are given up)."""

    def prefetch_ahead(self, predictions: Predictions, defer: bool = False,
                       if_cached: Predictions | None = None) -> None:
        """Hint that these layers' experts will probably be needed soon. With `defer` the
        hint waits until the next `mix` has requested its own experts. `if_cached`: less likely
        ones, worth having at hand only where that costs no read (a source may ignore them)."""

    def prefetch_top(self, k: int) -> int:
        """How many of each token's k guesses per predicted layer to fetch ahead when the user did
        not say (`--prefetch-top`): all of them, into a cache of this decoder's own."""
        return k

    @abstractmethod
    def mix(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[:, j] * expert_{ids[:, j]}(x) for rows x [N, d], weights/ids [N, k] -> [N, d]."""

    def stats(self) -> Any:
        """A typed snapshot of the counters (`stats.py`): `describe()`, `as_dict()`, `traffic()`."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "ExpertBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class ExpertWeights:
    """One expert, ready for compute on the model's device, in the model's float dtype."""

    gate: torch.Tensor  # [ff, d]
    up: torch.Tensor  # [ff, d]
    down: torch.Tensor  # [d, ff]
    # biases (gpt-oss), added to gate x and up x before the activation and to the output
    gate_b: torch.Tensor | None = None  # [ff]
    up_b: torch.Tensor | None = None  # [ff]
    down_b: torch.Tensor | None = None  # [d]

    @property
    def nbytes(self) -> int:
        ts = (self.gate, self.up, self.down, self.gate_b, self.up_b, self.down_b)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def blob_to_weights(
    parts: list[ExpertPart],
    blob: torch.Tensor,
    ranges: dict[str, tuple[int, int]],
    dtype: torch.dtype = torch.float32,
) -> ExpertWeights:
    """Dequantize one expert blob (uint8 bytes on the compute device) into `ExpertWeights`.

    `ranges[part.name] = (offset inside blob, nbytes)`. A fused `gate_up` part holds the gate
    rows first, then the up rows; `<part>.bias` parts are the biases (gpt-oss). Any other part
    is an error (no architecture has one).
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
    for fused in ("gate_up", "gate_up.bias"):
        if fused in mats:
            suffix = fused.removeprefix("gate_up")
            mats["gate" + suffix], mats["up" + suffix] = mats.pop(fused).chunk(2, dim=0)  # [2ff, ...] -> 2 x [ff, ...]
    return ExpertWeights(gate=mats["gate"], up=mats["up"], down=mats["down"], gate_b=mats.get("gate.bias"),
                         up_b=mats.get("up.bias"), down_b=mats.get("down.bias"))


_PART_NAMES = ("gate", "up", "down", "gate_up", "gate.bias", "up.bias", "down.bias", "gate_up.bias")


class AcquireSource(ExpertBackend):
    """A source of float weights per expert: `acquire` pins a layer's experts, `mix` computes
    them with torch, `release` unpins. `expert_act`: the family's activation (`common.arch`)."""

    expert_act: str = "swiglu"

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
                y = expert_ffn(x[rows], w, self.expert_act)  # [n_e, d]
                outputs[e] = (rows, y * weights[rows, slot, None])
        finally:
            self.release(layer, wanted)
        return combine(x, outputs)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x): x [n, d], gate/up [ff, d], down [d, ff] -> [n, d]."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def activate(g: torch.Tensor, u: torch.Tensor, act: str = "swiglu") -> torch.Tensor:
    """An expert's activation of gate g and up u [n, ff] (`common.arch.EXPERT_ACTS`): the float
    path's, and the CPU kernels' dense path's."""
    if act == "swiglu":
        return torch.nn.functional.silu(g) * u
    if act == "swiglu_oai_clamped":
        g = g.clamp(max=SWIGLU_OAI_LIMIT)
        return g * torch.sigmoid(g * SWIGLU_OAI_ALPHA) * (u.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT) + 1)
    raise ValueError(f"unknown expert activation {act!r} (have: {', '.join(EXPERT_ACTS)})")


def expert_ffn(x: torch.Tensor, w: ExpertWeights, act: str = "swiglu") -> torch.Tensor:
    """One expert on rows x [n, d] -> [n, d] with the activation `act` (`common.arch.EXPERT_ACTS`)
    and the expert's biases when it has them."""
    if act == "swiglu" and w.gate_b is None and w.down_b is None:
        return swiglu(x, w.gate, w.up, w.down)
    h = activate(F.linear(x, w.gate, w.gate_b), F.linear(x, w.up, w.up_b), act)  # [n, ff]
    return F.linear(h, w.down, w.down_b)  # [n, d]


def read_blob(layout: ModelLayout, layer: int,
              expert: int) -> tuple[list[ExpertPart], np.ndarray, dict[str, tuple[int, int]]]:
    """An expert's parts read straight from their files' memory maps, packed back to back
    into one new uint8 array (the only host copy)."""
    parts = layout.experts.parts(layer, expert)
    ranges, off = {}, 0
    for p in parts:
        ranges[p.name] = (off, p.nbytes)
        off += p.nbytes
    blob = np.concatenate([layout.bytes_of(p) for p in parts])  # [blob bytes]
    return parts, blob, ranges


class ResidentExperts(AcquireSource):
    """Every expert in process, no daemon (`gpu-resident`): the quantized bytes on the device in
    the device slot cache's layout (one slot per expert, `blobs [n_layer * n_expert, slot_bytes]`,
    slot = layer * n_expert + expert), computed on as a streamed slot cache does: with the fused
    Triton kernels (`kernels`, see `slot_format.slot_kernels`; on CUDA by default), else
    dequantizing on each acquire. The (layer, expert) -> slot map is a device tensor: a fused layer
    makes no host sync. (On a CPU, `resident.QuantResidentExperts` is the fast resident path.)
    """

    kind = "gpu-resident"

    def __init__(self, layout: ModelLayout, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, progress: bool = False, kernels: bool | None = None):
        self.layout, self.device, self.dtype = layout, torch.device(device), dtype
        self.expert_act = layout.spec.expert_act
        self._acquired = 0
        self._load(progress, kernels)

    def _keys(self, progress: bool):
        hp = self.layout.hparams
        keys = [(layer, e) for layer in self.layout.experts.moe_layers for e in range(hp.n_expert)]
        if progress:
            from tqdm import tqdm

            keys = tqdm(keys, desc="experts", unit="expert", leave=False)
        return keys

    def _load(self, progress: bool, kernels: bool | None) -> None:
        from .gpu.slot_format import pack_parts, slot_kernels, slot_layouts

        hp = self.layout.experts  # n_layer, n_expert as the expert index counts them
        self.layouts = slot_layouts(self.layout.experts)
        slot_bytes = max(lay.nbytes for lay in self.layouts)
        self.blobs = torch.zeros(hp.n_layer * hp.n_expert, slot_bytes, dtype=torch.uint8,
                                 device=self.device)  # [n_layer * n_expert, slot_bytes]
        row = torch.zeros(slot_bytes, dtype=torch.uint8)  # [slot_bytes] host staging
        for layer, e in self._keys(progress):
            parts = {p.name: self.layout.bytes_of(p) for p in self.layout.experts.parts(layer, e)}
            pack_parts(row.numpy(), self.layouts[layer], parts)
            self.blobs[layer * hp.n_expert + e].copy_(row)
        self.slot_map = torch.arange(hp.n_layer * hp.n_expert, dtype=torch.int32,
                                     device=self.device).view(hp.n_layer, hp.n_expert)  # [L, E]
        self._spare = torch.zeros(1, slot_bytes, dtype=torch.uint8, device=self.device)  # never indexed here
        self.kernels = slot_kernels(self.layouts, self.device, kernels, self.expert_act)

    def mix(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and self.kernels.supports(layer):
            self._acquired += ids.numel()  # routed (token, expert) pairs: counting distinct ones would sync
            return self.kernels.mix(layer, self.blobs, self._spare, self.slot_map[layer], x, weights, ids)
        return super().mix(layer, x, weights, ids)

    def acquire(self, layer: int, experts: Sequence[int]) -> dict[int, ExpertWeights]:
        out = {}
        n_expert = self.layout.hparams.n_expert
        for e in experts:
            if not (0 <= layer < self.layout.hparams.n_layer and 0 <= int(e) < n_expert):
                raise KeyError(f"no expert {(layer, int(e))} in this model")
            lay = self.layouts[layer]
            out[int(e)] = blob_to_weights(list(lay.parts), self.blobs[layer * n_expert + int(e)], lay.ranges,
                                          self.dtype)
        self._acquired += len(out)
        return out

    def stats(self) -> ResidentStats:
        return ResidentStats(self.kind, "raw", experts=self.blobs.shape[0], bytes=self.blobs.numel(),
                             acquired=self._acquired, kernels="triton" if self.kernels is not None else "torch")

    def close(self) -> None:
        self.blobs = self._spare = torch.empty(0, dtype=torch.uint8)
