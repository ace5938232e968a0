"""Qwen3-MoE: GQA attention with per-head q/k RMSNorm and NEOX rope, a sparse MoE FFN in every
layer (softmax router, top-k, renormalized weights when `norm_topk_prob`), no shared expert.
Everything about it is in its `common.arch` entry; the forward pass is the generic one.

llama.cpp's converter stores q/k unpermuted for this family (NEOX rope), so the GGUF tensors
are the Hugging Face tensors with the ggml shape order reversed.
"""

from __future__ import annotations

from ..moe_transformer import MoETransformer as Model  # noqa: F401  (the family's model)

ARCH = "qwen3moe"

# GGUF name -> Hugging Face `Qwen3MoeForCausalLM` state-dict name ("{i}" = layer). The two
# per-expert gate/up tensors go, gate rows first, into HF's fused `gate_up_proj` (see HF_FUSED).
# The names every family's HF model shares (embeddings, final norm, head, the attention norm).
COMMON_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
}
ATTENTION_NAMES: dict[str, str] = {
    **COMMON_NAMES,
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.down_proj",
}
QK_NORM_NAMES: dict[str, str] = {
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}
TENSOR_NAMES: dict[str, str] = {**ATTENTION_NAMES, **QK_NORM_NAMES}
HF_FUSED: dict[str, tuple[str, ...]] = {
    "model.layers.{i}.mlp.experts.gate_up_proj": ("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),
}
