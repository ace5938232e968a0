"""MiniMax-M2 (`MiniMaxM2ForCausalLM`), stored by llama.cpp as architecture "minimax-m2".

GQA attention with q/k RMSNorm over all heads at once (weights H*hd and Hkv*hd wide, as OLMoE),
NEOX rope on the first `rope.dimension_count` dims of each head (64 of 128); a sparse MoE FFN in
every layer: sigmoid scores plus the selection bias `exp_probs_b` pick the top-k, their unbiased
scores renormalized (llama.cpp hardcodes the renormalization for this family) and scaled by
`expert_weights_scale` where the file has one. No shared expert. The router is GLM-4.x's
(`glm4moe.SigmoidRouted`); the rest is the generic forward pass.
"""

from __future__ import annotations

import torch

from ....common.layout import HParams
from . import qwen3moe
from .glm4moe import SigmoidRouted, sigmoid_routing

ARCH = "minimax-m2"

# GGUF name -> Hugging Face `MiniMaxM2ForCausalLM` state-dict name ("{i}" = layer).
TENSOR_NAMES: dict[str, str] = {
    **qwen3moe.TENSOR_NAMES,
    "blk.{i}.exp_probs_b.bias": "model.layers.{i}.mlp.e_score_correction_bias",
}
HF_FUSED: dict[str, tuple[str, ...]] = dict(qwen3moe.HF_FUSED)


class Model(SigmoidRouted):
    def __init__(self, hparams: HParams, dense: dict[str, torch.Tensor]):
        super().__init__(hparams, dense)
        self.routing = sigmoid_routing(hparams, hparams.arch, norm=True)  # whatever expert_weights_norm says
