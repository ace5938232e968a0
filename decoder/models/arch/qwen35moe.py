"""Qwen3.5-MoE (Qwen3.5-122B-A10B, -397B-A17B): Qwen3-Next's hybrid (see qwen3next.py) with the
Gated DeltaNet's projections split as Hugging Face's Qwen3.5 has them: `in_proj_qkv` ->
`attn_qkv`, `in_proj_z` -> `attn_gate`, `in_proj_b` -> `ssm_beta`, `in_proj_a` -> `ssm_alpha`.

The one behavioural difference is the value-head order: llama.cpp's converter
(_LinearAttentionVReorderBase) reorders value heads from HF's grouped order (the r value heads
of key head 0, then of key head 1, ...) to tiled order (value head j reads key head j % n_k), so
that ggml can broadcast q/k; every value-head tensor (v rows of attn_qkv and its conv channels,
attn_gate, ssm_beta/alpha, ssm_a, ssm_dt, ssm_out columns) is permuted alike, and the model
computes in that order. Rope is Qwen3.5's interleaved M-RoPE, which for text (the same position
on all three axes) is plain partial NEOX rope. MTP (`nextn_predict_layers`) blocks at the end of
the stack are not run (`HParams.n_layer` excludes them).
"""

from __future__ import annotations

from . import qwen3next

ARCH = "qwen35moe"


class Model(qwen3next.Model):
    V_HEADS = "tiled"


# GGUF name -> Hugging Face `Qwen3_5MoeForCausalLM` name; qwen3next's, with the split projections.
TENSOR_NAMES: dict[str, str] = {g: h for g, h in qwen3next.TENSOR_NAMES.items() if "ssm_ba" not in g}
TENSOR_NAMES.update({
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.linear_attn.in_proj_qkv.weight",
    "blk.{i}.attn_gate.weight": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "blk.{i}.ssm_beta.weight": "model.layers.{i}.linear_attn.in_proj_b.weight",
    "blk.{i}.ssm_alpha.weight": "model.layers.{i}.linear_attn.in_proj_a.weight",
})
HF_FUSED: dict[str, tuple[str, ...]] = {
    h: parts for h, parts in qwen3next.HF_FUSED.items() if "in_proj_qkvz" not in h
}
NORM_PLUS_ONE = qwen3next.NORM_PLUS_ONE
