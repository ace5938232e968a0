"""`moestream make-model`: write a GGUF MoE with random weights, tiny or multi-GiB.

Weights are random codes with std ~1/sqrt(fan_in) (forward passes stay tame); norms are ~1;
routers get a larger std so routing is spread over experts, not degenerate. `--target-size`
grows the expert count (up to `MAX_TARGET_EXPERTS`) and then the expert width until the file
approaches the target; expert tensors are generated block by block while writing.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES

from ..common.arch import get_arch
from .arch_families import ARCH_OPTIONS, FAMILY_LAYERS, family_hparams
from .gguf_write import RandomTensor, TensorLike, normalize_hparams, tensor_nbytes, tensor_qtype, write_moe_gguf
from .quant_mix import KEYS_HELP, QuantMix, parse_mix
from .quantize import qtype_of, writable
from .tokenizer_data import TOKENIZER_KINDS, get_vocab
from ..common.units import parse_size

MAX_TARGET_EXPERTS = 128  # --target-size adds experts up to this, then widens them
DEFAULT_TOKENIZER = {"llama": "spm"}  # arch -> vocabulary kind its real files ship (Mixtral: SentencePiece); else bpe
ROUTER_STD = 1.0  # logits ~N(0, |h|): clearly different experts win for different tokens
ROUTINGS = ("router", "chain")  # see `chain_tensors`
CHAIN_EMBD_STD = 4.0  # the chain model's embedding: large next to what the layers add to the residual


def _block(quant: str) -> int:
    """Values per quant block (256 for K-quants, 32 for the rest, 1 for floats)."""
    return GGML_QUANT_SIZES[qtype_of(quant)][0]


def default_width(quant: str) -> int:
    """Smallest hidden / expert width every tensor of `quant` accepts: K-quants need 256."""
    return max(64, _block(quant))


def model_hparams(arch: str, *, layers: int, experts: int, top_k: int, hidden: int, expert_ff: int,
                  heads: int, kv_heads: int, vocab: int, head_dim: int | None = None,
                  shared_ff: int | None = None, mla: Mapping[str, Any] | None = None,
                  arch_opts: Mapping[str, Any] | None = None) -> dict:
    """Validated HParams-style dict for `make_model`."""
    spec = get_arch(arch)
    if min(layers, experts, top_k, hidden, expert_ff, heads, kv_heads) <= 0:
        raise ValueError("layers, experts, top_k, hidden, expert_ff, heads and kv_heads must be positive")
    if top_k > experts:
        raise ValueError(f"top_k={top_k} > experts={experts}")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    if spec.kv_heads_equal_heads and kv_heads != heads:
        raise ValueError(f"{arch} needs kv_heads == heads (llama.cpp's loader), got {kv_heads} != {heads}")
    if head_dim is not None and head_dim != hidden // heads and not spec.head_dim_key:
        raise ValueError(f"{arch} has no head-dim key: head_dim must be hidden/heads = {hidden // heads}")
    if head_dim is None and hidden % heads:
        raise ValueError(f"hidden={hidden} is not a multiple of heads={heads}")
    hp = dict(n_layer=layers, n_embd=hidden, n_head=heads, n_head_kv=kv_heads,
              head_dim=head_dim or hidden // heads, n_expert=experts, n_expert_used=top_k, n_ff_exp=expert_ff,
              n_vocab=vocab, n_ff_shexp=(shared_ff or 2 * expert_ff) if spec.shared_expert else 0)
    if spec.linear_attn != "none":
        hp.update(_hybrid_hparams(layers, hp["head_dim"]))
    if spec.attention == "mla":
        hp.update(_mla_hparams(hp, dict(mla or {})))
    elif mla:
        raise ValueError(f"MLA options are for deepseek2, not {arch}")
    if arch in GPT_OSS_HPARAMS:
        hp.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in GPT_OSS_HPARAMS[arch].items()})
    if arch in ARCH_OPTIONS:
        hp.update(family_hparams(arch, hp, dict(arch_opts or {})))
    elif arch_opts:
        raise ValueError(f"{arch} takes no architecture options (those are for {', '.join(ARCH_OPTIONS)})")
    return normalize_hparams(arch, hp)


# gpt-oss as its converter writes it (rope base, eps, YaRN factor and original context of the real
# config), with a sliding window short enough for tiny test prompts to cross it (the real one is 128).
GPT_OSS_HPARAMS: dict[str, dict[str, Any]] = {"gpt-oss": dict(
    rope_base=150000.0, rms_eps=1e-5,
    extra={"attention.sliding_window": 8, "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
           "rope.scaling.original_context_length": 4096},
)}
DEFAULT_EXPERT_QUANT = {"gpt-oss": "MXFP4"}  # arch -> expert quant its real files ship (else --quant)


# Tiny DeepSeek-V3-like defaults (`make_model(mla=...)` overrides any of them): low-rank q, a
# 32-wide kv latent, 16 roped + 32 un-roped q/k dims per head, the first layer dense, one shared
# expert, sigmoid routing in groups with the selection bias, YaRN rope as DeepSeek-V3 ships it.
MLA_DEFAULTS: dict[str, Any] = dict(q_lora_rank=32, kv_lora_rank=32, rope_dim=16, nope_dim=32, v_dim=32,
                                    dense_layers=1, shared_experts=1, gating="sigmoid", groups=None, bias=True,
                                    weights_norm=True, weights_scale=2.5, yarn_factor=4.0, yarn_orig_ctx=1024,
                                    yarn_mscale_all_dim=1.0, legacy_kv_b=False)


def _mla_hparams(hp: dict, opts: dict[str, Any]) -> dict[str, Any]:
    """deepseek2 metadata as llama.cpp's converter writes it (`extra`: keys after "deepseek2.").

    `legacy_kv_b` writes what converters before the k_b/v_b split wrote: attn_kv_b, the per-head
    widths under key_length/value_length and head_count_kv = head_count."""
    unknown = set(opts) - set(MLA_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown MLA option(s) {sorted(unknown)} (have: {', '.join(MLA_DEFAULTS)})")
    o = {**MLA_DEFAULTS, **opts}
    E, k = hp["n_expert"], hp["n_expert_used"]
    if not 0 <= o["dense_layers"] < hp["n_layer"]:
        raise ValueError(f"dense_layers={o['dense_layers']} must leave at least one of {hp['n_layer']} layers MoE")
    if o["shared_experts"] < 1:  # DeepSeek-V2/V3 and Kimi-K2 all have them; the loader requires them
        raise ValueError(f"shared_experts={o['shared_experts']}: deepseek2 models here have at least one")
    groups = o["groups"]
    if groups is None:  # 4 groups of >= 2 experts where they fit, half of them kept
        groups = (4, max(2, -(-k // (E // 4)))) if E % 4 == 0 and E // 4 >= 2 else (1, 1)
    k_head = o["nope_dim"] + o["rope_dim"]
    extra: dict[str, Any] = {
        "leading_dense_block_count": o["dense_layers"], "attention.kv_lora_rank": o["kv_lora_rank"],
        "rope.dimension_count": o["rope_dim"], "expert_shared_count": o["shared_experts"],
        "expert_gating_func": {"softmax": 1, "sigmoid": 2}[o["gating"]],
        "expert_weights_scale": float(o["weights_scale"]), "expert_group_count": groups[0],
        "expert_group_used_count": groups[1],
    }
    if o["q_lora_rank"]:
        extra["attention.q_lora_rank"] = o["q_lora_rank"]
    if o["legacy_kv_b"]:
        extra.update({"attention.key_length": k_head, "attention.value_length": o["v_dim"]})
    else:
        extra.update({"attention.key_length": o["kv_lora_rank"] + o["rope_dim"],
                      "attention.value_length": o["kv_lora_rank"], "attention.key_length_mla": k_head,
                      "attention.value_length_mla": o["v_dim"]})
    if o["yarn_factor"]:
        extra.update({"rope.scaling.type": "yarn", "rope.scaling.factor": float(o["yarn_factor"]),
                      "rope.scaling.original_context_length": o["yarn_orig_ctx"],
                      "rope.scaling.yarn_log_multiplier": 0.1 * o["yarn_mscale_all_dim"]})
    return dict(extra=extra, n_head_kv=hp["n_head"] if o["legacy_kv_b"] else 1, n_dense_lead=o["dense_layers"],
                n_ff=4 * hp["n_embd"], n_ff_shexp=hp["n_ff_exp"] * o["shared_experts"],
                norm_topk_prob=bool(o["weights_norm"]), mla_bias=bool(o["bias"]), mla_legacy_kv_b=bool(o["legacy_kv_b"]),
                mla_dims=(o["q_lora_rank"], o["kv_lora_rank"], o["rope_dim"], o["nope_dim"], o["v_dim"]))


def _mla_layer_shapes(hp: dict, i: int) -> dict[str, tuple[int, ...]]:
    """One deepseek2 layer, numpy order: MLA attention, then a dense FFN (the first
    `n_dense_lead` layers) or the router (+ selection bias), experts and shared experts."""
    p, e, H, ne = f"blk.{i}.", hp["n_embd"], hp["n_head"], hp["n_expert"]
    ql, kvl, r, n, v = hp["mla_dims"]  # q_lora_rank, kv_lora_rank, rope, nope, v head dims
    out: dict[str, tuple[int, ...]] = {p + "attn_norm.weight": (e,)}
    if ql:
        out.update({p + "attn_q_a.weight": (ql, e), p + "attn_q_a_norm.weight": (ql,),
                    p + "attn_q_b.weight": (H * (n + r), ql)})
    else:
        out[p + "attn_q.weight"] = (H * (n + r), e)
    out.update({p + "attn_kv_a_mqa.weight": (kvl + r, e), p + "attn_kv_a_norm.weight": (kvl,)})
    if hp["mla_legacy_kv_b"]:
        out[p + "attn_kv_b.weight"] = (H * (n + v), kvl)
    else:
        out.update({p + "attn_k_b.weight": (H, kvl, n), p + "attn_v_b.weight": (H, v, kvl)})
    out.update({p + "attn_output.weight": (e, H * v), p + "ffn_norm.weight": (e,)})
    if i < hp["n_dense_lead"]:
        ff = hp["n_ff"]
        return {**out, p + "ffn_gate.weight": (ff, e), p + "ffn_up.weight": (ff, e), p + "ffn_down.weight": (e, ff)}
    ff = hp["n_ff_exp"]
    sff = ff * hp["extra"]["expert_shared_count"]  # no width key: llama.cpp derives it (so must --target-size)
    out[p + "ffn_gate_inp.weight"] = (ne, e)
    if hp["mla_bias"]:
        out[p + "exp_probs_b.bias"] = (ne,)
    out.update({p + "ffn_gate_exps.weight": (ne, ff, e), p + "ffn_up_exps.weight": (ne, ff, e),
                p + "ffn_down_exps.weight": (ne, e, ff)})
    out.update({p + "ffn_gate_shexp.weight": (sff, e), p + "ffn_up_shexp.weight": (sff, e),
                p + "ffn_down_shexp.weight": (e, sff)})
    return out


def _hybrid_hparams(layers: int, head_dim: int) -> dict:
    """Tiny Gated-DeltaNet sizes: 2 key heads shared by 4 value heads (as the real models share
    them), head dim 16, conv width 4; full attention every 4th layer as in the real models (the
    last layer of a shorter stack); rope over a quarter of each attention head (partial rotary)."""
    return dict(ssm_conv_kernel=4, ssm_state_size=16, ssm_group_count=2, ssm_time_step_rank=4, ssm_inner_size=64,
                full_attention_interval=min(4, layers), rope_dim=max(2, head_dim // 4))


def _hybrid_layer_shapes(arch: str, hp: dict, i: int) -> dict[str, tuple[int, ...]]:
    """One Qwen3-Next / Qwen3.5-MoE layer, numpy order: gated full attention (q rows are each
    head's query then its gate) or Gated DeltaNet, then the routed + sigmoid-gated shared experts."""
    spec, p = get_arch(arch), f"blk.{i}."
    e, ne, ff, hd, sff = hp["n_embd"], hp["n_expert"], hp["n_ff_exp"], hp["head_dim"], hp["n_ff_shexp"]
    nk, dk, nv, inner = hp["ssm_group_count"], hp["ssm_state_size"], hp["ssm_time_step_rank"], hp["ssm_inner_size"]
    out: dict[str, tuple[int, ...]] = {p + "attn_norm.weight": (e,)}
    if (i + 1) % hp["full_attention_interval"] == 0:
        kv = hp["n_head_kv"] * hd
        out.update({p + "attn_q.weight": (2 * hp["n_head"] * hd, e), p + "attn_k.weight": (kv, e),
                    p + "attn_v.weight": (kv, e), p + "attn_output.weight": (e, hp["n_head"] * hd),
                    p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
    else:
        conv = 2 * nk * dk + inner
        out.update({p + "attn_qkv.weight": (conv, e), p + "attn_gate.weight": (inner, e),
                    p + "ssm_conv1d.weight": (conv, hp["ssm_conv_kernel"]), p + "ssm_dt.bias": (nv,), p + "ssm_a": (nv,)})
        if spec.linear_attn == "fused_ba":
            out[p + "ssm_ba.weight"] = (2 * nv, e)
        else:
            out.update({p + "ssm_beta.weight": (nv, e), p + "ssm_alpha.weight": (nv, e)})
        out.update({p + "ssm_norm.weight": (inner // nv,), p + "ssm_out.weight": (e, inner)})
    out.update({p + "post_attention_norm.weight": (e,), p + "ffn_gate_inp.weight": (ne, e),
                p + "ffn_gate_exps.weight": (ne, ff, e), p + "ffn_up_exps.weight": (ne, ff, e),
                p + "ffn_down_exps.weight": (ne, e, ff), p + "ffn_gate_inp_shexp.weight": (e,),
                p + "ffn_gate_shexp.weight": (sff, e), p + "ffn_up_shexp.weight": (sff, e),
                p + "ffn_down_shexp.weight": (e, sff)})
    return out


def tensor_shapes(arch: str, hp: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor's numpy-order shape, in llama.cpp's file order."""
    spec = get_arch(arch)
    e, v, ne, ff, hd = hp["n_embd"], hp["n_vocab"], hp["n_expert"], hp["n_ff_exp"], hp["head_dim"]
    q_dim, kv_dim = hp["n_head"] * hd, hp["n_head_kv"] * hd
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, e)}
    for i in range(hp["n_layer"] + hp.get("n_nextn", 0)):
        if arch in FAMILY_LAYERS:
            out.update(FAMILY_LAYERS[arch](hp, i))
            continue
        if spec.linear_attn != "none":
            out.update(_hybrid_layer_shapes(arch, hp, i))
            continue
        if spec.attention == "mla":
            out.update(_mla_layer_shapes(hp, i))
            continue
        if "attn_sinks" in spec.layer_tensors:
            out.update(_gpt_oss_layer_shapes(hp, i))
            continue
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (e,), p + "attn_q.weight": (q_dim, e),
                    p + "attn_k.weight": (kv_dim, e), p + "attn_v.weight": (kv_dim, e)})
        for t in spec.layer_biases:  # qwen2moe: q/k/v biases
            out[p + t + ".bias"] = (q_dim if t == "attn_q" else kv_dim,)
        out[p + "attn_output.weight"] = (e, q_dim)
        if spec.qk_norm == "head":
            out.update({p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
        elif spec.qk_norm == "full":  # over all heads
            out.update({p + "attn_q_norm.weight": (q_dim,), p + "attn_k_norm.weight": (kv_dim,)})
        out.update({p + "ffn_norm.weight": (e,), p + "ffn_gate_inp.weight": (ne, e)})
        if spec.router_bias:  # MiniMax-M2's selection bias
            out[p + "exp_probs_b.bias"] = (ne,)
        out.update({p + "ffn_gate_exps.weight": (ne, ff, e),  # separate gate and up, as llama.cpp
                    p + "ffn_up_exps.weight": (ne, ff, e), p + "ffn_down_exps.weight": (ne, e, ff)})
        if spec.shared_expert:
            sff = hp["n_ff_shexp"]
            out.update({p + "ffn_gate_inp_shexp.weight": (e,), p + "ffn_gate_shexp.weight": (sff, e),
                        p + "ffn_up_shexp.weight": (sff, e), p + "ffn_down_shexp.weight": (e, sff)})
    out.update({"output_norm.weight": (e,), "output.weight": (v, e)})
    return out


def _gpt_oss_layer_shapes(hp: dict, i: int) -> dict[str, tuple[int, ...]]:
    """One gpt-oss layer, numpy order, names as llama.cpp's converter writes them: biased
    attention with sinks, `post_attention_norm` before the FFN, a biased router, and experts with
    biases (HF's interleaved gate_up split into gate and up)."""
    p, e, ne, ff, hd = f"blk.{i}.", hp["n_embd"], hp["n_expert"], hp["n_ff_exp"], hp["head_dim"]
    q_dim, kv_dim = hp["n_head"] * hd, hp["n_head_kv"] * hd
    out: dict[str, tuple[int, ...]] = {p + "attn_norm.weight": (e,)}
    for t, rows in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
        out.update({p + t + ".weight": (rows, e), p + t + ".bias": (rows,)})
    out.update({p + "attn_output.weight": (e, q_dim), p + "attn_output.bias": (e,),
                p + "attn_sinks.weight": (hp["n_head"],), p + "post_attention_norm.weight": (e,),
                p + "ffn_gate_inp.weight": (ne, e), p + "ffn_gate_inp.bias": (ne,),
                p + "ffn_gate_exps.weight": (ne, ff, e), p + "ffn_gate_exps.bias": (ne, ff),
                p + "ffn_up_exps.weight": (ne, ff, e), p + "ffn_up_exps.bias": (ne, ff),
                p + "ffn_down_exps.weight": (ne, e, ff), p + "ffn_down_exps.bias": (ne, e)})
    return out


def build_tensors(arch: str, hp: dict, seed: int = 0, routing: str = "router") -> dict[str, TensorLike]:
    """Every tensor of a random `arch` model, in numpy order, in llama.cpp's file order
    (`routing` "chain": see `chain_tensors`)."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r} (have: {', '.join(ROUTINGS)})")
    rng = np.random.default_rng(seed)  # drawn in file order: small F32 tensors only
    out = {name: _init(name, shape, seed, rng) for name, shape in tensor_shapes(arch, hp).items()}
    if routing == "chain":
        out.update(chain_tensors(hp["n_vocab"], hp["n_embd"], seed))
    return out


def chain_cycle(n_vocab: int, seed: int) -> np.ndarray:
    """The chain model's cycle: token order[i] is followed by order[i + 1] (and the last by the first)."""
    return np.random.default_rng([seed, 0xC4A1]).permutation(n_vocab)


def chain_tensors(n_vocab: int, n_embd: int, seed: int) -> dict[str, np.ndarray]:
    """Embedding and output head of a model whose greedy decoding walks one random cycle of the
    whole vocabulary, so every step sees a new token and the routing spreads over the experts
    (a random model's greedy decoding falls into a short loop over a few experts instead).

    The output row of token order[i+1] is the embedding row of order[i]: with the residual
    dominated by the current token's embedding (CHAIN_EMBD_STD, large next to what the layers
    add), its own row scores highest, so the next token is its successor on the cycle."""
    order = chain_cycle(n_vocab, seed)
    emb = (CHAIN_EMBD_STD * np.random.default_rng([seed, 0xE3B]).standard_normal((n_vocab, n_embd))).astype(np.float32)
    out = np.empty_like(emb)  # [V, d]
    out[np.roll(order, -1)] = emb[order]
    return {"token_embd.weight": emb, "output.weight": out}


def _init(name: str, shape: tuple[int, ...], seed: int, rng: np.random.Generator) -> TensorLike:
    """A tensor's random values; big matrices as RandomTensor, generated while writing."""
    if name.endswith(".exp_probs_b.bias"):  # DeepSeek's selection bias: big enough to change picks
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".attn_sinks.weight"):  # gpt-oss: per-head logits that take a real share of attention
        return rng.standard_normal(shape).astype(np.float32)
    if name.endswith(".bias"):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".ssm_a"):  # -exp(A_log) < 0: every Gated-DeltaNet head's state decays
        return -(0.5 + rng.random(shape)).astype(np.float32)
    if "norm" in name:
        return (1.0 + 0.02 * rng.standard_normal(shape)).astype(np.float32)  # [n]
    if name.endswith(".ffn_gate_inp.weight"):  # the router: [n_expert, n_embd]
        return (ROUTER_STD / math.sqrt(shape[-1]) * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".ffn_gate_inp_shexp.weight"):
        return (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)  # [n_embd]
    std = 0.02 if name == "token_embd.weight" else 1.0 / math.sqrt(shape[-1])  # ~1/sqrt(fan_in)
    return RandomTensor(shape, std, seed)


def estimate_bytes(arch: str, hp: dict, quant: str, expert_quant: str | None = None, mix: QuantMix | None = None) -> int:
    """Tensor data bytes a `make_model` file would hold (the header adds a few KiB + the vocab)."""
    q, eq, notes = qtype_of(quant), qtype_of(expert_quant or DEFAULT_EXPERT_QUANT.get(arch, quant)), []
    shapes = tensor_shapes(arch, hp)
    return sum(tensor_nbytes(shape, tensor_qtype(n, shape, eq, q, notes, mix)) for n, shape in shapes.items())


def fit_target(arch: str, hp: dict, quant: str, target: int, expert_quant: str | None = None,
               mix: QuantMix | None = None) -> dict:
    """Grow experts (to ~MAX_TARGET_EXPERTS), then expert width, so the file approaches `target` bytes."""
    base = estimate_bytes(arch, hp, quant, expert_quant, mix)
    if target < base:
        raise ValueError(f"target size {target} B is smaller than the requested model ({base} B)")
    dense, per_expert = _split_bytes(arch, hp, quant, expert_quant, mix)
    n_exp = int(min(MAX_TARGET_EXPERTS, max(hp["n_expert"], (target - dense) // per_expert)))
    step = max(32, _block(quant), *(GGML_QUANT_SIZES[q][0] for q in (mix.qtypes() if mix else ())))
    per_ff = per_expert * n_exp / hp["n_ff_exp"]  # bytes per unit of expert width, all experts and layers
    ff = max(hp["n_ff_exp"], int((target - dense) // per_ff) // step * step)
    # n_ff is derived again: it follows the expert width unless a shared expert sets it
    hp = normalize_hparams(arch, {**{k: v for k, v in hp.items() if k != "n_ff"}, "n_ff_exp": ff})
    dense, per_expert = _split_bytes(arch, hp, quant, expert_quant, mix)  # width was rounded down: top up
    return {**hp, "n_expert": max(n_exp, int((target - dense) // per_expert))}


def _split_bytes(arch: str, hp: dict, quant: str, expert_quant: str | None = None,
                 mix: QuantMix | None = None) -> tuple[int, int]:
    """(bytes that do not scale with the expert count, bytes per expert across all layers)."""
    one, two = (estimate_bytes(arch, {**hp, "n_expert": n}, quant, expert_quant, mix) for n in (1, 2))
    return one - (two - one), two - one


def make_model(path: str | Path, *, arch: str = "qwen3moe", quant: str = "Q8_0", layers: int = 2, experts: int = 8,
               top_k: int = 2, hidden: int | None = None, expert_ff: int | None = None, heads: int = 4,
               kv_heads: int | None = None, vocab: int = 512, seed: int = 0, target_size: int | str | None = None,
               head_dim: int | None = None, shared_ff: int | None = None, progress: bool = False,
               verbose: bool = False, tokenizer: str | None = None,
               mla: Mapping[str, Any] | tuple[tuple[str, Any], ...] | None = None,
               expert_quant: str | None = None, split_max_size: int | str | None = None,
               arch_opts: Mapping[str, Any] | tuple[tuple[str, Any], ...] | None = None,
               mix: str | QuantMix | None = None, routing: str = "router") -> Path:
    """Write a random `arch` MoE to `path` and return the path (the first part's for a split one).

    hidden / expert_ff default to 64 (256 for K-quants, whose blocks are 256 wide);
    kv_heads defaults to 2 (heads for olmoe, whose llama.cpp loader wants n_head_kv == n_head);
    tokenizer ("bpe" byte-level Qwen2, "kimi" byte-level Kimi-K2 or "spm" SentencePiece) defaults to what `arch`'s real files use;
    `mla` overrides deepseek2's `MLA_DEFAULTS` (a mapping or (key, value) pairs), `arch_opts` the
    `ARCH_OPTIONS` of glm4moe / minimax-m2 / llama4 (the same way);
    `expert_quant` the experts' type (default: what `arch`'s real files use, MXFP4 for gpt-oss, else `quant`);
    `mix` per-part / per-layer expert types over that (`quant_mix`, e.g. "gate_up=Q2_K,down=Q4_K");
    `split_max_size` (bytes, or "2GiB") writes a split model, `STEM-0000k-of-0000n.gguf` beside `path`,
    as `convert_hf_to_gguf.py --split-max-size` does (gguf-py's writer);
    `routing` "chain" makes greedy decoding walk one cycle of the vocabulary (`chain_tensors`)."""
    tokenizer = tokenizer or DEFAULT_TOKENIZER.get(arch, "bpe")
    if tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"unknown tokenizer {tokenizer!r} (supported: {', '.join(TOKENIZER_KINDS)})")
    mix = parse_mix(mix) if isinstance(mix, str) else mix
    width = max(default_width(quant), default_width(expert_quant or DEFAULT_EXPERT_QUANT.get(arch, quant)),
                *(default_width(q.name) for q in (mix.qtypes() if mix else ())))
    kv_heads = kv_heads if kv_heads is not None else (heads if get_arch(arch).kv_heads_equal_heads else min(2, heads))
    hp = model_hparams(arch, layers=layers, experts=experts, top_k=top_k, hidden=hidden or width,
                       expert_ff=expert_ff or width, heads=heads, kv_heads=kv_heads, vocab=vocab,
                       head_dim=head_dim, shared_ff=shared_ff, mla=dict(mla or {}), arch_opts=dict(arch_opts or {}))
    if mix:
        mix.check_layers(layers)
    if target_size is not None:
        hp = fit_target(arch, hp, quant, parse_size(target_size), expert_quant, mix)
    report = write_moe_gguf(path, arch, hp, build_tensors(arch, hp, seed, routing), quant, get_vocab(tokenizer, vocab),
                            progress=progress, expert_quant=expert_quant or DEFAULT_EXPERT_QUANT.get(arch), mix=mix,
                            split_max_size=parse_size(split_max_size) if split_max_size else 0)
    if verbose:
        parts = f" in {len(report.parts)} parts" if len(report.parts) > 1 else ""
        print(f"wrote {report.path}{parts} ({report.nbytes / 2**20:.1f} MiB, {report.seconds:.1f} s): {arch} {quant}, "
              f"{hp['n_layer']} layers x {hp['n_expert']} experts (top {hp['n_expert_used']}), "
              f"hidden {hp['n_embd']}, expert width {hp['n_ff_exp']}")
        for note in report.notes:
            print(f"note: {note}")
    return report.path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moestream make-model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", metavar="OUT.gguf", help="file to write")
    ap.add_argument("--arch", default="qwen3moe", help="qwen3moe | qwen2moe | llama (Mixtral) | olmoe | qwen3next | qwen35moe | gpt-oss | deepseek2 | "
                    "glm4moe | minimax-m2 | llama4")
    ap.add_argument("--quant", default="Q8_0", help=f"the type of the big matrices, one of: {writable()}")
    ap.add_argument("--expert-quant", default=None, help="the experts' type (any of --quant's); default MXFP4 "
                    "for gpt-oss (as its real files), else --quant")
    ap.add_argument("--mix", default=None, metavar="RULES",
                    help="per-tensor expert types over --expert-quant, comma-separated KEY=TYPE with KEY one of "
                    f"{KEYS_HELP} (layer ranges inclusive, win over parts), e.g. "
                    "gate_up=Q2_K,down=Q4_K,layers:0-1=Q8_0")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=None, help="default 64 (256 for K-quants)")
    ap.add_argument("--expert-ff", type=int, default=None, help="expert width; default 64 (256 for K-quants)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None, help="default 2 (= heads for olmoe)")
    ap.add_argument("--head-dim", type=int, default=None, help="qwen3moe only; default hidden/heads")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", choices=TOKENIZER_KINDS, default=None,
                    help="bpe (byte-level, Qwen2 split) | kimi (byte-level, Kimi-K2 split) | spm (SentencePiece, "
                    "byte fallback); default spm for llama")
    ap.add_argument("--routing", choices=ROUTINGS, default="router",
                    help="router (default): random weights; chain: greedy decoding walks one random cycle of the "
                    "vocabulary, a new token every step, so the routing spreads over the experts (benchmarks)")
    ap.add_argument("--target-size", default=None, help="grow experts to approach this file size, e.g. 2GiB")
    ap.add_argument("--split-max-size", default=None, metavar="SIZE",
                    help="write a split model, OUT-0000k-of-0000n.gguf, parts of at most SIZE tensor bytes (e.g. 50M), "
                         "as convert_hf_to_gguf.py --split-max-size does")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        make_model(args.out, arch=args.arch, quant=args.quant, layers=args.layers, experts=args.experts,
                   top_k=args.top_k, hidden=args.hidden, expert_ff=args.expert_ff, heads=args.heads,
                   kv_heads=args.kv_heads, vocab=args.vocab, seed=args.seed, target_size=args.target_size,
                   head_dim=args.head_dim, progress=sys.stderr.isatty(), verbose=True, tokenizer=args.tokenizer,
                   expert_quant=args.expert_quant, split_max_size=args.split_max_size, mix=args.mix,
                   routing=args.routing)
    except (ValueError, OSError) as e:
        print(f"moestream make-model: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
