"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): GQA attention with q/k/v biases and NEOX rope, no
q/k norms; every layer's FFN is a sparse MoE (softmax router, top-k, weights NOT renormalized:
llama.cpp hardcodes that for this family) plus an always-on shared expert of width
`expert_shared_feed_forward_length`, scaled per token by sigmoid(ffn_gate_inp_shexp . x) and
added to the routed output.

The shared expert is dense (resident like attention), so only the routed experts stream. All of
it is table entries (`common.arch`): the forward pass is the generic one.
"""

from __future__ import annotations

from . import qwen3moe
from ..moe_transformer import MoETransformer as Model  # noqa: F401  (the family's model)

ARCH = "qwen2moe"

# GGUF name -> Hugging Face `Qwen2MoeForCausalLM` state-dict name ("{i}" = layer).
TENSOR_NAMES: dict[str, str] = dict(qwen3moe.ATTENTION_NAMES)
TENSOR_NAMES.update({
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.ffn_gate_shexp.weight": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    # [d] or [d, 1] in GGUF (see layers.shared_expert); HF's Linear(d, 1) weight is [1, d].
    "blk.{i}.ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
})
HF_FUSED: dict[str, tuple[str, ...]] = dict(qwen3moe.HF_FUSED)

