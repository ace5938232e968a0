"""Qwen3-MoE: GQA attention with per-head q/k RMSNorm and NEOX rope, a sparse MoE FFN in every
layer (softmax router, top-k, renormalized weights when `norm_topk_prob`), no shared expert.

llama.cpp's converter stores q/k unpermuted for this family (NEOX rope), so the GGUF tensors
are the Hugging Face tensors with the ggml shape order reversed.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ...common.layout import HParams
from ..experts import ExpertSource
from .layers import AttnShape, KVCache, StepAttn, Weights, attention, embed, linear, moe, rms_norm, step_attn

ARCH = "qwen3moe"
QK_NORM = "head"

# GGUF name -> Hugging Face `Qwen3MoeForCausalLM` state-dict name ("{i}" = layer). The two
# per-expert gate/up tensors go, gate rows first, into HF's fused `gate_up_proj` (see HF_FUSED).
TENSOR_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.down_proj",
}
HF_FUSED: dict[str, tuple[str, ...]] = {
    "model.layers.{i}.mlp.experts.gate_up_proj": ("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),
}

AfterLayer = Callable[[int, torch.Tensor], None]


def names_without_qk_norms() -> dict[str, str]:
    """TENSOR_NAMES for the families without q/k norm weights (Mixtral, Qwen2-MoE)."""
    qk_norms = ("blk.{i}.attn_q_norm.weight", "blk.{i}.attn_k_norm.weight")
    return {g: h for g, h in TENSOR_NAMES.items() if g not in qk_norms}


def layer_weights(dense: dict[str, torch.Tensor], layer: int) -> Weights:
    """One layer's dense tensors keyed by short name: `attn_q`, `attn_q.bias`, ..."""
    prefix = f"blk.{layer}."
    out: Weights = {}
    for name, t in dense.items():
        if name.startswith(prefix):
            short = name[len(prefix):]
            out[short.removesuffix(".weight")] = t
    return out


class Model:
    """Forward pass over dense weights (materialized at start) and an `ExpertSource`."""

    qk_norm = QK_NORM
    rope = "neox"

    def __init__(self, hparams: HParams, dense: dict[str, torch.Tensor]):
        self.hparams = hp = hparams
        self.embed = dense["token_embd.weight"]  # [V, d]
        self.norm = dense["output_norm.weight"]  # [d]
        self.lm_head = dense.get("output.weight", self.embed)  # [V, d]; tied when absent
        self.layers = [layer_weights(dense, i) for i in range(hp.n_layer)]
        self.attn = AttnShape(hp.n_head, hp.n_head_kv, hp.head_dim, hp.rope_base, hp.rms_eps,
                              self.qk_norm, self.rope)
        self.device, self.dtype = self.norm.device, self.norm.dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        hp = self.hparams
        return KVCache.empty(hp.n_layer, batch, hp.n_head_kv, hp.head_dim, capacity, self.device, self.dtype)

    def router_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """That layer's ffn_norm then router applied to hidden rows h [N, d] -> [N, n_expert]."""
        w = self.layers[layer]
        return linear(rms_norm(h, w["ffn_norm"], self.hparams.rms_eps), w["ffn_gate_inp"])

    def ffn(self, layer: int, x: torch.Tensor, experts: ExpertSource) -> torch.Tensor:
        """The feed-forward half of a layer on normed rows x [n, d]; other families add shared experts."""
        hp = self.hparams
        return moe(x, self.layers[layer]["ffn_gate_inp"], experts, layer, hp.n_expert_used, hp.norm_topk_prob)

    def _block(self, layer: int, h: torch.Tensor, active: torch.Tensor, cache: KVCache, st: StepAttn,
               experts: ExpertSource, after_attention: AfterLayer | None = None) -> torch.Tensor:
        w, eps = self.layers[layer], self.hparams.rms_eps
        h = h + attention(rms_norm(h, w["attn_norm"], eps), w, self.attn, layer, cache, st)  # [N, d]
        real = h[active]  # [n, d] real tokens only: pads fetch no experts
        if after_attention is not None:
            after_attention(layer, real)
        x = rms_norm(real, w["ffn_norm"], eps)  # [n, d]
        return h.index_put((active,), self.ffn(layer, x, experts), accumulate=True)  # [N, d]

    def forward(self, tokens: torch.Tensor, cache: KVCache, experts: ExpertSource,
                valid: torch.Tensor | None = None, after_layer: AfterLayer | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Logits [B, T, V] (or [B, V] with `last_only`) for tokens [B, T] appended to `cache`.

        `valid` [B, T] marks real tokens (False = left padding / finished sequence); their
        rows are computed through attention but skip the MoE and never move positions.
        `after_layer(i, h)` sees the real tokens' hidden rows [n, d] after layer i; when it has
        an `after_attention(i, h)` method, that sees them after layer i's attention, before its MoE.
        """
        B, T = tokens.shape
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.to(torch.bool)
        positions, start = cache.advance(valid)  # [B, T]
        active = valid.reshape(-1).nonzero().squeeze(1)  # [n] row indices of real tokens
        st = step_attn(self.attn, cache, positions, start)  # rope tables and mask, shared by every layer
        experts.begin_step()
        after_attention = getattr(after_layer, "after_attention", None)
        h = embed(tokens.reshape(-1), self.embed, self.dtype)  # [N, d]
        for i in range(self.hparams.n_layer):
            h = self._block(i, h, active, cache, st, experts, after_attention)
            if after_layer is not None:
                after_layer(i, h[active])
        h = h.reshape(B, T, -1)[:, -1] if last_only else h.reshape(B, T, -1)  # [B, d] | [B, T, d]
        return linear(rms_norm(h, self.norm, self.hparams.rms_eps), self.lm_head)  # [B, (T,) V]

    __call__ = forward
