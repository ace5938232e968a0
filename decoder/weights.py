"""Load every non-expert weight of a GGUF MoE onto the device, before the first token.

Dense weights (embeddings, attention, norms, routers, shared experts) are small next to the
experts and are needed by every token, so they are read, dequantized with `decoder.dequant`
and materialized once at start: the first forward pass never waits on a lazy read.
"""

from __future__ import annotations

import numpy as np
import torch

from ..common.layout import ModelLayout
from .dequant import dequantize


def load_tensor(layout: ModelLayout, name: str, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of the file, dequantized, torch shape reversed from ggml's, on `device`."""
    t = layout.tensors[name]
    raw = np.array(layout.tensor_bytes(name), copy=True)  # copy out of the read-only memory map
    data = torch.from_numpy(raw).to(device)  # [nbytes] uint8
    out = dequantize(data, t.qtype, t.shape, name=name)  # float32, [ne_{n-1}, ..., ne0]
    return out.to(dtype)


def load_dense(layout: ModelLayout, device: torch.device | str, dtype: torch.dtype = torch.float32,
               progress: bool = True) -> dict[str, torch.Tensor]:
    """Every non-expert tensor by GGUF name, materialized on `device` (with a progress bar)."""
    from tqdm import tqdm

    names = sorted(layout.dense)
    total = sum(layout.dense[n].nbytes for n in names)
    out: dict[str, torch.Tensor] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="dense weights", disable=not progress, leave=False) as bar:
        for name in names:
            out[name] = load_tensor(layout, name, device, dtype)
            bar.update(layout.dense[name].nbytes)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)  # materialized means really on the device, not queued
    return out
