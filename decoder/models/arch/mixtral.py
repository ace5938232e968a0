"""Mixtral, stored by llama.cpp as architecture "llama" with `expert_count` > 0.

GQA attention without q/k norms or biases, llama.cpp's normal (interleaved) rope, a sparse
MoE FFN in every layer: softmax router over all experts, top-k, renormalized weights (which
equals Mixtral's softmax over the top-k logits), SwiGLU experts of width
`feed_forward_length`. All of it is table entries (`common.arch`): the forward pass is the
generic one.

llama.cpp's converter permutes the rows of q/k inside each head (`permute` in
convert_hf_to_gguf.py) so that rotating adjacent pairs equals Hugging Face's rotate-half on
the original weights; we rope the GGUF tensors as they are, and `unpermute_qk` undoes the
permutation for anyone who needs HF's layout (the HF comparison test).
"""

from __future__ import annotations

import torch

from . import qwen3moe
from ..moe_transformer import MoETransformer as Model  # noqa: F401  (the family's model)

ARCH = "llama"

# GGUF name -> Hugging Face `MixtralForCausalLM` state-dict name ("{i}" = layer). q/k also
# need `unpermute_qk` (see HF_UNPERMUTE); gate/up go into the fused `gate_up_proj`.
TENSOR_NAMES: dict[str, str] = dict(qwen3moe.ATTENTION_NAMES)
HF_FUSED: dict[str, tuple[str, ...]] = dict(qwen3moe.HF_FUSED)
# GGUF tensors whose rows llama.cpp permuted -> the HParams field with their head count.
HF_UNPERMUTE: dict[str, str] = {"blk.{i}.attn_q.weight": "n_head", "blk.{i}.attn_k.weight": "n_head_kv"}


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of the converter's `permute`: rows [n_head*hd, d] from pair-interleaved back to
    half-split order inside each head (row 2j -> j, row 2j+1 -> hd/2 + j)."""
    rows = w.shape[0]
    hd = rows // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)  # [rows, ...]

