"""Llama 4 (Scout, Maverick: `Llama4ForCausalLM`), stored by llama.cpp as architecture "llama4".

Next to the generic MoE transformer, as llama.cpp's loader reads the converter's files:

- **Interleaved layers**: only every `interleave_moe_layer_step`-th layer is MoE (`HParams.moe_step`:
  1 for Scout, 2 for Maverick); the others have a dense SwiGLU `feed_forward_length` wide.
- **Routing**: top-k of the router logits, each weighted by sigmoid(logit), not renormalized; the
  weight scales the expert's *input* (HF: `routed_in = hidden * score`), not its output, so a
  (token, expert) pair is one row of its own (`ArchSpec.weight_on_input`); plus an un-gated shared expert as wide as one expert.
- **Attention**: normal (interleaved-pair) rope on unpermuted q/k; every 4th layer is NoPE with
  global attention (`attention.sliding_window_pattern`, default 4), the others rope with attention
  chunked to `CHUNK` tokens (a query sees the keys of its own chunk only) and, unless the model has
  128 experts (llama.cpp's test for Maverick, which has none), an L2 norm of q and k after the rope.
  NoPE layers scale q by log(floor((pos + 1) / 8192) + 1) * 0.1 + 1 (temperature tuning).
  The converter writes no chunk size: llama.cpp fixes it at 8192 (Scout's attention_chunk_size),
  and `attention.sliding_window` = 0 (all layers full attention) turns chunking off and leaves only the
  last layer NoPE (llama.cpp's n_no_rope_layer_step = n_layer).
- Optional `rope_freqs.weight` (llama3 rope scaling) divides each rope frequency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ....common.layout import HParams
from . import qwen3moe
from ..layers import KVCache, StepAttn, apply_rope_norm, attention_mask, dense_ffn, linear, shared_expert
from ..moe_transformer import LayerObserver, MoETransformer

ARCH = "llama4"
CHUNK = 8192  # llama.cpp's n_swa for llama4 (the file does not say)
TEMP_FLOOR, TEMP_SCALE = 8192, 0.1  # NoPE layers' attention temperature (llama.cpp's and HF's defaults)
NO_KQ_NORM_EXPERTS = 128  # llama.cpp: use_kq_norm = type != 17B_128E

# GGUF name -> Hugging Face `Llama4ForCausalLM` state-dict name ("{i}" = layer).
TENSOR_NAMES: dict[str, str] = {
    **qwen3moe.COMMON_NAMES,
    **{f"blk.{{i}}.attn_{g}.weight": f"model.layers.{{i}}.self_attn.{g}_proj.weight" for g in "qkv"},
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.feed_forward.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.feed_forward.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.feed_forward.down_proj.weight",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.feed_forward.router.weight",
    "blk.{i}.ffn_gate_shexp.weight": "model.layers.{i}.feed_forward.shared_expert.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "model.layers.{i}.feed_forward.shared_expert.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "model.layers.{i}.feed_forward.shared_expert.down_proj.weight",
}
# HF keeps experts as [E, d, 2ff] gate_up and [E, ff, d] down (x @ W, not W @ x): see `hf_experts`.
HF_FUSED: dict[str, tuple[str, ...]] = {}


def hf_experts(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """HF's expert tensors of one layer from the GGUF ones (numpy order [E, ff, d] / [E, d, ff])."""
    p = f"blk.{layer}."
    gate, up, down = (tensors[p + f"ffn_{n}_exps.weight"] for n in ("gate", "up", "down"))
    hf = f"model.layers.{layer}.feed_forward.experts."
    return {hf + "gate_up_proj": torch.cat((gate, up), dim=1).transpose(1, 2).contiguous(),  # [E, d, 2ff]
            hf + "down_proj": down.transpose(1, 2).contiguous()}  # [E, ff, d]


@dataclass(frozen=True)
class Llama4Step(StepAttn):
    chunk_mask: torch.Tensor | None = None  # [B, 1, rep*T, S]: same chunk and causal (chunked layers)
    cos_swa: torch.Tensor | None = None  # [B, T, hd]: the chunked layers' rope (rope.freq_base_swa)
    sin_swa: torch.Tensor | None = None
    temp: torch.Tensor | None = None  # [B, 1, T, 1]: NoPE layers' query scale


def key_positions(cache: KVCache, S: int) -> torch.Tensor:
    """Rope position of each of the first S cache entries [B, S] (pads: that of the token before)."""
    return (cache.valid[:, :S].long().cumsum(1) - 1).clamp(min=0)


class Model(MoETransformer):
    """The generic transformer with interleaved dense layers, input-scaled sigmoid experts, chunked
    attention and NoPE layers."""

    def __init__(self, hparams: HParams, dense: dict[str, torch.Tensor]):
        super().__init__(hparams, dense)
        hp, x = hparams, hparams.extra
        self.chunk: int | None = None if x["attention.sliding_window"] == 0 else CHUNK
        period = x["attention.sliding_window_pattern"]
        self.chunked = [self.chunk is not None and (period <= 0 or i % period < period - 1)  # (0: all, as llama.cpp)
                        for i in range(hp.n_layer)]
        # NoPE every 4th layer (llama.cpp's n_no_rope_layer_step); with chunking off, llama.cpp sets the
        # step to n_layer: only the last layer is NoPE
        nope = 4 if self.chunk else hp.n_layer
        self.roped = [(i + 1) % nope != 0 for i in range(hp.n_layer)]
        self.kq_norm = hp.n_expert != NO_KQ_NORM_EXPERTS
        self.freq_factors = dense.get("rope_freqs.weight")  # [hd/2] or None
        self.base_swa = x["rope.freq_base_swa"] or hp.rope_base

    def _rope(self, positions: torch.Tensor, base: float) -> tuple[torch.Tensor, torch.Tensor]:
        hd = self.hparams.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, hd, 2, device=positions.device, dtype=torch.int64).float() / hd))
        if self.freq_factors is not None:
            inv_freq = inv_freq / self.freq_factors.float()  # [hd/2]
        emb = (positions.float()[..., None] * inv_freq).repeat_interleave(2, dim=-1)  # [B, T, hd] f0 f0 f1 f1 ..
        return emb.cos(), emb.sin()

    def prepare(self, cache: KVCache, valid: torch.Tensor) -> Llama4Step:
        positions, start = cache.advance(valid)  # [B, T]
        T, rep = positions.shape[1], self.hparams.n_head // self.hparams.n_head_kv
        mask = attention_mask(cache, start, T)  # [B, 1, T, S]
        chunk_mask = None
        if self.chunk:
            kpos = key_positions(cache, start + T)  # [B, S]
            same = (kpos[:, None, :] // self.chunk) == (positions[:, :, None] // self.chunk)  # [B, T, S]
            chunk_mask = (mask & same[:, None]).repeat(1, 1, rep, 1)  # [B, 1, rep*T, S]
        cos, sin = self._rope(positions, self.hparams.rope_base)
        cos_swa, sin_swa = self._rope(positions, self.base_swa)
        temp = torch.log(torch.floor((positions.float() + 1.0) / TEMP_FLOOR) + 1.0) * TEMP_SCALE + 1.0  # [B, T]
        return Llama4Step(start, T, cos, sin, mask.repeat(1, 1, rep, 1), chunk_mask=chunk_mask, cos_swa=cos_swa,
                          sin_swa=sin_swa, temp=temp[:, None, :, None])

    def attend(self, layer: int, x: torch.Tensor, cache: KVCache, st: StepAttn) -> torch.Tensor:
        w, a = self.layers[layer], self.attn
        B, T, start, H, Hkv, hd = x.shape[0] // st.T, st.T, st.start, a.n_head, a.n_head_kv, a.head_dim
        q = linear(x, w["attn_q"]).reshape(B, T, H, hd).transpose(1, 2)  # [B, H, T, hd]
        k = linear(x, w["attn_k"]).reshape(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
        v = linear(x, w["attn_v"]).reshape(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
        if self.roped[layer]:
            cos, sin = (st.cos_swa, st.sin_swa) if self.chunked[layer] else (st.cos, st.sin)
            q, k = apply_rope_norm(q, cos, sin), apply_rope_norm(k, cos, sin)
            if self.kq_norm:  # HF's Llama4TextL2Norm: RMSNorm without a weight
                q, k = _l2(q, a.eps), _l2(k, a.eps)
        else:
            q = q * st.temp.to(q.dtype)  # [B, H, T, hd]
        keys, vals = cache.store(layer, start, k, v)  # [B, Hkv, S, hd] x2
        mask = st.chunk_mask if self.chunked[layer] else st.mask
        q = q.reshape(B, Hkv, -1, hd)  # [B, Hkv, rep*T, hd]: query heads folded per kv head (layers.attention)
        out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=1.0 / math.sqrt(hd))
        out = out.reshape(B, H, T, hd).transpose(1, 2).reshape(B * T, H * hd)  # [N, H*hd]
        return linear(out, w["attn_output"])  # [N, d]

    def ffn(self, layer: int, x: torch.Tensor, observer: LayerObserver) -> torch.Tensor:
        w = self.layers[layer]
        if not self.hparams.is_moe_layer(layer):
            return dense_ffn(x, w)  # nothing fetched
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        weights, ids = self.route(layer, x)  # [n, k], [n, k]
        observer.routed(layer, ids)
        n, k = ids.shape
        rows = (x[:, None, :] * weights[..., None]).reshape(n * k, -1)  # [n*k, d]: each pair's scaled input
        ones = torch.ones(n * k, 1, dtype=x.dtype, device=x.device)  # [n*k, 1]
        routed = self.experts().mix(layer, rows, ones, ids.reshape(n * k, 1)).reshape(n, k, -1).sum(1)  # [n, d]
        return routed + shared_expert(x, w)  # [n, d]


def _l2(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
