"""gpt-oss (OpenAI's gpt-oss-20b / -120b), as llama.cpp's converter writes it ("gpt-oss").

What is new next to the generic MoE transformer:
- attention with q/k/v/output biases and a learned per-head "sink" logit (`attn_sinks`) that
  joins each softmax's denominator (it takes a share of the attention but carries no value);
- every even layer attends over a sliding window of `attention.sliding_window` tokens, the odd
  ones over everything (HF's `layer_types`, llama.cpp's swa pattern 2);
- YaRN rope (NEOX layout) as Hugging Face computes it, cos/sin scaled by 0.1 ln(factor) + 1;
- the pre-FFN norm is named `post_attention_norm` (aliased to the generic `ffn_norm` here);
- a biased router: top-k of the logits, then a softmax over those k (`layers.route_topk_softmax`);
- experts with biases and the clamped SwiGLU (`ArchSpec.expert_act`), which every expert
  source computes; MXFP4 experts in the real files.

The converter splits HF's interleaved `gate_up_proj` (gate = even columns, up = odd) into
separate `ffn_gate_exps` / `ffn_up_exps` tensors (and their biases), so a blob holds gate, up,
down and three biases. `hf_experts` rebuilds HF's fused tensors for the comparison test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ....common.layout import HParams
from . import qwen3moe
from ..layers import KVCache, StepAttn, _proj, _qkv, apply_rope_neox, attention_mask, linear, rms_norm
from ..moe_transformer import MoETransformer

ARCH = "gpt-oss"

# GGUF name -> Hugging Face `GptOssForCausalLM` state-dict name ("{i}" = layer). The experts go
# through `hf_experts` (HF interleaves gate and up columns and stores [E, in, out]).
TENSOR_NAMES: dict[str, str] = {
    **qwen3moe.COMMON_NAMES,
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_sinks.weight": "model.layers.{i}.self_attn.sinks",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.router.weight",
    "blk.{i}.ffn_gate_inp.bias": "model.layers.{i}.mlp.router.bias",
    **{f"blk.{{i}}.attn_{g}.{kind}": f"model.layers.{{i}}.self_attn.{h}_proj.{kind}"
       for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")) for kind in ("weight", "bias")},
}
HF_FUSED: dict[str, tuple[str, ...]] = {}  # see hf_experts


def hf_experts(tensors: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """HF's expert tensors of `layer` from the GGUF ones (numpy order: gate/up [E, ff, d], down
    [E, d, ff], biases [E, n]): gate_up_proj [E, d, 2ff] with gate in the even columns."""
    def g(part: str, kind: str) -> torch.Tensor:
        return tensors[f"blk.{layer}.ffn_{part}_exps.{kind}"]

    gate, up = g("gate", "weight").transpose(1, 2), g("up", "weight").transpose(1, 2)  # [E, d, ff] each
    gate_up = torch.stack((gate, up), dim=-1).flatten(-2)  # [E, d, 2ff]: g0 u0 g1 u1 ...
    gate_up_b = torch.stack((g("gate", "bias"), g("up", "bias")), dim=-1).flatten(-2)  # [E, 2ff]
    p = f"model.layers.{layer}.mlp.experts."
    return {p + "gate_up_proj": gate_up, p + "gate_up_proj_bias": gate_up_b,
            p + "down_proj": g("down", "weight").transpose(1, 2), p + "down_proj_bias": g("down", "bias")}


# -- YaRN --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Yarn:
    """YaRN rope parameters (rope.scaling.* metadata); `factor` 1 = plain rope."""

    factor: float = 1.0
    orig_ctx: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    @classmethod
    def from_hparams(cls, hp: HParams) -> Yarn:
        x = hp.extra
        kind = x.get("rope.scaling.type", "none")
        if kind in ("none", "") or float(x.get("rope.scaling.factor", 1.0)) <= 1.0:
            return cls()
        if kind != "yarn":
            raise ValueError(f"{hp.arch}: rope scaling {kind!r} is not supported (have: yarn, none)")
        orig = int(x.get("rope.scaling.original_context_length", 0))
        if orig <= 0:
            raise ValueError(f"{hp.arch}: YaRN rope needs rope.scaling.original_context_length > 0")
        return cls(float(x["rope.scaling.factor"]), orig, float(x.get("rope.scaling.yarn_beta_fast", 32.0)),
                   float(x.get("rope.scaling.yarn_beta_slow", 1.0)))

    def inv_freq_and_scale(self, head_dim: int, base: float) -> tuple[torch.Tensor, float]:
        """Inverse frequencies [hd/2] and the cos/sin scale, as HF's `_compute_yarn_parameters`
        with `truncate=False` (gpt-oss's config; llama.cpp floors/ceils the ramp ends instead)."""
        pos = base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)  # [hd/2]
        if self.factor <= 1.0:
            return 1.0 / pos, 1.0
        low = max(_corr_dim(self.beta_fast, head_dim, base, self.orig_ctx), 0.0)
        high = min(_corr_dim(self.beta_slow, head_dim, base, self.orig_ctx), head_dim - 1.0)
        if low == high:
            high += 0.001  # HF: no division by zero
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [hd/2]
        extra = 1 - ramp  # share of the original (extrapolated) frequency
        inv = (1.0 / (self.factor * pos)) * (1 - extra) + (1.0 / pos) * extra  # [hd/2]
        return inv, 0.1 * math.log(self.factor) + 1.0


def _corr_dim(rotations: float, head_dim: int, base: float, orig_ctx: int) -> float:
    """The (fractional) rope dim whose wavelength turns `rotations` times over `orig_ctx` tokens."""
    return head_dim * math.log(orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))


@dataclass(frozen=True)
class GptOssStep(StepAttn):
    """`StepAttn` plus the sliding-window layers' mask."""

    swa_mask: torch.Tensor | None = None  # [B, 1, rep*T, S] bool; None: no sliding window


def sliding_mask(cache: KVCache, mask: torch.Tensor, positions: torch.Tensor, start: int, window: int) -> torch.Tensor:
    """`mask` [B, 1, T, S] limited to keys fewer than `window` positions back (HF: kv > q - window;
    llama.cpp: masked when q - kv >= window). Positions are each sequence's own (pads do not
    count), so left padding does not shift the window. A query still sees itself."""
    S = start + positions.shape[1]
    key_pos = cache.valid[:, :S].long().cumsum(1) - 1  # [B, S] position of each real key
    near = positions[:, :, None] - key_pos[:, None, :] < window  # [B, T, S]
    s = torch.arange(S, device=mask.device)  # [S]
    self_ = s[None, :] == s[start:, None]  # [T, S]
    return mask & (near | self_)[:, None]  # [B, 1, T, S]


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax([q.k * scale, sink]) @ [v, 0]: q [B, Hkv, R, hd] (R = rep*T rows), k/v [B, Hkv, S, hd],
    mask [B, 1, R, S], sinks [Hkv, R] (each row's head's sink) -> [B, Hkv, R, hd]."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, Hkv, R, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float()[None, :, :, None].expand(*scores.shape[:-1], 1)  # [B, Hkv, R, 1]
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]  # [B, Hkv, R, S]: the sink dropped
    return torch.matmul(probs.to(v.dtype), v)  # [B, Hkv, R, hd]


class Model(MoETransformer):
    """The generic MoE transformer with gpt-oss's attention, rope and router."""

    def __init__(self, hparams: HParams, dense: dict[str, torch.Tensor]):
        super().__init__(hparams, dense)
        hp = hparams
        for w in self.layers:  # the generic block's pre-FFN norm, under the name llama.cpp gives it
            w["ffn_norm"] = w["post_attention_norm"]
        self.window = int(hp.extra.get("attention.sliding_window", 0))
        if self.window < 0:
            raise ValueError(f"{hp.arch}: attention.sliding_window must be >= 0, got {self.window}")
        # even layers slide (HF: layer_types[i] = "sliding_attention" if (i + 1) % 2; llama.cpp: swa pattern 2)
        self.sliding = [self.window > 0 and i % 2 == 0 for i in range(hp.n_layer)]
        inv_freq, self.rope_scale = Yarn.from_hparams(hp).inv_freq_and_scale(hp.head_dim, hp.rope_base)
        self.inv_freq = inv_freq.to(self.device)  # [hd/2]
        rep = hp.n_head // hp.n_head_kv
        # each folded query row's sink: row r*T + t of kv head g belongs to head g*rep + r
        self.sinks = [w["attn_sinks"].float().reshape(hp.n_head_kv, rep, 1) for w in self.layers]  # [Hkv, rep, 1]

    def prepare(self, cache: KVCache, valid: torch.Tensor) -> GptOssStep:
        positions, start = cache.advance(valid)  # [B, T]
        T = positions.shape[1]
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, hd] NEOX layout
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale  # [B, T, hd]
        mask = attention_mask(cache, start, T)  # [B, 1, T, S]
        swa = sliding_mask(cache, mask, positions, start, self.window) if self.window > 0 else None
        rep = self.attn.n_head // self.attn.n_head_kv
        if rep > 1:  # rows of one kv head: rep heads x T tokens, head-major (as layers.step_attn)
            mask = mask.repeat(1, 1, rep, 1)  # [B, 1, rep*T, S]
            swa = swa.repeat(1, 1, rep, 1) if swa is not None else None
        return GptOssStep(start, T, cos.to(self.dtype), sin.to(self.dtype), mask, swa_mask=swa)

    def attend(self, layer: int, x: torch.Tensor, cache: KVCache, st: StepAttn) -> torch.Tensor:
        """Biased GQA with sinks (and the sliding window on even layers): rows x [N, d] -> [N, d]."""
        a, w = self.attn, self.layers[layer]
        B, T, start = x.shape[0] // st.T, st.T, st.start
        q, k, v = _qkv(x, w, a, B, T)  # [B, H, T, hd], [B, Hkv, T, hd] x2 (biases included)
        q, k = apply_rope_neox(q, st.cos, st.sin), apply_rope_neox(k, st.cos, st.sin)
        keys, vals = cache.store(layer, start, k, v)  # [B, Hkv, S, hd] x2
        q = q.reshape(B, a.n_head_kv, -1, a.head_dim)  # [B, Hkv, rep*T, hd]
        mask = st.swa_mask if self.sliding[layer] else st.mask  # [B, 1, rep*T, S]
        sinks = self.sinks[layer].expand(-1, -1, T).reshape(a.n_head_kv, -1)  # [Hkv, rep*T]
        out = sink_attention(q, keys, vals, mask, sinks, a.head_dim ** -0.5)  # [B, Hkv, rep*T, hd]
        out = out.reshape(B, a.n_head, T, a.head_dim).transpose(1, 2).reshape(B * T, a.n_head * a.head_dim)  # [N, H*hd]
        return _proj(out, w, "attn_output")  # [N, d]

    def router_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """The biased router on hidden rows h [N, d] (after the pre-FFN norm) -> [N, n_expert]."""
        w = self.layers[layer]
        return linear(rms_norm(h, w["ffn_norm"], self.hparams.rms_eps), w["ffn_gate_inp"], w["ffn_gate_inp.bias"])

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of the biased router logits, softmax over the k: weights [n, k], ids [n, k]."""
        w, hp = self.layers[layer], self.hparams
        return self._route(linear(x, w["ffn_gate_inp"], w["ffn_gate_inp.bias"]), hp.n_expert_used, hp.norm_topk_prob)
