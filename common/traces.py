"""Routing trace files: what a decoder writes (`generate --trace-out`) and what the cache
simulator (`moestream simulate`) and `moestream warm` read.

A trace is a list of steps; a step is the (layer, expert) keys one forward pass routed to, a key
once per row (token) that chose it: a prompt's step lists an expert as often as its tokens did,
which the cache policy counts as uses (`SlotPolicy.credit`); the hits and misses count it once.
- JSON: `{"n_layer": L, "n_expert": E, "steps": [[[layer, expert], ...], ...]}`
  with 0 <= layer < L and 0 <= expert < E.
- .npy: an integer array of shape [tokens, layers, k] holding expert ids; step t is
  `{(layer, ids[t, layer, j])}` over all layers and j.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def write_trace(path: str | Path, steps: Sequence[Sequence[tuple[int, int]]],
                n_layer: int, n_expert: int) -> None:
    """Write a JSON trace (see the module docstring)."""
    doc = {"n_layer": n_layer, "n_expert": n_expert,
           "steps": [[[int(l), int(e)] for l, e in step] for step in steps]}
    Path(path).write_text(json.dumps(doc, separators=(",", ":")))


def load_trace(path: str | Path) -> list[list[tuple[int, int]]]:
    """Read a .json or .npy trace; raises ValueError naming what is wrong."""
    path = Path(path)
    if path.suffix == ".npy":
        return _load_npy(path)
    if path.suffix == ".json":
        return _load_json(path)
    raise ValueError(f"{path}: trace must be .json or .npy, got {path.suffix!r}")


def _load_npy(path: Path) -> list[list[tuple[int, int]]]:
    import numpy as np  # only the .npy format needs it

    ids = np.load(path, allow_pickle=False)
    if ids.ndim != 3 or ids.dtype.kind not in "iu":
        raise ValueError(f"{path}: need an integer array [tokens, layers, k], "
                         f"got dtype {ids.dtype} shape {ids.shape}")
    if ids.size and ids.min() < 0:
        raise ValueError(f"{path}: negative expert id {int(ids.min())}")
    return [[(layer, int(e)) for layer, row in enumerate(tok) for e in row] for tok in ids]


def _load_json(path: Path) -> list[list[tuple[int, int]]]:
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or not {"n_layer", "n_expert", "steps"} <= doc.keys():
        raise ValueError(f"{path}: need an object with n_layer, n_expert and steps")
    n_layer, n_expert = doc["n_layer"], doc["n_expert"]
    steps = []
    for t, step in enumerate(doc["steps"]):
        keys = []
        for pair in step:
            if (not isinstance(pair, list) or len(pair) != 2
                    or not all(isinstance(x, int) for x in pair)
                    or not (0 <= pair[0] < n_layer and 0 <= pair[1] < n_expert)):
                raise ValueError(f"{path}: step {t}: bad key {pair!r} for "
                                 f"n_layer={n_layer}, n_expert={n_expert}")
            keys.append((pair[0], pair[1]))
        steps.append(keys)
    return steps
