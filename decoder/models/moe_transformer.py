"""The one generic MoE transformer every architecture module builds on.

What differs between the families it covers is read from their `common.arch.ArchSpec` entry,
not coded per family: q/k norm ("none" | "head" | "full"), rope style ("neox" | "norm"),
routing function (`layers.ROUTING`), attention biases (come with the weights), and an
always-on shared expert. An architecture module is then its tensor-name tables plus, where
something is really new (another attention, dense leading layers), a subclass overriding
`attend`, `route` or `ffn`.

The interfaces callers use are typed here: `MoEModel` (what generation, prefetch and the
benchmarks need of a model) and `LayerObserver` (what a caller may see during a forward pass).

A model holds its `ExpertBank` (given at build time: `load_model(..., bank=)`, or `with_bank`
for the same weights over another bank); its MoE blocks call only `bank.mix`. Whoever runs the
pass (the generation loop, the serve engine) calls `bank.begin_step()` before it.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch

from ...common.arch import ArchSpec, get_arch
from ...common.layout import HParams
from ..experts.bank import ExpertBank
from .layers import (ROUTING, AttnShape, KVCache, StepAttn, Weights, attention, embed, linear, rms_norm,
                     shared_expert, step_attn)


class LayerObserver:
    """Sees a forward pass as it runs; every method is optional (a no-op here).

    Subclass and override what you need: the prefetcher predicts from `after_attention` or
    `after_layer`, the trace recorder keeps `routed`. `h` holds the real tokens' rows only.
    """

    def after_attention(self, layer: int, h: torch.Tensor) -> None:
        """After `layer`'s attention, before its FFN: residual rows h [n, d]."""

    def routed(self, layer: int, ids: torch.Tensor) -> None:
        """`layer`'s router picked experts ids [n, k] for the real tokens."""

    def after_layer(self, layer: int, h: torch.Tensor) -> None:
        """After `layer`: hidden rows h [n, d]."""


class OnLayer(LayerObserver):
    """A plain `fn(layer, h)` called after each layer, as an observer."""

    def __init__(self, fn):
        self.fn = fn

    def after_layer(self, layer: int, h: torch.Tensor) -> None:
        self.fn(layer, h)


class MoEModel(Protocol):
    """What generation, prefetching and the benchmarks use of a model."""

    hparams: HParams
    device: torch.device
    dtype: torch.dtype
    bank: ExpertBank | None

    def new_cache(self, batch: int, capacity: int) -> KVCache: ...

    def router_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor: ...

    def forward(self, tokens: torch.Tensor, cache: KVCache, valid: torch.Tensor | None = None,
                observer: LayerObserver | None = None, last_only: bool = False) -> torch.Tensor: ...

    def with_bank(self, bank: ExpertBank) -> "MoEModel": ...


_NO_OBSERVER = LayerObserver()


def layer_weights(dense: dict[str, torch.Tensor], layer: int) -> Weights:
    """One layer's dense tensors keyed by short name: `attn_q`, `attn_q.bias`, ..."""
    prefix = f"blk.{layer}."
    out: Weights = {}
    for name, t in dense.items():
        if name.startswith(prefix):
            out[name[len(prefix):].removesuffix(".weight")] = t
    return out


class MoETransformer:
    """Forward pass over dense weights (materialized at start) and the model's `ExpertBank`."""

    def __init__(self, hparams: HParams, dense: dict[str, torch.Tensor]):
        self.bank: ExpertBank | None = None  # given once, at build time (`load_model`, `with_bank`)
        self.hparams = hp = hparams
        self.spec: ArchSpec = get_arch(hp.arch)
        self.embed = dense["token_embd.weight"]  # [V, d]
        self.norm = dense["output_norm.weight"]  # [d]
        self.lm_head = dense.get("output.weight", self.embed)  # [V, d]; tied when absent
        self.layers = [layer_weights(dense, i) for i in range(hp.n_layer)]
        self.attn = AttnShape(hp.n_head, hp.n_head_kv, hp.head_dim, hp.rope_base, hp.rms_eps,
                              self.spec.qk_norm, self.spec.rope)
        self._route = ROUTING[self.spec.routing]
        self.device, self.dtype = self.norm.device, self.norm.dtype
        self.kv_dtype = self.dtype  # the KV cache's (`load_model(kv_dtype=)`: float16 halves it)

    def with_bank(self, bank: ExpertBank) -> "MoETransformer":
        """This model's weights (shared, not copied) over `bank`: the bank a model object has is
        fixed, so two banks over one set of weights are two model objects."""
        other = copy.copy(self)
        other.bank = bank
        return other

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """Attention state for `batch` sequences of up to `capacity` tokens (a family with other
        state — a latent KV, a recurrent state — returns its own cache type)."""
        hp = self.hparams
        return KVCache.empty(hp.n_layer, batch, hp.n_head_kv, hp.head_dim, capacity, self.device, self.kv_dtype)

    def prepare(self, cache: KVCache, valid: torch.Tensor) -> StepAttn:
        """Reserve this step's tokens (valid [B, T]) in `cache`; what every layer's `attend` shares
        in this step (positions, rope tables, mask), computed once."""
        positions, start = cache.advance(valid)  # [B, T]
        return step_attn(self.attn, cache, positions, start)

    # -- the parts a family may override --------------------------------------------------
    def attend(self, layer: int, x: torch.Tensor, cache: KVCache, st: StepAttn) -> torch.Tensor:
        """Self-attention of normed rows x [N, d] -> [N, d]."""
        return attention(x, self.layers[layer], self.attn, layer, cache, st)

    def route(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router weights [n, k] and expert ids [n, k] for normed rows x [n, d]."""
        hp = self.hparams
        return self._route(linear(x, self.layers[layer]["ffn_gate_inp"]), hp.n_expert_used, hp.norm_topk_prob)

    def ffn(self, layer: int, x: torch.Tensor, observer: LayerObserver) -> torch.Tensor:
        """The feed-forward half of a layer on normed rows x [n, d]: routed experts (+ shared) -> [n, d]."""
        if x.shape[0] == 0:
            return torch.zeros_like(x)  # no real token in this step: nothing to fetch
        weights, ids = self.route(layer, x)  # [n, k], [n, k]
        observer.routed(layer, ids)
        out = self.experts().mix(layer, x, weights, ids)  # [n, d]
        if self.spec.shared_expert:
            out = out + shared_expert(x, self.layers[layer])  # [n, d]
        return out

    def experts(self) -> ExpertBank:
        """The bank the MoE blocks compute with (a model built without one cannot run them)."""
        if self.bank is None:
            raise ValueError("this model has no expert bank: build it with load_model(..., bank=ExpertBank(...)) "
                             "or use model.with_bank(bank)")
        return self.bank

    # -- the pass -------------------------------------------------------------------------
    def router_logits(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """That layer's ffn_norm then router applied to hidden rows h [N, d] -> [N, n_expert]."""
        w = self.layers[layer]
        return linear(rms_norm(h, w["ffn_norm"], self.hparams.rms_eps), w["ffn_gate_inp"])

    def block(self, layer: int, h: torch.Tensor, active: torch.Tensor | None, cache: KVCache, st: StepAttn,
              observer: LayerObserver) -> torch.Tensor:
        """One layer on rows h [N, d]; only the `active` rows [n] go through the FFN (None: all)."""
        w, eps = self.layers[layer], self.hparams.rms_eps
        h = h + self.attend(layer, rms_norm(h, w["attn_norm"], eps), cache, st)  # [N, d]
        real = h if active is None else h[active]  # [n, d] real tokens only: pads fetch no experts
        observer.after_attention(layer, real)
        y = self.ffn(layer, rms_norm(real, w["ffn_norm"], eps), observer)  # [n, d]
        return h + y if active is None else h.index_put((active,), y, accumulate=True)  # [N, d]

    def forward(self, tokens: torch.Tensor, cache: KVCache, valid: torch.Tensor | None = None,
                observer: LayerObserver | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits [B, T, V] (or [B, V] with `last_only`) for tokens [B, T] appended to `cache`.

        `valid` [B, T] marks real tokens (False = left padding / finished sequence); their
        rows are computed through attention but skip the FFN and never move positions. The
        caller has begun the bank's step (`bank.begin_step()`).
        """
        obs = observer or _NO_OBSERVER
        B, T = tokens.shape
        # every token real (valid None): no row selection, so no host sync for it (a decode step)
        active = None if valid is None else valid.reshape(-1).nonzero().squeeze(1)  # [n] real rows
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.to(torch.bool)
        st = self.prepare(cache, valid)
        h = embed(tokens.reshape(-1), self.embed, self.dtype)  # [N, d]
        for i in range(self.hparams.n_layer):
            h = self.block(i, h, active, cache, st, obs)
            obs.after_layer(i, h if active is None else h[active])
        h = h.reshape(B, T, -1)[:, -1] if last_only else h.reshape(B, T, -1)  # [B, d] | [B, T, d]
        return linear(rms_norm(h, self.norm, self.hparams.rms_eps), self.lm_head)  # [B, (T,) V]

    __call__ = forward

    def forward_many(self, steps: list[tuple[torch.Tensor, KVCache]],
                     observer: LayerObserver | None = None) -> torch.Tensor:
        """Last-token logits [S, V] of S sequences, each with its own cache: steps[i] = (tokens
        [1, T_i], cache_i), every token real (a prefill chunk or one decode token).

        Continuous batching's pass (decoder/serve): attention runs per sequence on its own cache
        (lengths differ, nothing is padded), the FFN once on all sequences' rows, so a layer
        fetches the union of their experts once. A family's `prepare`/`attend`/`ffn` are used
        as they are; per row the arithmetic is `forward`'s up to float rounding (a many-row matmul
        sums in another order than a one-row one).
        """
        obs, eps = observer or _NO_OBSERVER, self.hparams.rms_eps
        sts = [self.prepare(cache, torch.ones_like(tok, dtype=torch.bool)) for tok, cache in steps]
        sizes = [tok.shape[1] for tok, _ in steps]
        hs = [embed(tok.reshape(-1), self.embed, self.dtype) for tok, _ in steps]  # S x [T_i, d]
        for i in range(self.hparams.n_layer):
            w = self.layers[i]
            hs = [h + self.attend(i, rms_norm(h, w["attn_norm"], eps), cache, st)  # [T_i, d]
                  for h, (_, cache), st in zip(hs, steps, sts)]
            h = torch.cat(hs)  # [N, d] every sequence's rows
            obs.after_attention(i, h)
            h = h + self.ffn(i, rms_norm(h, w["ffn_norm"], eps), obs)  # [N, d]
            obs.after_layer(i, h)
            hs = list(h.split(sizes))
        last = torch.stack([h[-1] for h in hs])  # [S, d]
        return linear(rms_norm(last, self.norm, eps), self.lm_head)  # [S, V]
