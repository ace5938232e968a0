"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): GQA attention with q/k/v biases and NEOX rope, no
q/k norms; every layer's FFN is a sparse MoE (softmax router, top-k, weights NOT renormalized:
llama.cpp hardcodes that for this family) plus an always-on shared expert of width
`expert_shared_feed_forward_length`, scaled per token by sigmoid(ffn_gate_inp_shexp . x) and
added to the routed output.

The shared expert is dense (resident like attention), so only the routed experts stream.
"""

from __future__ import annotations

import torch

from ..experts import ExpertSource
from . import qwen3moe
from .layers import shared_expert

ARCH = "qwen2moe"
QK_NORM = "none"

# GGUF name -> Hugging Face `Qwen2MoeForCausalLM` state-dict name ("{i}" = layer).
TENSOR_NAMES: dict[str, str] = qwen3moe.names_without_qk_norms()
TENSOR_NAMES.update({
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.ffn_gate_shexp.weight": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    # GGUF keeps this as a [d] vector; HF's Linear(d, 1) weight is [1, d].
    "blk.{i}.ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
})
HF_FUSED: dict[str, tuple[str, ...]] = dict(qwen3moe.HF_FUSED)


class Model(qwen3moe.Model):
    """Qwen3-MoE's forward pass without q/k norms (biases come with the weights) plus a shared expert."""

    qk_norm = QK_NORM

    def ffn(self, layer: int, x: torch.Tensor, experts: ExpertSource) -> torch.Tensor:
        """Routed experts + gated shared expert on normed rows x [n, d] -> [n, d]."""
        routed = super().ffn(layer, x, experts)  # [n, d]
        return routed + shared_expert(x, self.layers[layer])  # [n, d]
