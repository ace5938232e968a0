"""Architecture tables: which GGUF metadata keys and tensor names each MoE family uses.

Adding an architecture means adding one `ArchSpec` entry here (and one model module in the
decoder); nothing else should need to know the family by name. The entry says what the generic
MoE transformer (decoder/models/moe_transformer.py) reads: q/k norm, rope style, routing
function, shared expert; `dense_shapes` says what shape each dense tensor must have.
"""

from __future__ import annotations

from dataclasses import dataclass

# Per-layer tensors every supported family has (llama.cpp names, without "blk.N." and ".weight").
_ATTN = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate_inp")
# Hybrid families: what every layer has, then per layer kind (Gated DeltaNet tensors named in full:
# llama.cpp's `ssm_a` has no ".weight" and `ssm_dt` is a ".bias").
_HYBRID = ("attn_norm", "post_attention_norm", "ffn_gate_inp")
_GATED_ATTN = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
_GDN = ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight",
        "ssm_out.weight")


# DeepSeek-2 metadata as llama.cpp's converter writes it. Current converters store MLA as MQA over
# the latent: key_length = kv_lora_rank + rope dims, value_length = kv_lora_rank, and the per-head
# widths under key_length_mla / value_length_mla; older ones wrote the per-head widths under
# key_length / value_length and no *_mla keys.
_MLA_KEYS: tuple[tuple[str, type, object], ...] = (
    ("attention.q_lora_rank", int, 0), ("attention.kv_lora_rank", int, ...),
    ("attention.key_length", int, ...), ("attention.value_length", int, ...),
    ("attention.key_length_mla", int, 0), ("attention.value_length_mla", int, 0),
    ("rope.dimension_count", int, ...), ("expert_shared_count", int, 0),
    ("expert_weights_scale", float, 1.0), ("expert_gating_func", int, 0),
    ("expert_group_count", int, 0), ("expert_group_used_count", int, 0),
    ("rope.scaling.type", str, "none"), ("rope.scaling.factor", float, 0.0),
    ("rope.scaling.original_context_length", int, 0), ("rope.scaling.yarn_log_multiplier", float, 0.0),
    ("rope.scaling.yarn_beta_fast", float, 32.0), ("rope.scaling.yarn_beta_slow", float, 1.0),
)

# GLM-4.5/4.6/4.7 and MiniMax-M2: sigmoid router with a selection bias (exp_probs_b), partial rope
# (rope.dimension_count of the head), GLM's NextN/MTP blocks after the stack (not run).
_SIGMOID_MOE_KEYS: tuple[tuple[str, type, object], ...] = (
    ("rope.dimension_count", int, 0), ("expert_weights_scale", float, 0.0), ("expert_gating_func", int, 2),
    ("expert_shared_count", int, 0), ("nextn_predict_layers", int, 0),
)
# Llama 4: chunked attention on 3 of every 4 layers (llama.cpp fixes the chunk at 8192 and reads
# only whether attention.sliding_window is written as 0: no chunking), NoPE on the others.
_LLAMA4_KEYS: tuple[tuple[str, type, object], ...] = (
    ("attention.sliding_window", int, -1), ("attention.sliding_window_pattern", int, 4),
    ("rope.freq_base_swa", float, 0.0), ("expert_weights_scale", float, 0.0),
)

# gpt-oss metadata as llama.cpp's converter writes it (rope scaling: YaRN; beta_fast/slow are not
# written by it, so the defaults are YaRN's 32 and 1).
_GPT_OSS_KEYS: tuple[tuple[str, type, object], ...] = (
    ("attention.sliding_window", int, 0), ("rope.scaling.type", str, "none"), ("rope.scaling.factor", float, 1.0),
    ("rope.scaling.original_context_length", int, 0), ("rope.scaling.yarn_beta_fast", float, 32.0),
    ("rope.scaling.yarn_beta_slow", float, 1.0),
)


@dataclass(frozen=True)
class ArchSpec:
    """What one GGUF `general.architecture` looks like on disk."""

    name: str
    layer_tensors: tuple[str, ...]  # required dense weights per layer (".weight" implied)
    layer_biases: tuple[str, ...] = ()  # required ".bias" tensors per layer
    shared_expert: bool = False  # ffn_{gate,up,down}_shexp + ffn_gate_inp_shexp
    qk_norm: str = "none"  # "none" | "head" (RMSNorm over head_dim) | "full" (over all heads: n_head*head_dim for q, n_head_kv*head_dim for k)
    head_dim_key: bool = False  # head dim read from attention.key_length when present
    norm_topk_prob: bool = True  # renormalize the top-k router weights
    expert_ff_key: str | None = "expert_feed_forward_length"  # None: experts are feed_forward_length wide
    kv_heads_equal_heads: bool = False  # llama.cpp's loader wants attention.head_count_kv == head_count
    rope: str = "neox"  # "neox" (dims i, i + hd/2 rotate together) | "norm" (dims 2i, 2i+1: llama.cpp's LLAMA_ROPE_TYPE_NORM)
    routing: str = "softmax"  # the router function (decoder/models/layers.py ROUTING)
    # Hybrid Gated-DeltaNet families (Qwen3-Next, Qwen3.5-MoE): every `full_attention_interval`-th
    # layer is gated full attention (`attn_layer_tensors`), the others linear attention
    # (`recurrent_tensors`); "fused_ba" = one ssm_ba projection, "split_ba" = ssm_beta + ssm_alpha.
    linear_attn: str = "none"  # "none" | "fused_ba" | "split_ba"
    attn_layer_tensors: tuple[str, ...] = ()  # required on full-attention layers of a hybrid family
    recurrent_tensors: tuple[str, ...] = ()  # required on linear-attention layers (full names after "blk.N.")
    attention: str = "gqa"  # "gqa" (attn_q/k/v) | "mla" (DeepSeek's multi-head latent attention, `mla_shapes`)
    shared_expert_gate: bool = True  # the shared expert is scaled by sigmoid(ffn_gate_inp_shexp . x)
    shared_ff_key: str | None = "expert_shared_feed_forward_length"  # None: expert width x expert_shared_count
    # family-specific metadata read into `HParams.extra`: (key without "<arch>.", type, default;
    # ... = required)
    extra_keys: tuple[tuple[str, type, object], ...] = ()
    expert_act: str = "swiglu"  # EXPERT_ACTS: how an expert combines gate and up (every expert source honours it)
    router_bias: bool = False  # a per-expert selection bias `exp_probs_b.bias` on every MoE layer (required)
    # the router weight scales the expert's input, not its output (Llama 4): each (token, expert) pair is
    # a row of its own in `ExpertSource.mix` (n x k rows, weights 1)
    weight_on_input: bool = False


ARCHS: dict[str, ArchSpec] = {
    spec.name: spec
    for spec in (
        ArchSpec("qwen3moe", _ATTN + ("attn_q_norm", "attn_k_norm"), qk_norm="head", head_dim_key=True),
        ArchSpec(
            "qwen2moe",
            _ATTN,
            layer_biases=("attn_q", "attn_k", "attn_v"),
            shared_expert=True,
            norm_topk_prob=False,
        ),
        # Mixtral is stored as "llama" with expert_count > 0; its expert width is the FFN width.
        ArchSpec("llama", _ATTN, expert_ff_key=None, rope="norm"),
        # OLMoE's converter writes no expert_feed_forward_length: llama.cpp sizes its experts by
        # feed_forward_length (HF intermediate_size), as for Mixtral.
        ArchSpec("olmoe", _ATTN + ("attn_q_norm", "attn_k_norm"), qk_norm="full", norm_topk_prob=False,
                 expert_ff_key=None, kv_heads_equal_heads=True),
        # Qwen3-Next / Qwen3.5-MoE: the pre-FFN norm is `post_attention_norm`; attn_q is [d, 2*H*hd]
        # (each head's query then its output gate); the shared expert is sigmoid-gated.
        ArchSpec("qwen3next", _HYBRID, shared_expert=True, qk_norm="head", head_dim_key=True, linear_attn="fused_ba",
                 attn_layer_tensors=_GATED_ATTN, recurrent_tensors=_GDN + ("ssm_ba.weight",)),
        ArchSpec("qwen35moe", _HYBRID, shared_expert=True, qk_norm="head", head_dim_key=True, linear_attn="split_ba",
                 attn_layer_tensors=_GATED_ATTN, recurrent_tensors=_GDN + ("ssm_beta.weight", "ssm_alpha.weight")),
        # DeepSeek-V2/V3/R1, Kimi-K2: MLA attention, leading dense layers, sigmoid (V3) or softmax
        # (V2) router with group-limited top-k, un-gated shared experts (decoder/models/arch/deepseek2.py)
        ArchSpec("deepseek2", ("attn_norm", "attn_kv_a_mqa", "attn_kv_a_norm", "attn_output", "ffn_norm"),
                 shared_expert=True, shared_expert_gate=False, shared_ff_key=None, norm_topk_prob=False,
                 rope="norm", attention="mla", extra_keys=_MLA_KEYS),
        # gpt-oss: attention with biases, per-head sinks and a sliding window on even layers, YaRN
        # rope; the pre-FFN norm is `post_attention_norm`; biased router, top-k then softmax;
        # experts with biases and the clamped SwiGLU (decoder/models/arch/gpt_oss.py)
        ArchSpec("gpt-oss", ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_sinks",
                             "post_attention_norm", "ffn_gate_inp"),
                 layer_biases=("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp"), head_dim_key=True,
                 routing="topk_softmax", expert_act="swiglu_oai_clamped", extra_keys=_GPT_OSS_KEYS),
        # GLM-4.5/4.6/4.7: q/k/v biases, optional per-head q/k norm, NEOX rope on half of each head,
        # leading dense layers, sigmoid routing with the selection bias, an un-gated shared expert;
        # the pre-FFN norm is `post_attention_norm` (decoder/models/arch/glm4moe.py)
        ArchSpec("glm4moe", ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm"),
                 layer_biases=("attn_q", "attn_k", "attn_v"), shared_expert=True, shared_expert_gate=False,
                 shared_ff_key=None, qk_norm="head", head_dim_key=True, norm_topk_prob=False, router_bias=True,
                 extra_keys=_SIGMOID_MOE_KEYS),
        # MiniMax-M2: q/k RMSNorm over all heads, NEOX rope on part of each head, sigmoid routing with
        # the selection bias, renormalized (llama.cpp hardcodes it)
        ArchSpec("minimax-m2", _ATTN + ("attn_q_norm", "attn_k_norm"), qk_norm="full", head_dim_key=True,
                 router_bias=True, extra_keys=_SIGMOID_MOE_KEYS),
        # Llama 4: dense and MoE layers interleaved (interleave_moe_layer_step), top-k then sigmoid with the
        # weight applied to the expert's input, an un-gated shared expert as wide as the experts, chunked
        # attention and NoPE layers, normal rope on unpermuted q/k (decoder/models/arch/llama4.py)
        ArchSpec("llama4", ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"),
                 shared_expert=True, shared_expert_gate=False, shared_ff_key="expert_feed_forward_length",
                 head_dim_key=True, norm_topk_prob=False, rope="norm", routing="topk_sigmoid", weight_on_input=True,
                 extra_keys=_LLAMA4_KEYS),
    )
}

# Expert activations: "swiglu" = down(silu(gate x) * up x); "swiglu_oai_clamped" = gpt-oss's
# down(g * sigmoid(alpha * g) * (u + 1)) with g = min(gate x, limit), u = clamp(up x, -limit,
# limit). alpha and limit are fixed by the model (HF's config defaults; llama.cpp hardcodes them).
EXPERT_ACTS: tuple[str, ...] = ("swiglu", "swiglu_oai_clamped")
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0
assert all(spec.expert_act in EXPERT_ACTS for spec in ARCHS.values()), "an ArchSpec names an unknown expert_act"

# Expert tensors: blk.L.ffn_<part>_exps.<kind>; parts in the order a blob stores them.
EXPERT_PARTS: tuple[str, ...] = ("gate_up", "gate", "up", "down")
SHARED_EXPERT_TENSORS: tuple[str, ...] = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp")


def arch_key(arch: str, key: str) -> str:
    """Full metadata key, e.g. arch_key("qwen3moe", "block_count") -> "qwen3moe.block_count"."""
    return f"{arch}.{key}"


def get_arch(name: str) -> ArchSpec:
    try:
        return ARCHS[name]
    except KeyError:
        known = ", ".join(sorted(ARCHS))
        raise ValueError(f"unsupported architecture {name!r} (supported: {known})") from None


Shape = tuple[int, ...]


def dense_shapes(spec: ArchSpec, hp) -> dict[str, tuple[Shape, ...]]:
    """Every dense tensor the family has -> the shapes (ggml order, ne0 first) it may have.

    Where llama.cpp's converter and older writers differ, both are listed (the shared-expert
    gate: [d] squeezed or [d, 1] as HF's Linear(d, 1)). `hp` is the file's `HParams`.
    """
    d, H, Hkv, hd, V, E = hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_vocab, hp.n_expert
    q, kv = H * hd, Hkv * hd
    per_layer: dict[str, tuple[Shape, ...]] = {
        "attn_norm.weight": ((d,),), "ffn_norm.weight": ((d,),),
        "attn_q.weight": ((d, q),), "attn_k.weight": ((d, kv),), "attn_v.weight": ((d, kv),),
        "attn_output.weight": ((q, d),), "ffn_gate_inp.weight": ((d, E),),
        "attn_q.bias": ((q,),), "attn_k.bias": ((kv,),), "attn_v.bias": ((kv,),),
        "post_attention_norm.weight": ((d,),), "exp_probs_b.bias": ((E,),),
    }
    if spec.qk_norm != "none":
        full = spec.qk_norm == "full"
        per_layer["attn_q_norm.weight"] = ((q if full else hd,),)
        per_layer["attn_k_norm.weight"] = ((kv if full else hd,),)
    if spec.shared_expert:
        ff = hp.n_ff_shexp
        per_layer.update({"ffn_gate_shexp.weight": ((d, ff),), "ffn_up_shexp.weight": ((d, ff),),
                          "ffn_down_shexp.weight": ((ff, d),), "ffn_gate_inp_shexp.weight": ((d,), (d, 1))})
    if spec.expert_act == "swiglu_oai_clamped":  # gpt-oss: output and router biases, sinks, its pre-FFN norm
        per_layer.update({"attn_output.bias": ((d,),), "ffn_gate_inp.bias": ((E,),), "attn_sinks.weight": ((H,),),
                          "post_attention_norm.weight": ((d,),)})
    if spec.attention == "mla":
        per_layer.update(mla_shapes(hp))
    if not all(hp.is_moe_layer(i) for i in range(hp.n_layer)):  # dense layers' FFN (feed_forward_length wide)
        per_layer.update({"ffn_gate.weight": ((d, hp.n_ff),), "ffn_up.weight": ((d, hp.n_ff),),
                          "ffn_down.weight": ((hp.n_ff, d),)})
    if spec.linear_attn != "none":
        per_layer.update(_hybrid_shapes(spec, hp))
    out: dict[str, tuple[Shape, ...]] = {"token_embd.weight": ((d, V),), "output.weight": ((d, V),),
                                         "output_norm.weight": ((d,),), "rope_freqs.weight": ((hd // 2,),)}
    for layer in range(hp.n_layer):
        out.update({f"blk.{layer}.{name}": shapes for name, shapes in per_layer.items()})
    return out


def _hybrid_shapes(spec: ArchSpec, hp) -> dict[str, tuple[Shape, ...]]:
    """Gated full attention (q and its gate: 2*H*hd) and Gated DeltaNet tensors, ggml order."""
    d, nk, dk, nv = hp.n_embd, hp.ssm_group_count, hp.ssm_state_size, hp.ssm_time_step_rank
    dv = hp.ssm_inner_size // max(nv, 1)
    conv = 2 * nk * dk + nv * dv  # the channels of q, k and v that go through the causal conv
    out: dict[str, tuple[Shape, ...]] = {
        "attn_q.weight": ((d, 2 * hp.n_head * hp.head_dim),), "post_attention_norm.weight": ((d,),),
        "attn_qkv.weight": ((d, conv),), "attn_gate.weight": ((d, nv * dv),), "ssm_in.weight": ((d, conv + nv * dv),),
        "ssm_conv1d.weight": ((hp.ssm_conv_kernel, conv),), "ssm_dt.bias": ((nv,),), "ssm_a": ((nv,),),
        "ssm_norm.weight": ((dv,),), "ssm_out.weight": ((nv * dv, d),),
    }
    if spec.linear_attn == "fused_ba":
        out["ssm_ba.weight"] = ((d, 2 * nv),)
    else:
        out.update({"ssm_beta.weight": ((d, nv),), "ssm_alpha.weight": ((d, nv),)})
    return out


@dataclass(frozen=True)
class MLADims:
    """DeepSeek's multi-head latent attention widths (HF names: q_lora_rank, kv_lora_rank, ...)."""

    q_lora: int  # 0: q is one plain attn_q projection
    kv_lora: int  # the compressed kv latent every head's k/v is expanded from
    rope: int  # qk_rope_head_dim: the roped part of q/k (one key part shared by all heads)
    nope: int  # qk_nope_head_dim: the un-roped part of q/k, per head
    v: int  # v_head_dim

    @property
    def k(self) -> int:
        return self.nope + self.rope


def mla_dims(hp) -> MLADims:
    """The MLA widths of a deepseek2 `HParams` (its `extra` metadata), checked."""
    x = hp.extra
    rope = x["rope.dimension_count"]
    k = x["attention.key_length_mla"] or x["attention.key_length"]  # per-head widths: see _MLA_KEYS
    v = x["attention.value_length_mla"] or x["attention.value_length"]
    dims = MLADims(x["attention.q_lora_rank"], x["attention.kv_lora_rank"], rope, k - rope, v)
    if min(dims.kv_lora, dims.rope, dims.nope, dims.v) <= 0 or dims.q_lora < 0 or dims.rope % 2:
        raise ValueError(f"invalid MLA widths {dims} (key head {k}, value head {v}, rope dims {rope})")
    return dims


def mla_shapes(hp) -> dict[str, tuple[Shape, ...]]:
    """MLA attention tensors -> ggml shapes: q (attn_q, or attn_q_a -> attn_q_a_norm -> attn_q_b),
    attn_kv_a_mqa (latent + shared rope key), attn_kv_b (older converters) or the split
    attn_k_b [H, kv_lora, nope] / attn_v_b [H, v, kv_lora] (torch order) current ones write."""
    m, d, H = mla_dims(hp), hp.n_embd, hp.n_head
    return {
        "attn_q.weight": ((d, H * m.k),), "attn_q_a.weight": ((d, m.q_lora),),
        "attn_q_a_norm.weight": ((m.q_lora,),), "attn_q_b.weight": ((m.q_lora, H * m.k),),
        "attn_kv_a_mqa.weight": ((d, m.kv_lora + m.rope),), "attn_kv_a_norm.weight": ((m.kv_lora,),),
        "attn_kv_b.weight": ((m.kv_lora, H * (m.nope + m.v)),),
        "attn_k_b.weight": ((m.nope, m.kv_lora, H),), "attn_v_b.weight": ((m.kv_lora, m.v, H),),
        "attn_output.weight": ((H * m.v, d),), "exp_probs_b.bias": ((hp.n_expert,),),
    }


def layer_tensors(spec: ArchSpec, hp, layer: int, has) -> list[str]:
    """Dense tensors (full names) layer `layer` must have; `has(name)` says whether the file has
    one, for the parts llama.cpp's converters wrote in two forms (MLA's kv_b or k_b + v_b)."""
    moe = hp.is_moe_layer(layer)
    names = [f"{t}.weight" for t in spec.layer_tensors if moe or t != "ffn_gate_inp"]
    names += [f"{t}.bias" for t in spec.layer_biases]
    if moe and spec.shared_expert:
        names += [f"{t}.weight" for t in SHARED_EXPERT_TENSORS if spec.shared_expert_gate or t != "ffn_gate_inp_shexp"]
    if moe and "ffn_gate_inp" not in spec.layer_tensors:
        names.append("ffn_gate_inp.weight")
    if moe and spec.router_bias:
        names.append("exp_probs_b.bias")
    if not moe:
        names += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    if spec.attention == "mla":
        q_lora = mla_dims(hp).q_lora
        names += ["attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"] if q_lora else ["attn_q.weight"]
        split = not has(f"blk.{layer}.attn_kv_b.weight")
        names += ["attn_k_b.weight", "attn_v_b.weight"] if split else ["attn_kv_b.weight"]
    return [f"blk.{layer}.{n}" for n in names]
