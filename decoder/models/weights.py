"""Load every non-expert weight of a GGUF MoE onto the device, before the first token.

Dense weights (embeddings, attention, norms, routers, shared experts) are small next to the
experts and are needed by every token, so they are read and materialized once at start: the
first forward pass never waits on a lazy read. On a GPU they are dequantized (`decoder.dequant`);
on a CPU with the `quant` format, 2-D weights of a type the CPU kernels decode stay as their
GGUF blocks in a private copy (`QuantWeight`): a decode step reads 1/4 (Q8_0) to 1/7 (Q4_K) of
the float32 bytes, and the process holds that much less.
"""

from __future__ import annotations

import numpy as np
import torch

from ...common.layout import ModelLayout
from ..footprint import advise_random
from ..kernels.dequant.blocks import dequantize

Dense = "torch.Tensor | QuantWeight"


class QuantWeight:
    """A 2-D weight [n_out, n_in] kept as its GGUF blocks on the CPU, used through `linear`
    (`qkernels.linear`) and `rows` (an embedding lookup decodes only the rows it needs)."""

    def __init__(self, data: np.ndarray, qtype: int, n_out: int, n_in: int):
        from ..kernels.cpu.ffn import QMatrix

        self.m = QMatrix(data, qtype, n_out, n_in)
        self.row_bytes = data.size // n_out
        self.shape = (n_out, n_in)
        self.group: QuantWeight | None = None  # the stacked weight whose rows these are (`stack_rows`)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n_in] -> x @ W.T [..., n_out], in x's dtype."""
        from ..kernels.cpu.ffn import linear

        if x.dim() == 2 and x.dtype == torch.float32:  # the decode step's case: no conversions
            return torch.from_numpy(linear(x.contiguous().numpy(), self.m))  # [N, n_out]
        flat = x.reshape(-1, self.shape[1]).to(torch.float32)  # [N, n_in]
        y = torch.from_numpy(linear(flat.contiguous().numpy(), self.m))  # [N, n_out]
        return y.to(x.dtype).reshape(*x.shape[:-1], self.shape[0])

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """W[ids] [N, n_in]: only those rows decoded."""
        from ..kernels.cpu.ffn import QMatrix, dequantize as decode

        out = torch.empty(ids.numel(), self.shape[1], dtype=torch.float32)  # [N, n_in]
        for i, r in enumerate(ids.tolist()):
            row = QMatrix(self.m.data[r * self.row_bytes:(r + 1) * self.row_bytes], self.m.qtype, 1, self.shape[1])
            decode(row, out[i:i + 1].numpy())
        return out.to(dtype)

    @property
    def nbytes(self) -> int:
        return self.m.nbytes


def stack_rows(ws: list[QuantWeight]) -> QuantWeight | None:
    """Weights of one type and n_in that read the same input (a layer's q, k, v) stacked into one
    matrix, so one kernel call (one parallel region) computes them all: the bytes are moved into
    one array, and each weight becomes a view of its rows there (its `group`). None if they differ."""
    if len({(w.m.qtype, w.shape[1]) for w in ws}) != 1:
        return None
    data = np.concatenate([w.m.data for w in ws])  # [sum of bytes] uint8
    fused = QuantWeight(data, ws[0].m.qtype, sum(w.shape[0] for w in ws), ws[0].shape[1])
    start = 0
    for w in ws:
        w.__init__(data[start:start + w.m.nbytes], w.m.qtype, *w.shape)
        w.group = fused
        start += w.m.nbytes
    return fused


def _stack_qkv(out: dict[str, "Dense"], n_layer: int) -> None:
    """Each layer's attn_q, attn_k, attn_v, when all three are kept quantized alike, stacked."""
    for i in range(n_layer):
        ws = [out.get(f"blk.{i}.attn_{p}.weight") for p in "qkv"]
        if all(isinstance(w, QuantWeight) for w in ws):
            stack_rows(ws)


def keeps_quantized(layout: ModelLayout, name: str) -> bool:
    """A 2-D weight of a block-quantized type the CPU kernels decode natively."""
    from gguf import GGMLQuantizationType as Q

    from ..kernels.cpu.ffn import has_kernel

    t = layout.tensors[name]
    return len(t.shape) == 2 and t.qtype not in (Q.F32, Q.F16, Q.BF16) and has_kernel(t.qtype)


def load_quantized(layout: ModelLayout, name: str, mapped: bool = False) -> QuantWeight:
    """A private copy of the tensor's blocks (resident whatever the page cache does: a matrix is
    read whole every step), or with `mapped` a view of the file's map: for an embedding table
    that no matmul reads, a token brings in the page of its row, and only those pages count
    (Qwen3's vocabulary at 4096 wide: 661 MB at Q8_0, 88 MB at Q1_0, otherwise copied)."""
    t = layout.tensors[name]
    raw = layout.tensor_bytes(name) if mapped else np.array(layout.tensor_bytes(name), copy=True)
    if mapped:
        advise_random(raw)  # a row's own pages, not the readahead window around them
    return QuantWeight(raw, int(t.qtype), t.shape[1], t.shape[0])


def load_tensor(layout: ModelLayout, name: str, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """One tensor of the file, dequantized, torch shape reversed from ggml's, on `device`."""
    t = layout.tensors[name]
    raw = np.array(layout.tensor_bytes(name), copy=True)  # copy out of the read-only memory map
    data = torch.from_numpy(raw).to(device)  # [nbytes] uint8
    out = dequantize(data, t.qtype, t.shape, name=name)  # float32, [ne_{n-1}, ..., ne0]
    return out.to(dtype)


def load_dense(layout: ModelLayout, device: torch.device | str, dtype: torch.dtype = torch.float32,
               progress: bool = True, keep_quantized: bool = False) -> dict[str, Dense]:
    """Every non-expert tensor by GGUF name, materialized on `device` (with a progress bar);
    with `keep_quantized` (CPU only), 2-D quantized weights as `QuantWeight`s."""
    if keep_quantized and torch.device(device).type != "cpu":
        raise ValueError(f"quantized dense weights are computed by CPU kernels, not on {device}")
    from tqdm import tqdm

    # blocks after the stack (GLM's NextN/MTP, for speculative decoding) are never run: not loaded
    n_layer = layout.hparams.n_layer
    names = sorted(n for n in layout.dense if not n.startswith("blk.") or int(n.split(".")[1]) < n_layer)
    total = sum(layout.dense[n].nbytes for n in names)
    untied = "output.weight" in layout.dense  # else the table is the output matmul's too: copied
    out: dict[str, torch.Tensor] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="dense weights", disable=not progress, leave=False) as bar:
        for name in names:
            if keep_quantized and keeps_quantized(layout, name):
                out[name] = load_quantized(layout, name, mapped=name == "token_embd.weight" and untied)
            else:
                out[name] = load_tensor(layout, name, device, dtype)
            bar.update(layout.dense[name].nbytes)
    if keep_quantized:
        _stack_qkv(out, n_layer)
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)  # materialized means really on the device, not queued
    return out
