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
    )
}

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
    }
    if spec.qk_norm != "none":
        full = spec.qk_norm == "full"
        per_layer["attn_q_norm.weight"] = ((q if full else hd,),)
        per_layer["attn_k_norm.weight"] = ((kv if full else hd,),)
    if spec.shared_expert:
        ff = hp.n_ff_shexp
        per_layer.update({"ffn_gate_shexp.weight": ((d, ff),), "ffn_up_shexp.weight": ((d, ff),),
                          "ffn_down_shexp.weight": ((ff, d),), "ffn_gate_inp_shexp.weight": ((d,), (d, 1))})
    out: dict[str, tuple[Shape, ...]] = {"token_embd.weight": ((d, V),), "output.weight": ((d, V),),
                                         "output_norm.weight": ((d,),)}
    for layer in range(hp.n_layer):
        out.update({f"blk.{layer}.{name}": shapes for name, shapes in per_layer.items()})
    return out
