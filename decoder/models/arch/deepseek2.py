"""DeepSeek-V2/V3/R1 and Kimi-K2, stored by llama.cpp as architecture "deepseek2".

What is new next to the generic MoE transformer:

- **Multi-head latent attention (MLA).** q comes from `attn_q`, or from a low-rank path
  `attn_q_a -> attn_q_a_norm -> attn_q_b` (q_lora_rank > 0); each head's q is a `nope` part and a
  roped part. `attn_kv_a_mqa` gives one compressed latent (`kv_lora_rank`, RMS-normed by
  `attn_kv_a_norm`) plus one roped key part shared by all heads. A head's key is
  [k_b(latent), shared rope key] and its value v_b(latent); llama.cpp's current converter writes
  `attn_k_b` / `attn_v_b` (the split of HF's `kv_b_proj`), older ones `attn_kv_b`: both load.
  The softmax scale is mscale^2 / sqrt(nope + rope), mscale being YaRN's magnitude correction
  (`rope.scaling.yarn_log_multiplier`) when the rope is YaRN-scaled, as llama.cpp computes it.
- **The cache holds the latent, not per-head k/v** (`LatentCache`): per token and layer
  kv_lora_rank + rope dims numbers (576 for DeepSeek-V3) instead of heads x (k + v) (40960):
  71x less memory, which is what lets long contexts fit next to a streamed expert arena. The
  attention runs in the "absorbed" form llama.cpp uses: each head's nope query goes through its
  k_b into latent space, so every head attends to the one cached latent (MQA with one kv
  head); the attended latent goes through the head's v_b. Exactly the same scores and outputs
  as expanding k/v per head, up to float summation order.
- **Leading dense layers** (`leading_dense_block_count`): their FFN is a dense SwiGLU
  (`ffn_gate/up/down`), no router, no experts to fetch.
- **Routing**: sigmoid scores (`expert_gating_func` 2; 1 or absent: softmax, DeepSeek-V2), the
  per-expert bias `exp_probs_b` added for the *selection* only, group-limited top-k (groups
  ranked by the sum of their top-2 biased scores, `expert_group_used_count` of
  `expert_group_count` kept), weights from the unbiased scores, renormalized when
  `expert_weights_norm`, times `expert_weights_scale`; shared experts (un-gated) added.

Rope is llama.cpp's normal (interleaved-pair) rope on the GGUF tensors as they are (the
converter does not permute them): HF's `rope_interleave=True`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ....common.arch import MLADims, mla_dims
from ....common.layout import HParams, ModelFormatError
from ..weights import QuantWeight
from . import qwen3moe
from ..layers import (
    KVCache,
    cache_zeros,
    StepAttn,
    Weights,
    apply_rope_norm,
    attention_mask,
    linear,
    rms_norm,
)
from ..moe_transformer import LayerObserver, MoETransformer

ARCH = "deepseek2"

# GGUF name -> Hugging Face `DeepseekV3ForCausalLM` state-dict name ("{i}" = layer). attn_k_b and
# attn_v_b (current converters) have no HF name of their own: `hf_kv_b` joins them into kv_b_proj.
TENSOR_NAMES: dict[str, str] = {
    **qwen3moe.COMMON_NAMES,
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_q_a.weight": "model.layers.{i}.self_attn.q_a_proj.weight",
    "blk.{i}.attn_q_a_norm.weight": "model.layers.{i}.self_attn.q_a_layernorm.weight",
    "blk.{i}.attn_q_b.weight": "model.layers.{i}.self_attn.q_b_proj.weight",
    "blk.{i}.attn_kv_a_mqa.weight": "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",
    "blk.{i}.attn_kv_a_norm.weight": "model.layers.{i}.self_attn.kv_a_layernorm.weight",
    "blk.{i}.attn_kv_b.weight": "model.layers.{i}.self_attn.kv_b_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
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
HF_FUSED: dict[str, tuple[str, ...]] = {
    "model.layers.{i}.mlp.experts.gate_up_proj": ("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),
}

GATING = {0: "softmax", 1: "softmax", 2: "sigmoid"}  # expert_gating_func; 0 = absent (DeepSeek-V2 files)


def hf_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """HF's kv_b_proj [H*(nope+v), kv_lora] from the converter's k_b [H, kv_lora, nope] and
    v_b [H, v, kv_lora] (the inverse of its split)."""
    kv_lora = v_b.shape[2]
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, kv_lora)  # [H*(nope+v), kv_lora]


def split_kv_b(kv_b: torch.Tensor, m: MLADims, n_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The converter's split of an older file's kv_b [H*(nope+v), kv_lora] -> k_b [H, kv_lora, nope],
    v_b [H, v, kv_lora]."""
    kv = kv_b.reshape(n_head, m.nope + m.v, m.kv_lora)  # [H, nope+v, kv_lora]
    return kv[:, :m.nope].transpose(1, 2), kv[:, m.nope:]


# -- rope ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MLARope:
    """Rope frequencies of the roped dims and the softmax scale, YaRN included."""

    inv_freq: torch.Tensor  # [rope/2]
    cos_scale: float  # YaRN's magnitude factor on cos/sin (1 when yarn_log_multiplier is set)
    kq_scale: float  # softmax scale: mscale^2 / sqrt(nope + rope)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def mla_rope(hp: HParams, m: MLADims) -> MLARope:
    """llama.cpp's rope for deepseek2: plain, or YaRN (`rope.scaling.type` "yarn").

    YaRN blends, per frequency, the interpolated (1/factor) and the original rotation with a
    ramp between the dims `beta_fast` / `beta_slow` rotations fit in the original context; the
    attention scale gets mscale^2, mscale = 1 + 0.1 * mscale_all_dim * ln(factor) (the file
    stores 0.1 * mscale_all_dim as yarn_log_multiplier; llama.cpp divides the 0.1 back out)."""
    x, dim, base = hp.extra, m.rope, hp.rope_base
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]
    kind = x["rope.scaling.type"] or "none"
    if kind == "none" or x["rope.scaling.factor"] in (0.0, 1.0):
        return MLARope(inv_freq, 1.0, 1.0 / math.sqrt(m.k))
    if kind != "yarn":
        raise ModelFormatError(f"deepseek2: rope scaling {kind!r} is not supported (supported: none, yarn)")
    factor, n_ctx = x["rope.scaling.factor"], x["rope.scaling.original_context_length"]
    if n_ctx <= 0:
        raise ModelFormatError("deepseek2: yarn rope scaling needs rope.scaling.original_context_length")

    def corr_dim(rotations: float) -> float:
        return dim * math.log(n_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(x["rope.scaling.yarn_beta_fast"])), 0)
    high = min(math.ceil(corr_dim(x["rope.scaling.yarn_beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)  # [dim/2]
    extrapolate = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate
    inv_freq = inv_freq / factor * (1.0 - extrapolate) + inv_freq * extrapolate  # [dim/2]
    log_mul = x["rope.scaling.yarn_log_multiplier"] / 0.1  # = HF's mscale_all_dim
    cos_scale = 1.0 if log_mul else yarn_mscale(factor)  # llama.cpp's attn_factor before its cancel-out
    mscale = cos_scale * (1.0 + 0.1 * log_mul * math.log(factor))
    return MLARope(inv_freq, cos_scale, mscale * mscale / math.sqrt(m.k))


# -- cache -----------------------------------------------------------------------------------
@dataclass
class LatentCache(KVCache):
    """MLA's cache: per layer [B, 1, capacity, kv_lora + rope], each token's normed kv latent then
    its roped shared key (what llama.cpp caches). `v` views the latent part of `k`: values are the
    latent itself, expanded per head only after attending."""

    @classmethod
    def latent(cls, n_layer: int, batch: int, m: MLADims, capacity: int, device: torch.device,
               dtype: torch.dtype) -> LatentCache:
        k = [cache_zeros((batch, 1, capacity, m.kv_lora + m.rope), device, dtype) for _ in range(n_layer)]
        return cls(k=k, v=[t[..., :m.kv_lora] for t in k],
                   valid=torch.zeros(batch, capacity, dtype=torch.bool, device=device),
                   next_pos=torch.zeros(batch, dtype=torch.int64, device=device))


# -- routing ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    gating: str  # "sigmoid" | "softmax"
    top_k: int
    n_group: int  # expert groups (<= 1: no group limit)
    topk_group: int  # groups kept per token
    norm: bool  # renormalize the k weights
    scale: float  # routed_scaling_factor


def routing_of(hp: HParams) -> Routing:
    x = hp.extra
    func = x["expert_gating_func"]
    if func not in GATING:
        raise ModelFormatError(f"deepseek2: expert_gating_func={func} is not supported (1 softmax, 2 sigmoid)")
    r = Routing(GATING[func], hp.n_expert_used, x["expert_group_count"], x["expert_group_used_count"],
                hp.norm_topk_prob, x["expert_weights_scale"] or 1.0)
    if r.n_group > 1:
        per = hp.n_expert // r.n_group
        if hp.n_expert % r.n_group or not 1 <= r.topk_group <= r.n_group or r.top_k > r.topk_group * per or per < 2:
            raise ModelFormatError(f"deepseek2: expert groups do not fit: {hp.n_expert} experts in {r.n_group} groups, "
                                   f"{r.topk_group} groups kept, top-{r.top_k}")
    return r


def selection_scores(logits: torch.Tensor, bias: torch.Tensor | None, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [N, E] the weights come from, selection scores [N, E]: biased, -inf outside the
    kept groups) for router logits [N, E], in float32."""
    logits = logits.float()
    scores = torch.sigmoid(logits) if r.gating == "sigmoid" else torch.softmax(logits, dim=-1)  # [N, E]
    choice = scores if bias is None else scores + bias.float()  # [N, E]
    if r.n_group > 1:
        N, E = choice.shape
        grouped = choice.view(N, r.n_group, E // r.n_group)  # [N, G, E/G]
        group_score = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]: sum of each group's top 2
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(r.topk_group, dim=-1).indices, True)  # [N, G]
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, E)  # [N, E]
    return scores, choice


def route_grouped(logits: torch.Tensor, bias: torch.Tensor | None, r: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [N, k] (logits' dtype) and expert ids [N, k]: selection on the biased scores, weights
    from the unbiased ones, renormalized, scaled."""
    scores, choice = selection_scores(logits, bias, r)
    ids = choice.topk(r.top_k, dim=-1).indices  # [N, k]
    weights = scores.gather(1, ids)  # [N, k]
    if r.norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)  # [N, k]
    return (weights * r.scale).to(logits.dtype), ids


def _dense(w: torch.Tensor | QuantWeight) -> torch.Tensor:
    """A weight as a float tensor (a 2-D one kept as quantized blocks is decoded)."""
    if isinstance(w, QuantWeight):
        return w.rows(torch.arange(w.shape[0]), torch.float32)  # [n_out, n_in]
    return w


class Model(MoETransformer):
    """The generic MoE transformer with MLA attention, dense leading layers and grouped
    sigmoid routing."""

    def __init__(self, hparams: HParams, dense: dict[str, torch.Tensor]):
        super().__init__(hparams, dense)
        hp = hparams
        self.mla = m = mla_dims(hp)
        self.rope = mla_rope(hp, m)
        self.routing = routing_of(hp)
        # per layer, for the absorbed attention: k_b^T [H, nope, kv_lora] and v_b^T [H, kv_lora, v]
        self.k_bT: list[torch.Tensor] = []
        self.v_bT: list[torch.Tensor] = []
        for w in self.layers:
            if "attn_kv_b" in w:
                k_b, v_b = split_kv_b(_dense(w["attn_kv_b"]), m, hp.n_head)
            else:
                k_b, v_b = w["attn_k_b"], w["attn_v_b"]  # [H, kv_lora, nope], [H, v, kv_lora]
            self.k_bT.append(k_b.transpose(1, 2).contiguous().to(self.dtype))
            self.v_bT.append(v_b.transpose(1, 2).contiguous().to(self.dtype))

    def new_cache(self, batch: int, capacity: int) -> LatentCache:
        return LatentCache.latent(self.hparams.n_layer, batch, self.mla, capacity, self.device, self.kv_dtype)

    def prepare(self, cache: KVCache, valid: torch.Tensor) -> StepAttn:
        positions, start = cache.advance(valid)  # [B, T]
        T = positions.shape[1]
        freqs = positions.float()[..., None] * self.rope.inv_freq.to(positions.device)  # [B, T, rope/2]
        emb = freqs.repeat_interleave(2, dim=-1)  # [B, T, rope]: pairs (2i, 2i+1) share a frequency
        cos, sin = emb.cos() * self.rope.cos_scale, emb.sin() * self.rope.cos_scale  # [B, T, rope]
        mask = attention_mask(cache, start, T).repeat(1, 1, self.hparams.n_head, 1)  # [B, 1, H*T, S]
        return StepAttn(start, T, cos, sin, mask)

    def _q(self, x: torch.Tensor, w: Weights) -> torch.Tensor:
        if "attn_q_a" in w:
            return linear(rms_norm(linear(x, w["attn_q_a"]), w["attn_q_a_norm"], self.hparams.rms_eps), w["attn_q_b"])
        return linear(x, w["attn_q"])  # [N, H*k]

    def attend(self, layer: int, x: torch.Tensor, cache: KVCache, st: StepAttn) -> torch.Tensor:
        """MLA over normed rows x [N, d], absorbed form (see the module docstring)."""
        w, m, H = self.layers[layer], self.mla, self.hparams.n_head
        B, T, start = x.shape[0] // st.T, st.T, st.start
        q = self._q(x, w).view(B, T, H, m.k).transpose(1, 2)  # [B, H, T, k]
        q_nope, q_pe = q.split([m.nope, m.rope], dim=-1)  # [B, H, T, nope], [B, H, T, rope]
        kv = linear(x, w["attn_kv_a_mqa"]).view(B, T, m.kv_lora + m.rope)  # [B, T, kv_lora + rope]
        c, k_pe = kv.split([m.kv_lora, m.rope], dim=-1)  # [B, T, kv_lora], [B, T, rope]
        c = rms_norm(c, w["attn_kv_a_norm"], self.hparams.rms_eps)  # [B, T, kv_lora]
        q_pe = apply_rope_norm(q_pe, st.cos, st.sin)  # [B, H, T, rope]
        k_pe = apply_rope_norm(k_pe[:, None], st.cos, st.sin)[:, 0]  # [B, T, rope]
        cache.k[layer][:, 0, start:start + T] = torch.cat((c, k_pe), dim=-1)
        lat = cache.k[layer][:, :, :start + T].to(q.dtype)  # [B, 1, S, kv_lora + rope]
        q_lat = torch.cat((q_nope @ self.k_bT[layer], q_pe), dim=-1)  # [B, H, T, kv_lora + rope]
        q_lat = q_lat.reshape(B, 1, H * T, m.kv_lora + m.rope)  # [B, 1, H*T, .]: heads folded into rows
        out = F.scaled_dot_product_attention(q_lat, lat, lat[..., :m.kv_lora], attn_mask=st.mask,
                                             scale=self.rope.kq_scale)  # [B, 1, H*T, kv_lora]
        out = out.reshape(B, H, T, m.kv_lora) @ self.v_bT[layer]  # [B, H, T, v]
        return linear(out.transpose(1, 2).reshape(B * T, H * m.v), w["attn_output"])  # [N, d]

    # -- FFN ------------------------------------------------------------------------------
    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.layers[layer]
        return route_grouped(linear(x, w["ffn_gate_inp"]), w.get("exp_probs_b.bias"), self.routing)

    def router_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Selection scores [N, E] of hidden rows h [N, d]: their top-k are the experts `route`
        picks (bias and group limit included), which is what a prefetcher ranks by."""
        w = self.layers[layer]
        logits = linear(rms_norm(h, w["ffn_norm"], self.hparams.rms_eps), w["ffn_gate_inp"])  # [N, E]
        return selection_scores(logits, w.get("exp_probs_b.bias"), self.routing)[1]

    def ffn(self, layer: int, x: torch.Tensor, observer: LayerObserver) -> torch.Tensor:
        if self.hparams.is_moe_layer(layer):
            return super().ffn(layer, x, observer)
        w = self.layers[layer]  # a leading dense layer: SwiGLU, nothing fetched
        return linear(F.silu(linear(x, w["ffn_gate"])) * linear(x, w["ffn_up"]), w["ffn_down"])  # [n, d]
