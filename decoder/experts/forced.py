"""Forced routing: replay a routing trace instead of the router's picks, for benchmarks whose
I/O and cache policy should see a given workload (`generate --force-routing FILE.npy`, used by
`moestream bench capped --routing trace|curve`; llama.cpp's side forces the same ids).

The trace is an integer array [tokens, layers, k] (`common.traces`' .npy format): the token at
position p of the sequence (prompt first) uses experts ids[p % tokens, layer]. The router still
runs and its top-k weights are kept, so the compute is unchanged; only which experts are mixed
(and so fetched) changes. One sequence only: positions are counted per forward pass.
The replay itself is an `ExpertBank` option (`bank.ForcedIds`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from ...common.layout import HParams


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
