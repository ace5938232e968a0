"""The expert bank: the one object a model's MoE blocks talk to.

One `ExpertBank` per model, given to it at build time (`load_model(..., bank=)`,
`MoETransformer.with_bank`), as mlx-lm gives each MoE block its `SwitchGLU`. A block calls
`bank.mix(layer, x, weights, ids)` and nothing else; the generation loop and the serve engine own
the step (`begin_step`) and the prefetch planning between layers (`prefetch_ahead`, through a
`prefetch.Prefetcher` observer). The model never calls into the bank's lifecycle.

The bank wraps one backend (an `ExpertBackend`), which says where the experts are computed:

    kind          backend                               experts live in
    cpu-mmap      resident.QuantResidentExperts         the file's read-only memory map
    cpu-arena     arena.ArenaExperts                    leased slots of the daemon's shared arena
    gpu-slots     streamed.StreamedExperts              a device slot cache fed from the arena
    gpu-resident  source.ResidentExperts                every expert's raw blocks on the device
    gpu-arena     zero_copy.ArenaGpuExperts             leased arena slots, read in place by the GPU
 Forced routing
(`forced=`, `generate --force-routing`) is a bank option: the trace's ids replace the router's
before the backend sees them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .source import ExpertBackend, Predictions
from .stats import ArenaStats, ResidentStats, SlotStats, ZeroCopyStats

BankStats = ResidentStats | SlotStats | ArenaStats | ZeroCopyStats


class ExpertBank:
    """A model's experts: one backend's `mix`, plus the step and prefetch calls its owner makes."""

    def __init__(self, backend: ExpertBackend, *, forced: np.ndarray | None = None):
        self.backend = backend
        self.forced = None if forced is None else ForcedIds(forced)

    @property
    def kind(self) -> str:
        """The backend's name (`cpu-mmap`, `cpu-arena`, `gpu-slots`, `gpu-resident`, `gpu-arena`)."""
        return self.backend.kind

    @property
    def client(self) -> Any:
        """The daemon client of a streamed backend, else None (the serve engine's health checks)."""
        return getattr(self.backend, "client", None)

    def mix(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[:, j] * expert_{ids[:, j]}(x): rows x [N, d], weights/ids [N, k] -> [N, d]."""
        if self.forced is not None:
            ids = self.forced.ids(layer, x.shape[0], ids)  # [N, k]
        return self.backend.mix(layer, x, weights, ids)

    def begin_step(self) -> None:
        """A forward pass starts (called by its owner, the generation loop or the serve engine)."""
        if self.forced is not None:
            self.forced.step()
        self.backend.begin_step()

    def prefetch_ahead(self, predictions: Predictions, defer: bool = False,
                       if_cached: Predictions | None = None) -> None:
        """Experts these layers will probably want (see `ExpertBackend.prefetch_ahead`)."""
        self.backend.prefetch_ahead(predictions, defer, if_cached)

    def prefetch_top(self, k: int) -> int:
        """The backend's default prefetch width (see `ExpertBackend.prefetch_top`)."""
        return self.backend.prefetch_top(k)

    def stats(self) -> BankStats:
        """The backend's counters, typed (`describe()`, `as_dict()`, `traffic()`)."""
        return self.backend.stats()

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "ExpertBank":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ForcedIds:
    """A routing trace [tokens, layers, k] replayed in place of the router's picks (`forced.py`).

    The token at position p of the sequence (prompt first) uses ids[p % tokens, layer]; positions
    are counted per forward pass (one sequence only)."""

    def __init__(self, ids: np.ndarray):
        self.trace = torch.from_numpy(ids)  # [T, L, k]
        self.base = 0  # position of this forward pass's first token
        self.rows = 0  # tokens of this forward pass (its first MoE layer's rows)

    def step(self) -> None:
        self.base += self.rows
        self.rows = 0

    def ids(self, layer: int, n: int, like: torch.Tensor) -> torch.Tensor:
        self.rows = self.rows or n
        pos = torch.arange(self.base, self.base + n) % self.trace.shape[0]  # [n]
        return self.trace[pos, layer].to(like.device, like.dtype)  # [n, k]
