"""OLMoE: attention with RMSNorm over the whole projected q (n_head*hd) and k (n_kv*hd) before
the head split, NEOX rope, no biases; every layer's FFN is a sparse MoE with a softmax router
and top-k weights NOT renormalized (llama.cpp hardcodes that for this family). llama.cpp's
loader requires n_head_kv == n_head; the forward pass here does not. All of it is table
entries (`common.arch`): the forward pass is the generic one.
"""

from __future__ import annotations

from . import qwen3moe
from ..moe_transformer import MoETransformer as Model  # noqa: F401  (the family's model)

ARCH = "olmoe"

# GGUF name -> Hugging Face `OlmoeForCausalLM` state-dict name ("{i}" = layer): the same names
# as Qwen3-MoE, but q_norm/k_norm weights are [n_head*hd] / [n_kv*hd], not [hd].
TENSOR_NAMES: dict[str, str] = dict(qwen3moe.TENSOR_NAMES)
HF_FUSED: dict[str, tuple[str, ...]] = dict(qwen3moe.HF_FUSED)
