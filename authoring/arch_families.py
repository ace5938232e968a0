"""make-model's glm4moe, minimax-m2 and llama4 files: their metadata and tensors as llama.cpp's
converter writes them (tiny versions of the real models; `make_model(arch_opts=...)` sets the options).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Per-family options (`make_model(arch_opts=...)` overrides any of them), tiny versions of the real
# models: GLM-4.5 (first layer dense, one shared expert, one NextN/MTP block after the stack, half of
# each head roped, q/k norm as the 355B model; qk_norm=False is GLM-4.5-Air), MiniMax-M2 (half of
# each head roped), Llama 4 (MoE on every `moe_step`-th layer as Maverick; 1 is Scout).
ARCH_OPTIONS: dict[str, dict[str, Any]] = {
    "glm4moe": dict(dense_layers=1, shared_experts=1, nextn=1, qk_norm=True, weights_scale=2.5),
    "minimax-m2": dict(weights_scale=0.0),
    "llama4": dict(moe_step=2),
}


def family_hparams(arch: str, hp: dict, opts: dict[str, Any]) -> dict[str, Any]:
    """glm4moe / minimax-m2 / llama4 metadata as llama.cpp's converter writes it (`extra`: keys
    after "<arch>.") and the fields `tensor_shapes` reads."""
    unknown = set(opts) - set(ARCH_OPTIONS[arch])
    if unknown:
        raise ValueError(f"unknown {arch} option(s) {sorted(unknown)} (have: {', '.join(ARCH_OPTIONS[arch])})")
    o, n, e = {**ARCH_OPTIONS[arch], **opts}, hp["n_layer"], hp["n_embd"]
    if arch == "llama4":
        if not 1 <= o["moe_step"] <= n:
            raise ValueError(f"moe_step={o['moe_step']} must be in [1, {n}] (layers)")
        return dict(extra={"interleave_moe_layer_step": o["moe_step"]}, moe_step=o["moe_step"], n_ff=2 * e,
                    n_ff_shexp=hp["n_ff_exp"], rope_base=500000.0, rms_eps=1e-5)
    extra: dict[str, Any] = {"rope.dimension_count": hp["head_dim"] // 2, "expert_gating_func": 2}
    if o["weights_scale"]:
        extra["expert_weights_scale"] = float(o["weights_scale"])
    if arch == "minimax-m2":
        return dict(extra=extra)
    if not 0 <= o["dense_layers"] < n or o["shared_experts"] < 1 or o["nextn"] < 0:
        raise ValueError(f"glm4moe: dense_layers={o['dense_layers']} must leave a MoE layer of {n}, "
                         f"shared_experts={o['shared_experts']} >= 1, nextn={o['nextn']} >= 0")
    extra.update({"leading_dense_block_count": o["dense_layers"], "expert_shared_count": o["shared_experts"]})
    if o["nextn"]:  # block_count counts the MTP blocks; HParams.n_layer will not
        extra.update({"nextn_predict_layers": o["nextn"], "block_count": n + o["nextn"]})
    return dict(extra=extra, n_dense_lead=o["dense_layers"], n_ff=2 * e, n_ff_shexp=hp["n_ff_exp"] * o["shared_experts"],
                norm_topk_prob=True, glm_qk_norm=bool(o["qk_norm"]), n_nextn=o["nextn"])


def _glm4moe_layer_shapes(hp: dict, i: int) -> dict[str, tuple[int, ...]]:
    """One GLM-4.5 layer, numpy order: biased attention (+ per-head q/k norm), `post_attention_norm`,
    then a dense FFN (the first `n_dense_lead` layers) or router + selection bias, experts and shared
    experts; a NextN block (i >= n_layer) adds eh_proj, enorm, hnorm and shared_head_norm."""
    p, e, ne, ff, hd = f"blk.{i}.", hp["n_embd"], hp["n_expert"], hp["n_ff_exp"], hp["head_dim"]
    q_dim, kv_dim = hp["n_head"] * hd, hp["n_head_kv"] * hd
    out: dict[str, tuple[int, ...]] = {p + "attn_norm.weight": (e,)}
    for t, rows in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
        out.update({p + t + ".weight": (rows, e), p + t + ".bias": (rows,)})
    out[p + "attn_output.weight"] = (e, q_dim)
    if hp["glm_qk_norm"]:
        out.update({p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
    out[p + "post_attention_norm.weight"] = (e,)
    if i < hp["n_dense_lead"]:
        return {**out, **_dense_ffn_shapes(p, e, hp["n_ff"])}
    sff = ff * hp["extra"]["expert_shared_count"]
    out.update({p + "ffn_gate_inp.weight": (ne, e), p + "exp_probs_b.bias": (ne,), **_expert_shapes(p, ne, ff, e),
                p + "ffn_gate_shexp.weight": (sff, e), p + "ffn_up_shexp.weight": (sff, e),
                p + "ffn_down_shexp.weight": (e, sff)})
    if i >= hp["n_layer"]:  # the MTP block: not run, written as the converter writes it
        out.update({p + "nextn.eh_proj.weight": (e, 2 * e), p + "nextn.enorm.weight": (e,),
                    p + "nextn.hnorm.weight": (e,), p + "nextn.shared_head_norm.weight": (e,)})
    return out


def _llama4_layer_shapes(hp: dict, i: int) -> dict[str, tuple[int, ...]]:
    """One Llama 4 layer, numpy order: plain attention, `ffn_norm`, then a dense FFN or (every
    `moe_step`-th layer) router, experts and a shared expert as wide as one expert."""
    p, e, ne, ff, hd = f"blk.{i}.", hp["n_embd"], hp["n_expert"], hp["n_ff_exp"], hp["head_dim"]
    q_dim, kv_dim = hp["n_head"] * hd, hp["n_head_kv"] * hd
    out: dict[str, tuple[int, ...]] = {p + "attn_norm.weight": (e,), p + "attn_q.weight": (q_dim, e),
                                       p + "attn_k.weight": (kv_dim, e), p + "attn_v.weight": (kv_dim, e),
                                       p + "attn_output.weight": (e, q_dim), p + "ffn_norm.weight": (e,)}
    if (i + 1) % hp["moe_step"]:
        return {**out, **_dense_ffn_shapes(p, e, hp["n_ff"])}
    return {**out, p + "ffn_gate_inp.weight": (ne, e), **_expert_shapes(p, ne, ff, e),
            p + "ffn_gate_shexp.weight": (ff, e), p + "ffn_up_shexp.weight": (ff, e), p + "ffn_down_shexp.weight": (e, ff)}


def _dense_ffn_shapes(p: str, e: int, ff: int) -> dict[str, tuple[int, ...]]:
    return {p + "ffn_gate.weight": (ff, e), p + "ffn_up.weight": (ff, e), p + "ffn_down.weight": (e, ff)}


def _expert_shapes(p: str, ne: int, ff: int, e: int) -> dict[str, tuple[int, ...]]:
    return {p + "ffn_gate_exps.weight": (ne, ff, e), p + "ffn_up_exps.weight": (ne, ff, e),
            p + "ffn_down_exps.weight": (ne, e, ff)}


# arch -> one layer's tensors (numpy order) for the families whose layers differ from the generic one
FAMILY_LAYERS: dict[str, Callable[[dict, int], dict[str, tuple[int, ...]]]] = {
    "glm4moe": _glm4moe_layer_shapes, "llama4": _llama4_layer_shapes,
}
