"""GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`), stored by llama.cpp as architecture "glm4moe".

Next to the generic MoE transformer:

- **Attention**: GQA with q/k/v biases, a per-head q/k RMSNorm where the file has one (GLM-4.5
  355B and later; GLM-4.5-Air has none), NEOX rope on the first `rope.dimension_count` dims of each
  head (partial_rotary_factor 0.5), the rest un-roped.
- **FFN**: the pre-FFN norm is `post_attention_norm`; the first `leading_dense_block_count` layers
  are a dense SwiGLU; the others route with sigmoid scores plus the selection bias `exp_probs_b`
  (DeepSeek-V3's router, without expert groups: llama.cpp reads none for this family), weights
  renormalized when `expert_weights_norm`, times `expert_weights_scale`, plus an un-gated shared
  expert `expert_shared_count` experts wide.
- **NextN / MTP**: the converter appends `nextn_predict_layers` blocks after the stack (with
  eh_proj, enorm, hnorm, their own experts). They only serve speculative decoding: `HParams.n_layer`
  excludes them, their experts are not indexed or served, their dense tensors are not loaded.

llama.cpp's converter stores q/k unpermuted (NEOX rope), so the GGUF tensors are HF's with the
ggml shape order reversed.
"""

from __future__ import annotations

import torch

from ....common.layout import HParams, ModelFormatError
from . import qwen3moe
from .deepseek2 import GATING, Routing, route_grouped, selection_scores
from ..layers import AttnShape, dense_ffn, linear, rms_norm
from ..moe_transformer import LayerObserver, MoETransformer

ARCH = "glm4moe"

# GGUF name -> Hugging Face `Glm4MoeForCausalLM` state-dict name ("{i}" = layer).
TENSOR_NAMES: dict[str, str] = {
    **qwen3moe.COMMON_NAMES,
    **{f"blk.{{i}}.attn_{g}.{kind}": f"model.layers.{{i}}.self_attn.{h}_proj.{kind}"
       for g, h in (("q", "q"), ("k", "k"), ("v", "v")) for kind in ("weight", "bias")},
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    **qwen3moe.QK_NORM_NAMES,
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.exp_probs_b.bias": "model.layers.{i}.mlp.gate.e_score_correction_bias",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.down_proj",
    "blk.{i}.ffn_gate_shexp.weight": "model.layers.{i}.mlp.shared_experts.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "model.layers.{i}.mlp.shared_experts.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "model.layers.{i}.mlp.shared_experts.down_proj.weight",
}
HF_FUSED: dict[str, tuple[str, ...]] = dict(qwen3moe.HF_FUSED)


def sigmoid_routing(hp: HParams, arch: str, norm: bool) -> Routing:
    """The router of the sigmoid-gated families (no expert groups): `expert_gating_func` 2 (sigmoid,
    also when absent) or 1 (softmax), `expert_weights_scale` (0 or absent: 1)."""
    x = hp.extra
    func = x["expert_gating_func"]
    if func not in GATING or func == 0:
        raise ModelFormatError(f"{arch}: expert_gating_func={func} is not supported (1 softmax, 2 sigmoid)")
    return Routing(GATING[func], hp.n_expert_used, 1, 1, norm, x["expert_weights_scale"] or 1.0)


def partial_rope_dim(hp: HParams, arch: str) -> int:
    """Roped dims per head (rope.dimension_count; absent: all), checked."""
    rd = hp.extra["rope.dimension_count"] or hp.head_dim
    if rd % 2 or not 0 < rd <= hp.head_dim:
        raise ModelFormatError(f"{arch}: rope.dimension_count={rd} must be even and at most the head dim {hp.head_dim}")
    return rd


class SigmoidRouted(MoETransformer):
    """The generic transformer with partial rope and the biased sigmoid router (GLM-4.x, MiniMax-M2)."""

    def __init__(self, hparams: HParams, dense: dict[str, torch.Tensor], qk_norm: str | None = None):
        super().__init__(hparams, dense)
        hp = hparams
        a = self.attn
        self.attn = AttnShape(a.n_head, a.n_head_kv, a.head_dim, a.rope_base, a.eps, qk_norm or a.qk_norm, a.rope,
                              partial_rope_dim(hp, hp.arch))
        self.routing = sigmoid_routing(hp, hp.arch, hp.norm_topk_prob)

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.layers[layer]
        return route_grouped(linear(x, w["ffn_gate_inp"]), w.get("exp_probs_b.bias"), self.routing)  # [n, k] x2

    def router_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Selection scores [N, E] (biased): their top-k are what `route` picks, what a prefetcher ranks by."""
        w = self.layers[layer]
        logits = linear(rms_norm(h, w["ffn_norm"], self.hparams.rms_eps), w["ffn_gate_inp"])  # [N, E]
        return selection_scores(logits, w.get("exp_probs_b.bias"), self.routing)[1]


class Model(SigmoidRouted):
    """GLM-4.x: q/k norm where present, `post_attention_norm` before the FFN, leading dense layers."""

    def __init__(self, hparams: HParams, dense: dict[str, torch.Tensor]):
        has_norm = "blk.0.attn_q_norm.weight" in dense
        super().__init__(hparams, dense, qk_norm="head" if has_norm else "none")
        for w in self.layers:  # the generic block and router_logits norm with `ffn_norm`
            w["ffn_norm"] = w["post_attention_norm"]

    def ffn(self, layer: int, x: torch.Tensor, observer: LayerObserver) -> torch.Tensor:
        if self.hparams.is_moe_layer(layer):
            return super().ffn(layer, x, observer)  # routed + shared
        return dense_ffn(x, self.layers[layer])  # a leading dense layer: nothing fetched

