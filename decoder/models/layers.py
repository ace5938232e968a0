"""Layers every MoE architecture shares: RMSNorm, rope, GQA attention with a KV cache, MoE block.

Functions take plain tensors and one layer's weights as a dict keyed by the GGUF short name
(`attn_q`, `attn_q.bias`, `attn_q_norm`, ...), so an architecture module only says which of
them it has. Tokens of a batch are flattened to rows `[N, d]` (N = B*T) outside attention.

Batching: sequences are left-padded to one length; `valid[B, S]` marks real tokens, each
sequence counts its own positions (a pad never advances them), and attention never looks at
a pad key. Pad rows skip the MoE block entirely, so they never fetch an expert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .weights import QuantWeight

Weights = dict[str, "torch.Tensor | QuantWeight"]


def linear(x: torch.Tensor, w: "torch.Tensor | QuantWeight", bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for a float weight or one kept as its quantized blocks."""
    if isinstance(w, QuantWeight):
        y = w.linear(x)
        return y if bias is None else y + bias
    return F.linear(x, w, bias)


def embed(tokens: torch.Tensor, w: "torch.Tensor | QuantWeight", dtype: torch.dtype) -> torch.Tensor:
    """Rows of the embedding table for token ids [N] -> [N, d]."""
    return w.rows(tokens, dtype) if isinstance(w, QuantWeight) else F.embedding(tokens, w)


def _cpu_f32(*ts: torch.Tensor) -> bool:
    """All on the CPU as float32: the compiled CPU steps (`kernels.cpu.attention`) apply."""
    return all(t.dtype == torch.float32 and t.is_cpu for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 (as llama.cpp and HF do)."""
    if _cpu_f32(x, weight) and weight.dim() == 1 and not x.requires_grad:  # a torch op costs ~10x more
        from ..kernels.cpu.attention import rms_norm_rows

        rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # [N, n] (reshape: ~3 us)
        out = rms_norm_rows(rows.contiguous().numpy(), weight.contiguous().numpy(), eps)
        return torch.from_numpy(out) if x.dim() == 2 else torch.from_numpy(out).reshape(x.shape)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one op
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# -- rope ----------------------------------------------------------------------------------
def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float,
                 style: str = "neox") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, T, hd] laid out for `style`: "neox" (dims i and i + hd/2 rotate
    together) or "norm" (llama.cpp's normal rope: dims 2i and 2i+1 rotate together)."""
    dev = positions.device
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=dev, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, T, hd/2]
    if style == "norm":
        emb = freqs.repeat_interleave(2, dim=-1)  # [B, T, hd] f0 f0 f1 f1 ...
    else:
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, hd] f0 f1 ... f0 f1 ...
    return emb.cos(), emb.sin()


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, hd]; cos/sin: [B, T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [B, H, T, hd]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # [B, 1, T, hd]
    return x * cos + rotated * sin


def apply_rope_norm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved rope, x: [B, H, T, hd]; cos/sin from `rope_cos_sin(..., style="norm")`.

    Llama-family GGUFs had q/k rows permuted by llama.cpp's converter so that this rotation
    of adjacent pairs equals Hugging Face's rotate-half on the original weights.
    """
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # [B, H, T, hd]
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)  # [B, 1, T, hd]
    return x * cos + rotated * sin


_APPLY_ROPE = {"neox": apply_rope_neox, "norm": apply_rope_norm}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rope of `style` on the first cos.shape[-1] dims of each head, the rest as is (partial rotary:
    GLM-4.5, MiniMax-M2): x [B, H, T, hd], cos/sin [B, T, rope_dim]."""
    rd, rope = cos.shape[-1], _APPLY_ROPE[style]
    if rd == x.shape[-1]:
        return rope(x, cos, sin)
    return torch.cat((rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)  # [B, H, T, hd]


# -- KV cache ------------------------------------------------------------------------------
@dataclass
class KVCache:
    """Keys and values of every layer for a left-padded batch, preallocated to `capacity`."""

    k: list[torch.Tensor]  # per layer [B, n_kv, capacity, hd]
    v: list[torch.Tensor]  # per layer [B, n_kv, capacity, hd]
    valid: torch.Tensor  # [B, capacity] bool: a real token (not padding) sits there
    next_pos: torch.Tensor  # [B] int64: rope position of each sequence's next real token
    length: int = 0  # cache entries filled (same for every sequence)
    _arrays: dict = field(default_factory=dict, repr=False, compare=False)  # layer -> numpy views (CPU)

    @classmethod
    def empty(cls, n_layer: int, batch: int, n_kv: int, head_dim: int, capacity: int,
              device: torch.device, dtype: torch.dtype) -> "KVCache":
        shape = (batch, n_kv, capacity, head_dim)
        return cls(
            k=[cache_zeros(shape, device, dtype) for _ in range(n_layer)],
            v=[cache_zeros(shape, device, dtype) for _ in range(n_layer)],
            valid=torch.zeros(batch, capacity, dtype=torch.bool, device=device),
            next_pos=torch.zeros(batch, dtype=torch.int64, device=device),
        )

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def arrays(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Layer's k, v [B, Hkv, C, hd] and valid [B, C] as numpy views of the same memory (CPU
        tensors, updated in place, never replaced): made once, not on every decode step. A
        float16 cache comes as its int16 bits (what the compiled attention reads)."""
        got = self._arrays.get(layer)
        if got is None:
            got = self._arrays[layer] = (_bits(self.k[layer]), _bits(self.v[layer]), self.valid.numpy())
        return got

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a step's k, v [B, Hkv, T, hd] at `start`; the layer's keys and values so far
        [B, Hkv, start + T, hd] in k's dtype (converted where the cache keeps another, e.g. float16)."""
        T = k.shape[2]
        self.k[layer][:, :, start:start + T] = k
        self.v[layer][:, :, start:start + T] = v
        keys, vals = self.k[layer][:, :, :start + T], self.v[layer][:, :, :start + T]
        return keys.to(k.dtype), vals.to(v.dtype)

    def advance(self, valid: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Reserve T entries for tokens with mask `valid` [B, T]; return their positions [B, T] and start."""
        T = valid.shape[1]
        if self.length + T > self.capacity:
            raise ValueError(f"KV cache full: {self.length} + {T} tokens > capacity {self.capacity}")
        start = self.length
        positions = self.next_pos[:, None] + valid.long().cumsum(1) - 1  # [B, T]
        self.valid[:, start:start + T] = valid
        self.next_pos += valid.long().sum(1)
        self.length += T
        return positions.clamp(min=0), start


def cache_zeros(shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed cache tensor whose CPU memory is committed as it is written. A cache is sized for
    its whole capacity (a chat request without max_tokens: the model's context, 40-260k
    positions) but fills a token at a time; torch.zeros writes every byte at once (a 262,144-position
    cache of a 16-layer, 4-kv-head model: 4.3 GB resident before the first token), numpy's zeros is
    calloc, whose large blocks are fresh zero pages, each resident once written (key and value
    rows of a head are contiguous: memory grows with the positions used)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size])
    return torch.from_numpy(raw).view(dtype)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy() if t.dtype == torch.float16 else t.numpy()


def attention_mask(cache: KVCache, start: int, T: int) -> torch.Tensor:
    """[B, 1, T, S] bool: query t may see key s if s is real and not in its future.

    A pad query may also see itself, so no row is empty (its output is discarded anyway).
    """
    S = start + T
    s = torch.arange(S, device=cache.valid.device)  # [S]
    t = torch.arange(start, S, device=cache.valid.device)  # [T]
    causal = s[None, :] <= t[:, None]  # [T, S]
    self_ = s[None, :] == t[:, None]  # [T, S]
    real = cache.valid[:, None, :S]  # [B, 1, S]
    return ((real & causal) | self_)[:, None]  # [B, 1, T, S]


# -- attention -----------------------------------------------------------------------------
@dataclass(frozen=True)
class AttnShape:
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    eps: float
    qk_norm: str = "none"  # "none" | "head" (per-head RMSNorm) | "full" (over all heads)
    rope: str = "neox"  # "neox" | "norm" (interleaved pairs, llama.cpp's LLAMA_ROPE_TYPE_NORM)
    rope_dim: int = 0  # dims of each head that are roped (the first ones); 0 = all of head_dim

    def __post_init__(self) -> None:
        if self.rope not in _APPLY_ROPE:
            raise ValueError(f"unknown rope style {self.rope!r} (have: {', '.join(_APPLY_ROPE)})")


def _proj(x: torch.Tensor, w: Weights, name: str) -> torch.Tensor:
    return linear(x, w[name], w.get(f"{name}.bias"))


def _qkv_proj(x: torch.Tensor, w: Weights) -> tuple[torch.Tensor, ...]:
    """q [N, H*hd], k, v [N, Hkv*hd]: one kernel call when the three are rows of one stacked weight."""
    wq, wk, wv = w["attn_q"], w["attn_k"], w["attn_v"]
    group = wq.group if isinstance(wq, QuantWeight) else None
    if group is None or not (getattr(wk, "group", None) is group is getattr(wv, "group", None)):
        return _proj(x, w, "attn_q"), _proj(x, w, "attn_k"), _proj(x, w, "attn_v")
    q, k, v = group.linear(x).split([wq.shape[0], wk.shape[0], wv.shape[0]], dim=-1)  # [N, *] views
    out = []
    for t, name in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")):
        b = w.get(f"{name}.bias")
        out.append(t.contiguous() if b is None else t + b)
    return tuple(out)


def _qkv(x: torch.Tensor, w: Weights, a: AttnShape, B: int, T: int) -> tuple[torch.Tensor, ...]:
    q, k, v = _qkv_proj(x, w)  # [N, H*hd], [N, Hkv*hd] x2
    if a.qk_norm == "full":
        q, k = rms_norm(q, w["attn_q_norm"], a.eps), rms_norm(k, w["attn_k_norm"], a.eps)
    q = q.reshape(B, T, a.n_head, a.head_dim)  # [B, T, H, hd]
    k = k.reshape(B, T, a.n_head_kv, a.head_dim)  # [B, T, Hkv, hd]
    v = v.reshape(B, T, a.n_head_kv, a.head_dim)  # [B, T, Hkv, hd]
    if a.qk_norm == "head":
        q, k = rms_norm(q, w["attn_q_norm"], a.eps), rms_norm(k, w["attn_k_norm"], a.eps)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H(kv), T, hd]


@dataclass(frozen=True)
class StepAttn:
    """What every layer's attention shares in one forward pass, computed once per pass."""

    start: int  # cache index of this step's first token
    T: int  # tokens per sequence in this step
    cos: torch.Tensor  # [B, T, hd]
    sin: torch.Tensor  # [B, T, hd]
    mask: torch.Tensor  # [B, 1, rep*T, S] bool, rows repeated for the query heads folded per kv head
    rope_rows: tuple[np.ndarray, np.ndarray] | None = None  # a CPU decode step's (cos, sin) [B, rope_dim] arrays


def step_attn(a: AttnShape, cache: KVCache, positions: torch.Tensor, start: int) -> StepAttn:
    """Rope tables and mask of one step (they depend on positions and the cache, not the layer)."""
    B, T = positions.shape
    cos, sin = rope_cos_sin(positions, a.rope_dim or a.head_dim, a.rope_base, a.rope)  # [B, T, rope_dim]
    mask = attention_mask(cache, start, T)  # [B, 1, T, S]
    rep = a.n_head // a.n_head_kv
    if rep > 1:  # query rows of one kv head: rep heads x T tokens, head-major (see `attention`)
        mask = mask.repeat(1, 1, rep, 1)  # [B, 1, rep*T, S]
    rows = (cos[:, 0].contiguous().numpy(), sin[:, 0].contiguous().numpy()) if T == 1 and _cpu_f32(cos) else None
    return StepAttn(start, T, cos, sin, mask, rows)


def attention(x: torch.Tensor, w: Weights, a: AttnShape, layer: int, cache: KVCache, st: StepAttn) -> torch.Tensor:
    """Self-attention of rows x [B*T, d] (already normed); writes this step's K/V into the cache.

    GQA without copying K/V: the `rep` query heads that share a kv head are folded into its
    query rows ([B, Hkv, rep*T, hd]), so every query attends to its kv head's keys as they are.
    """
    if st.rope_rows is not None and _cpu_f32(x):  # a CPU decode step: one compiled call after the projections
        return _proj(_decode_attention(x, w, a, layer, cache, st), w, "attn_output")  # [B, d]
    B, T, start = x.shape[0] // st.T, st.T, st.start
    q, k, v = _qkv(x, w, a, B, T)
    q, k = apply_rope(q, st.cos, st.sin, a.rope), apply_rope(k, st.cos, st.sin, a.rope)  # [B, H(kv), T, hd]
    keys, vals = cache.store(layer, start, k, v)  # [B, Hkv, S, hd] x2
    q = q.reshape(B, a.n_head_kv, -1, a.head_dim)  # [B, Hkv, rep*T, hd]; head h uses kv head h // rep
    out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=st.mask)  # [B, Hkv, rep*T, hd]
    # reshape, not view: the kernel SDPA picks decides the output's strides (CUDA float32's is not
    # contiguous in these dims), and a copy where needed is cheap next to the projections
    out = out.reshape(B, a.n_head, T, a.head_dim).transpose(1, 2).reshape(B * T, a.n_head * a.head_dim)  # [N, H*hd]
    return _proj(out, w, "attn_output")  # [N, d]


def _qkv_rows(x: torch.Tensor, w: Weights) -> torch.Tensor:
    """The q, k and v projections side by side [N, (H + 2 Hkv) hd]: one stacked weight's output
    as it comes, when there are no biases to add."""
    wq = w["attn_q"]
    group = wq.group if isinstance(wq, QuantWeight) else None
    if group is not None and group is getattr(w["attn_k"], "group", None) is getattr(w["attn_v"], "group", None) \
            and not any(f"attn_{p}.bias" in w for p in "qkv"):
        return group.linear(x)
    return torch.cat(_qkv_proj(x, w), dim=-1)


def _decode_attention(x: torch.Tensor, w: Weights, a: AttnShape, layer: int, cache: KVCache,
                      st: StepAttn) -> torch.Tensor:
    """`attention` of one token per sequence (x [B, d]) before the output projection: [B, H*hd]."""
    from ..kernels.cpu.attention import QK_NORM, ROPE, decode_attention

    qkv = _qkv_rows(x, w).contiguous().numpy()  # [B, (H + 2 Hkv) hd]
    mode = QK_NORM[a.qk_norm]
    qn, kn = (w["attn_q_norm"].numpy(), w["attn_k_norm"].numpy()) if mode else (_NO_NORM, _NO_NORM)
    (cos, sin), (kc, vc, valid) = st.rope_rows, cache.arrays(layer)  # [B, rope_dim] x2; numpy views
    out = decode_attention(qkv, a.n_head, a.n_head_kv, a.head_dim, qn, kn, mode, a.eps, cos, sin, ROPE[a.rope],
                           kc, vc, valid, st.start)
    return torch.from_numpy(out)  # [B, H*hd]


_NO_NORM = np.zeros(1, np.float32)


# -- MoE -----------------------------------------------------------------------------------
def route_softmax(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts then top-k: weights [N, k] (in logits' dtype) and expert ids [N, k].

    With `norm_topk_prob` the k weights are renormalized (equal to a softmax over the top-k
    logits: Mixtral, Qwen3-MoE); without, they stay shares of all experts (Qwen2-MoE, OLMoE).
    """
    if _cpu_f32(logits):
        return _route_cpu(logits, top_k, "softmax", norm_topk_prob)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [N, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [N, k], [N, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)  # [N, k]
    return weights.to(logits.dtype), ids


def route_topk_softmax(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the logits, then a softmax over those k (gpt-oss; `norm_topk_prob` is moot: the
    weights always sum to 1): weights [N, k] (in logits' dtype) and expert ids [N, k]."""
    if _cpu_f32(logits):
        return _route_cpu(logits, top_k, "topk_softmax", norm_topk_prob)
    top, ids = torch.topk(logits, top_k, dim=-1)  # [N, k], [N, k]
    return torch.softmax(top, dim=-1, dtype=torch.float32).to(logits.dtype), ids


def route_topk_sigmoid(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the logits, each weighted by its own sigmoid (Llama 4; not renormalized):
    weights [N, k] (in logits' dtype) and expert ids [N, k]."""
    if _cpu_f32(logits):
        return _route_cpu(logits, top_k, "topk_sigmoid", norm_topk_prob)
    top, ids = torch.topk(logits, top_k, dim=-1)  # [N, k], [N, k]
    weights = torch.sigmoid(top.float())  # [N, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def _route_cpu(logits: torch.Tensor, top_k: int, kind: str, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing function `kind` in one compiled loop (`kernels.cpu.moe.route_rows`): the same
    choice and weights as the torch ops, up to float32 rounding."""
    from ..kernels.cpu.moe import ROUTE_KINDS, route

    weights, ids = route(logits.contiguous().numpy(), top_k, ROUTE_KINDS[kind], norm)  # [N, k], [N, k]
    return torch.from_numpy(weights), torch.from_numpy(ids)


Router = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]
# `ArchSpec.routing` -> the routing function of that family
ROUTING: dict[str, Router] = {"softmax": route_softmax, "topk_softmax": route_topk_softmax,
                              "topk_sigmoid": route_topk_sigmoid}


def dense_ffn(x: torch.Tensor, w: Weights) -> torch.Tensor:
    """A dense layer's SwiGLU FFN (ffn_gate/up/down): x [N, d] -> [N, d]; no expert to fetch."""
    return linear(F.silu(linear(x, w["ffn_gate"])) * linear(x, w["ffn_up"]), w["ffn_down"])  # [N, d]


def shared_expert(x: torch.Tensor, w: Weights) -> torch.Tensor:
    """An always-on expert, scaled per row by sigmoid(gate_inp_shexp . x): x [N, d] -> [N, d].

    llama.cpp's converter writes the shared gate as [d, 1] (HF's Linear(d, 1)); older writers
    squeezed it to a [d] vector. Both are accepted at load (`common.arch.dense_shapes`).
    Without that gate (DeepSeek) the expert's output is added as it is.
    """
    h = F.silu(linear(x, w["ffn_gate_shexp"])) * linear(x, w["ffn_up_shexp"])  # [N, ff]
    out = linear(h, w["ffn_down_shexp"])  # [N, d]
    g = w.get("ffn_gate_inp_shexp")
    if g is None:
        return out
    logit = linear(x, g) if len(g.shape) == 2 else (x @ g)[:, None]  # [N, 1]
    return torch.sigmoid(logit) * out  # [N, d]
