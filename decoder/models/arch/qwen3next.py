"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet linear attention and gated full
attention, each layer followed by a sparse MoE (softmax router, top-k renormalized) plus a
sigmoid-gated shared expert.

What is new next to the generic transformer, and overridden here:
- Layer kinds: every `full_attention_interval`-th layer is full attention, the others are Gated
  DeltaNet (`HParams.recurrent`). The pre-FFN norm is called `post_attention_norm`.
- Gated full attention: `attn_q` projects each head's query *and* an output gate ([d, 2*H*hd],
  per head: hd query rows then hd gate rows); q/k get per-head RMSNorm, rope turns only the
  first `rope_dim` dims of a head (partial rotary, NEOX pairs), and the attention output is
  multiplied by sigmoid(gate) before `attn_output`.
- Gated DeltaNet: `attn_qkv` -> a causal depthwise conv (width K, `ssm_conv1d`) -> SiLU -> q, k, v;
  q and k are L2-normalized, q scaled by 1/sqrt(d_k); per value head a decay
  g = ssm_a * softplus(alpha + ssm_dt) (ssm_a = -exp(A_log), as llama.cpp's converter stores it)
  and a write strength beta = sigmoid(b) drive the delta rule on a [d_k, d_v] state S:
      S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
  then o is RMSNorm'ed (`ssm_norm`, per head) times SiLU(`attn_gate` x) and projected (`ssm_out`).
  The state is carried in `HybridCache` (the last K-1 conv inputs and S, float32, per
  sequence); a prompt step runs the chunked form of the rule (matrix products over 64 tokens at
  a time), a decode step the recurrent form; a pad (valid False) leaves both states untouched.

llama.cpp's converter (Qwen3NextModel) writes: norm weights + 1 (HF's RMSNorm is x * (1 + w)),
except the DeltaNet's own `ssm_norm`; HF's per-key-head interleaved `in_proj_qkvz` split into
`attn_qkv` (all q, all k, all v) and `attn_gate` (z); `in_proj_ba` as `ssm_ba` (per key head:
its value heads' b, then their a); A_log as ssm_a = -exp(A_log); dt_bias as `ssm_dt.bias`; the
conv kernel squeezed to [C, K]. Value head j reads key head j // (n_v / n_k) ("grouped").
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from ....common.layout import HParams
from . import qwen3moe
from ..layers import (
    KVCache,
    cache_zeros,
    StepAttn,
    Weights,
    apply_rope_neox,
    linear,
    rms_norm,
    step_attn,
)
from ..moe_transformer import MoETransformer

ARCH = "qwen3next"
L2_EPS = 1e-6  # the L2 norm of q and k (HF's l2norm / the FLA kernels)


@dataclass
class HybridCache(KVCache):
    """KV of the full-attention layers (a recurrent layer's K/V hold no positions) and, for each
    Gated-DeltaNet layer, its conv window and delta-rule state per sequence."""

    conv: list[torch.Tensor] = field(default_factory=list)  # per layer [B, K-1, C]: last K-1 real conv inputs
    ssm: list[torch.Tensor] = field(default_factory=list)  # per layer [B, n_v, d_k, d_v] float32


@dataclass(frozen=True)
class DeltaNetShape:
    n_k: int  # key (and query) heads
    n_v: int  # value heads, a multiple of n_k
    d_k: int
    d_v: int
    conv_kernel: int
    eps: float
    fused_ba: bool  # one `ssm_ba` projection (Qwen3-Next) or `ssm_beta` + `ssm_alpha` (Qwen3.5)
    v_heads: str  # which key head value head j reads: "grouped" (j // r) or "tiled" (j % n_k)

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k * self.d_k + self.n_v * self.d_v

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """Key heads to value heads: x [..., n_k, d] -> [..., n_v, d]."""
        r = self.n_v // self.n_k
        if r == 1:
            return x
        return x.repeat_interleave(r, dim=-2) if self.v_heads == "grouped" else x.repeat(*([1] * (x.dim() - 2)), r, 1)


class Model(MoETransformer):
    """Qwen3-Next: `attend` is gated full attention or Gated DeltaNet by layer; the rest generic."""

    V_HEADS = "grouped"  # llama.cpp's qwen3next keeps HF's value-head order (see the module doc)

    def __init__(self, hparams: HParams, dense: dict[str, torch.Tensor]):
        super().__init__(hparams, dense)
        hp = hparams
        if len(hp.recurrent) != hp.n_layer:
            raise ValueError(f"{hp.arch}: hparams carry no layer kinds (recurrent={hp.recurrent!r})")
        for w in self.layers:  # the generic block and router_logits norm with `ffn_norm`
            w["ffn_norm"] = w["post_attention_norm"]
        self.rope_dim = hp.rope_dim or hp.head_dim
        if self.rope_dim % 2 or self.rope_dim > hp.head_dim:
            raise ValueError(f"{hp.arch}: rope.dimension_count={self.rope_dim} must be even and "
                             f"<= head_dim={hp.head_dim}")
        self.rope_attn = replace(self.attn, head_dim=self.rope_dim)  # rope tables of rope_dim only
        self.gdn = DeltaNetShape(hp.ssm_group_count, hp.ssm_time_step_rank, hp.ssm_state_size,
                                 hp.ssm_inner_size // hp.ssm_time_step_rank, hp.ssm_conv_kernel, hp.rms_eps,
                                 self.spec.linear_attn == "fused_ba", self.V_HEADS)

    def new_cache(self, batch: int, capacity: int) -> HybridCache:
        hp, g, dev, dt = self.hparams, self.gdn, self.device, self.dtype
        kv = [(batch, hp.n_head_kv, 0 if rec else capacity, hp.head_dim) for rec in hp.recurrent]
        return HybridCache(
            k=[cache_zeros(s, dev, self.kv_dtype) for s in kv],
            v=[cache_zeros(s, dev, self.kv_dtype) for s in kv],
            valid=torch.zeros(batch, capacity, dtype=torch.bool, device=dev),
            next_pos=torch.zeros(batch, dtype=torch.int64, device=dev),
            conv=[torch.zeros((batch, g.conv_kernel - 1, g.conv_dim) if rec else (0,), device=dev, dtype=dt)
                  for rec in hp.recurrent],
            ssm=[torch.zeros((batch, g.n_v, g.d_k, g.d_v) if rec else (0,), device=dev, dtype=torch.float32)
                 for rec in hp.recurrent],  # float32 whatever the model's dtype (as HF and llama.cpp keep it)
        )

    def prepare(self, cache: KVCache, valid: torch.Tensor) -> StepAttn:
        positions, start = cache.advance(valid)  # [B, T]
        return step_attn(self.rope_attn, cache, positions, start)  # cos/sin [B, T, rope_dim]

    def attend(self, layer: int, x: torch.Tensor, cache: KVCache, st: StepAttn) -> torch.Tensor:
        if self.hparams.recurrent[layer]:
            return gated_delta_net(x, self.layers[layer], self.gdn, layer, cache, st)
        return gated_attention(x, self.layers[layer], self, layer, cache, st)


# -- gated full attention ---------------------------------------------------------------------
def partial_rope(x: torch.Tensor, st: StepAttn) -> torch.Tensor:
    """NEOX rope on the first rope_dim dims of each head (st's tables), the rest as is: [B, H, T, hd]."""
    rd = st.cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rope_neox(x, st.cos, st.sin)
    return torch.cat((apply_rope_neox(x[..., :rd], st.cos, st.sin), x[..., rd:]), dim=-1)


def gated_attention(x: torch.Tensor, w: Weights, m: Model, layer: int, cache: KVCache, st: StepAttn) -> torch.Tensor:
    """Full attention of normed rows x [N, d] whose output is scaled by sigmoid(gate) per head -> [N, d]."""
    a = m.attn
    B, T, start, H, Hkv, hd = x.shape[0] // st.T, st.T, st.start, a.n_head, a.n_head_kv, a.head_dim
    qg = linear(x, w["attn_q"]).reshape(B, T, H, 2 * hd)  # [B, T, H, 2hd]: per head, query then gate
    gate = qg[..., hd:].reshape(B * T, H * hd)  # [N, H*hd]
    q = rms_norm(qg[..., :hd], w["attn_q_norm"], a.eps).transpose(1, 2)  # [B, H, T, hd]
    k = linear(x, w["attn_k"]).reshape(B, T, Hkv, hd)  # [B, T, Hkv, hd]
    k = rms_norm(k, w["attn_k_norm"], a.eps).transpose(1, 2)  # [B, Hkv, T, hd]
    v = linear(x, w["attn_v"]).reshape(B, T, Hkv, hd).transpose(1, 2)  # [B, Hkv, T, hd]
    q, k = partial_rope(q, st), partial_rope(k, st)
    keys, vals = cache.store(layer, start, k, v)  # [B, Hkv, S, hd] x2
    q = q.reshape(B, Hkv, -1, hd)  # [B, Hkv, rep*T, hd]: the query heads of one kv head folded (see layers.attention)
    out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=st.mask)  # [B, Hkv, rep*T, hd]
    out = out.reshape(B, H, T, hd).transpose(1, 2).reshape(B * T, H * hd)  # [N, H*hd]
    return linear(out * torch.sigmoid(gate), w["attn_output"])  # [N, d]


# -- Gated DeltaNet ---------------------------------------------------------------------------
def beta_decay(x: torch.Tensor, w: Weights, g: DeltaNetShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Write strength beta and log-decay per value head for rows x [N, d]: ([N, n_v], [N, n_v])."""
    if g.fused_ba:  # per key head: its r value heads' b, then their a
        r = g.n_v // g.n_k
        ba = linear(x, w["ssm_ba"]).reshape(-1, g.n_k, 2 * r)  # [N, n_k, 2r]
        b, a = ba[..., :r].reshape(-1, g.n_v), ba[..., r:].reshape(-1, g.n_v)  # [N, n_v] x2
    else:
        b, a = linear(x, w["ssm_beta"]), linear(x, w["ssm_alpha"])  # [N, n_v] x2
    return torch.sigmoid(b), w["ssm_a"] * F.softplus(a + w["ssm_dt.bias"])


def project_qkvz(x: torch.Tensor, w: Weights, g: DeltaNetShape) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv input (all q, all k, all v) [N, C] and the output gate z [N, n_v*d_v] of rows x [N, d].

    Older Qwen3-Next GGUFs (converted before llama.cpp split it) hold HF's `in_proj_qkvz` as
    `ssm_in`: per key head its q, k, then its value heads' v and z; its output is regrouped here."""
    if "ssm_in" not in w:
        return linear(x, w["attn_qkv"]), linear(x, w["attn_gate"])
    rv = g.n_v // g.n_k * g.d_v
    y = linear(x, w["ssm_in"]).reshape(x.shape[0], g.n_k, -1)  # [N, n_k, 2 d_k + 2 rv]
    q, k, v, z = torch.split(y, [g.d_k, g.d_k, rv, rv], dim=-1)
    return torch.cat([t.reshape(x.shape[0], -1) for t in (q, k, v)], dim=-1), z.reshape(x.shape[0], -1)


def causal_conv(mixed: torch.Tensor, valid: torch.Tensor, state: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """SiLU of the depthwise causal conv over each sequence's real inputs: mixed [B, T, C],
    state [B, K-1, C] (the last K-1 real inputs; updated in place), kernel [C, K] -> [B, T, C].

    Vectorized over T: the K-1 state entries and this step's real rows are ranked in order, and
    each row convolves the K entries ranked up to its own, so pads (valid False) are skipped
    wherever they sit. A pad row's output is that of the last real row before it (discarded)."""
    B, T, C = mixed.shape
    K = kernel.shape[1]
    seq = torch.cat((state, mixed), dim=1)  # [B, K-1+T, C]
    real = torch.cat((valid.new_ones(B, K - 1), valid), dim=1)  # [B, K-1+T]
    rank = real.long().cumsum(1) - 1  # [B, K-1+T]: index among the real entries (a pad: the last real's)
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)  # [B, K-1+T]: real entries' positions first
    own = rank[:, K - 1:]  # [B, T]
    out = torch.zeros_like(mixed)  # [B, T, C]
    for j in range(K):  # kernel tap j reads the real entry ranked K-1-j before the row's own
        where = order.gather(1, (own - (K - 1 - j)).clamp(min=0))  # [B, T]
        out += seq.gather(1, where[..., None].expand(B, T, C)) * kernel[:, j]  # [B, T, C]
    n_real = real.sum(1, keepdim=True)  # [B, 1]
    last = order.gather(1, n_real - (K - 1) + torch.arange(K - 1, device=real.device))  # [B, K-1]
    state.copy_(seq.gather(1, last[..., None].expand(B, K - 1, C)))
    return F.silu(out)


# Prefill steps run the chunked form of the delta rule (matrix products over CHUNK tokens at a
# time); a decode step (one token) the recurrent form.
CHUNK = 64


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor,
               valid: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """The gated delta rule: q, k [B, T, H, d_k], v [B, T, H, d_v], beta and log-decay [B, T, H],
    state S [B, H, d_k, d_v] (updated in place) -> o [B, T, H, d_v].

    Per token t:  S <- exp(g_t) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t.
    A pad (valid False) gets beta = 0 and g = 0, which leaves S exactly as it was. Computed in
    float32 (S is float32), returned in v's dtype."""
    dtype = v.dtype
    beta = beta.float() * valid[..., None]  # [B, T, H]
    decay = decay.float() * valid[..., None]  # [B, T, H]
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))  # [B, H, T, d]
    beta, decay = beta.transpose(1, 2), decay.transpose(1, 2)  # [B, H, T]
    if q.shape[2] == 1:
        return _delta_step(q, k, v, beta, decay, S).transpose(1, 2).to(dtype)
    outs = [_delta_chunk(*(x[:, :, c:c + CHUNK] for x in (q, k, v, beta, decay)), S)
            for c in range(0, q.shape[2], CHUNK)]
    return torch.cat(outs, dim=2).transpose(1, 2).to(dtype)  # [B, T, H, d_v]


def _delta_step(q, k, v, beta, decay, S):
    """One token, recurrent form: q, k [B, H, 1, d_k], v [B, H, 1, d_v], beta/decay [B, H, 1] -> [B, H, 1, d_v]."""
    S.mul_(decay.exp()[..., None])  # [B, H, d_k, d_v]
    u = (v - k @ S) * beta[..., None]  # [B, H, 1, d_v]
    S.add_(k.transpose(-1, -2) @ u)  # [B, H, d_k, d_v]
    return q @ S  # [B, H, 1, d_v]


def _delta_chunk(q, k, v, beta, decay, S):
    """L tokens at once (q, k [B, H, L, d_k], v [B, H, L, d_v], beta/decay [B, H, L]) -> [B, H, L, d_v].

    With G = cumsum(g), D[t, j] = exp(G_t - G_j) (j <= t) and S0 the state before the chunk, the
    written values solve (I + M) U = beta (V - diag(exp G) K S0), M[t, j] = beta_t (k_t . k_j) D[t, j]
    for j < t (unit lower triangular); then o = (exp G q) S0 + tril(Q K^T * D) U and
    S = exp(G_L) S0 + (exp(G_L - G) K)^T U."""
    L = q.shape[2]
    G = decay.cumsum(-1)  # [B, H, L]
    diff = G[..., :, None] - G[..., None, :]  # [B, H, L, L]
    future = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)  # [L, L] j > t
    D = diff.masked_fill(future, float("-inf")).exp()  # [B, H, L, L]: 0 above the diagonal
    eye = torch.eye(L, dtype=q.dtype, device=q.device)
    M = (k @ k.transpose(-1, -2)) * D * beta[..., None]  # [B, H, L, L]
    A = M.tril(-1) + eye  # I + M: unit lower triangular
    rhs = beta[..., None] * (v - (k * G.exp()[..., None]) @ S)  # [B, H, L, d_v]
    U = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [B, H, L, d_v]
    o = (q * G.exp()[..., None]) @ S + ((q @ k.transpose(-1, -2)) * D) @ U  # [B, H, L, d_v]
    last = G[..., -1:]  # [B, H, 1]
    S.mul_(last.exp()[..., None]).add_((k * (last - G).exp()[..., None]).transpose(-1, -2) @ U)
    return o


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gated_delta_net(x: torch.Tensor, w: Weights, g: DeltaNetShape, layer: int, cache: HybridCache,
                    st: StepAttn) -> torch.Tensor:
    """A Gated DeltaNet layer on normed rows x [N, d] -> [N, d]; carries its state in `cache`."""
    B, T = x.shape[0] // st.T, st.T
    valid = cache.valid[:, st.start:st.start + T]  # [B, T]
    qkv, z = project_qkvz(x, w, g)  # [N, C], [N, n_v*d_v]
    mixed = causal_conv(qkv.reshape(B, T, -1), valid, cache.conv[layer], w["ssm_conv1d"])  # [B, T, C]
    kd = g.n_k * g.d_k
    q = _l2norm(mixed[..., :kd].reshape(B, T, g.n_k, g.d_k)) * g.d_k ** -0.5  # [B, T, n_k, d_k]
    k = _l2norm(mixed[..., kd:2 * kd].reshape(B, T, g.n_k, g.d_k))  # [B, T, n_k, d_k]
    v = mixed[..., 2 * kd:].reshape(B, T, g.n_v, g.d_v)  # [B, T, n_v, d_v]
    beta, decay = beta_decay(x, w, g)  # [N, n_v] x2
    o = delta_rule(g.expand(q), g.expand(k), v, beta.reshape(B, T, g.n_v), decay.reshape(B, T, g.n_v), valid,
                   cache.ssm[layer])  # [B, T, n_v, d_v]
    o = rms_norm(o, w["ssm_norm"], g.eps) * F.silu(z.reshape(B, T, g.n_v, g.d_v))  # [B, T, n_v, d_v]
    return linear(o.reshape(B * T, g.n_v * g.d_v), w["ssm_out"])  # [N, d]


# -- names (GGUF -> Hugging Face `Qwen3NextForCausalLM`) ----------------------------------------
# Plain renames. Tensors the converter transformed are listed in HF_TRANSFORMED: `NORM_PLUS_ONE`
# (HF weight = GGUF - 1), `attn_qkv` + `attn_gate` -> `in_proj_qkvz` (re-interleaved per key
# head), ssm_a -> A_log = log(-ssm_a), ssm_conv1d [C, K] -> conv1d.weight [C, 1, K].
TENSOR_NAMES: dict[str, str] = {
    **qwen3moe.COMMON_NAMES,
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ssm_ba.weight": "model.layers.{i}.linear_attn.in_proj_ba.weight",
    "blk.{i}.ssm_dt.bias": "model.layers.{i}.linear_attn.dt_bias",
    "blk.{i}.ssm_a": "model.layers.{i}.linear_attn.A_log",
    "blk.{i}.ssm_conv1d.weight": "model.layers.{i}.linear_attn.conv1d.weight",
    "blk.{i}.ssm_norm.weight": "model.layers.{i}.linear_attn.norm.weight",
    "blk.{i}.ssm_out.weight": "model.layers.{i}.linear_attn.out_proj.weight",
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.down_proj",
    "blk.{i}.ffn_gate_shexp.weight": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "blk.{i}.ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
}
HF_FUSED: dict[str, tuple[str, ...]] = {
    "model.layers.{i}.mlp.experts.gate_up_proj": ("blk.{i}.ffn_gate_exps.weight", "blk.{i}.ffn_up_exps.weight"),
    "model.layers.{i}.linear_attn.in_proj_qkvz": ("blk.{i}.attn_qkv.weight", "blk.{i}.attn_gate.weight"),
}
# GGUF norms the converter stored as HF weight + 1 (every RMSNorm but the DeltaNet's own)
NORM_PLUS_ONE: tuple[str, ...] = ("output_norm.weight", "attn_norm.weight", "post_attention_norm.weight",
                                  "attn_q_norm.weight", "attn_k_norm.weight")
