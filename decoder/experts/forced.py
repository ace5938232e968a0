"""Forced routing: replay a routing trace instead of the router's picks, for benchmarks whose
I/O and cache policy should see a given workload (`generate --force-routing FILE.npy`, used by
`moestream bench capped --routing trace|curve`; llama.cpp's side forces the same ids).

The trace is an integer array [tokens, layers, k] (`common.traces`' .npy format): the token at
position p of the sequence (prompt first) uses experts ids[p % tokens, layer]. The router still
runs and its top-k weights are kept, so the compute is unchanged; only which experts are mixed
(and so fetched) changes. One sequence only: positions are counted per forward pass.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...common.layout import HParams
from .source import ExpertSource, Predictions


def load_forced(path: str | Path, hp: HParams) -> np.ndarray:
    """The trace [tokens, layers, k] checked against the model; ValueError naming what is wrong."""
    path = Path(path)
    if path.suffix != ".npy":
        raise ValueError(f"{path}: forced routing needs a .npy trace [tokens, layers, k] (a JSON trace keeps a "
                         "step's experts as a set, not per token)")
    ids = np.load(path, allow_pickle=False)
    want = (hp.n_layer, hp.n_expert_used)
    if ids.ndim != 3 or ids.dtype.kind not in "iu" or ids.shape[1:] != want or len(ids) == 0:
        raise ValueError(f"{path}: need integer ids [tokens, {want[0]} layers, top-k {want[1]}], got {ids.dtype} "
                         f"{list(ids.shape)}")
    if ids.min() < 0 or ids.max() >= hp.n_expert:
        raise ValueError(f"{path}: expert ids must be in [0, {hp.n_expert}), found {int(ids.min())}..{int(ids.max())}")
    return ids.astype(np.int64)


class ForcedRouting(ExpertSource):
    """Hands `inner` the trace's expert ids in place of the router's (see the module docstring)."""

    def __init__(self, inner: ExpertSource, ids: np.ndarray):
        self.inner, self.ids = inner, torch.from_numpy(ids)  # [T, L, k]
        self.base = 0  # position of this forward pass's first token
        self.rows = 0  # tokens of this forward pass (its first layer's rows)

    def begin_step(self) -> None:
        self.base += self.rows
        self.rows = 0
        self.inner.begin_step()

    def prefetch_ahead(self, predictions: Predictions, defer: bool = False,
                       if_cached: Predictions | None = None) -> None:
        self.inner.prefetch_ahead(predictions, defer, if_cached)

    def mix(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        self.rows = self.rows or n
        pos = torch.arange(self.base, self.base + n) % self.ids.shape[0]  # [n]
        forced = self.ids[pos, layer].to(ids.device, ids.dtype)  # [n, k]
        return self.inner.mix(layer, x, weights, forced)

    def stats(self) -> dict:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()
