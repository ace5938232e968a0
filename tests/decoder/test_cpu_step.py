"""The compiled steps of a CPU forward pass (kernels/cpu/attention.py, the routing in
kernels/cpu/moe.py) against torch's ops: RMSNorm, a decode step's attention (q/k norm, rope,
the cache write, GQA over a cache with pads), and the three routing functions."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from moestream.decoder.kernels.cpu import attention as att
from moestream.decoder.models import layers as L


def test_rms_norm_matches_torch() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 96, generator=g) * torch.rand(5, 3, 1, generator=g) * 10  # rows of different scales
    w = torch.randn(96, generator=g)
    got = L.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape
    torch.testing.assert_close(got, F.rms_norm(x, (96,), w, 1e-6), rtol=2e-6, atol=2e-6)


def _weights(a: L.AttnShape, g: torch.Generator) -> L.Weights:
    d, hd = 64, a.head_dim
    w: L.Weights = {f"attn_{p}": torch.randn(n * hd, d, generator=g) / 8
                    for p, n in (("q", a.n_head), ("k", a.n_head_kv), ("v", a.n_head_kv))}
    w["attn_output"] = torch.randn(d, a.n_head * hd, generator=g) / 8
    n_norm = {"head": (hd, hd), "full": (a.n_head * hd, a.n_head_kv * hd)}.get(a.qk_norm)
    if n_norm:
        w["attn_q_norm"], w["attn_k_norm"] = (1 + torch.rand(n, generator=g) for n in n_norm)
    return w


SHAPES = [L.AttnShape(4, 2, 16, 10000.0, 1e-6, "head", "neox"),
          L.AttnShape(4, 4, 16, 500.0, 1e-5, "none", "norm"),
          L.AttnShape(6, 2, 16, 10000.0, 1e-6, "full", "neox", rope_dim=8),
          L.AttnShape(4, 2, 40, 10000.0, 1e-6, "head", "neox")]  # (40: the score dots' tail past 16s)


@torch.inference_mode()
@pytest.mark.parametrize("a", SHAPES, ids=["gqa-head-neox", "mha-none-norm", "gqa-full-partial", "gqa-hd40"])
def test_decode_attention_matches_torch(a: L.AttnShape) -> None:
    """Token by token after a left-padded prompt, the compiled step and torch's ops from the same
    cache: same outputs (1e-5), same keys and values written."""
    g = torch.Generator().manual_seed(1)
    w, B, T0, steps = _weights(a, g), 3, 5, 4
    valid = torch.ones(B, T0, dtype=torch.bool)
    valid[1, :3] = False  # a left-padded prompt
    caches = [L.KVCache.empty(1, B, a.n_head_kv, a.head_dim, T0 + steps, torch.device("cpu"), torch.float32)
              for _ in range(2)]
    for t in range(T0 + steps):
        step_valid = valid[:, t:t + 1] if t < T0 else torch.tensor([[True], [True], [t % 2 == 0]])  # one finished
        x = torch.randn(B, 64, generator=g)  # [B, d] one token per sequence
        outs = []
        for cache, fast in zip(caches, (True, False)):
            positions, start = cache.advance(step_valid)
            st = L.step_attn(a, cache, positions, start)
            assert st.rope_rows is not None
            outs.append(L.attention(x, w, a, 0, cache, st if fast else replace(st, rope_rows=None)))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0].k[0], caches[1].k[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(caches[0].v[0], caches[1].v[0])


@pytest.mark.parametrize("hd", [16, 40])
def test_decode_attention_rows_and_threads_do_not_change_bits(hd: int) -> None:
    """A sequence's output alone or in a batch, on the serial or the parallel kernel: same bits."""
    rng = np.random.default_rng(2)
    H, Hkv, C, start = 4, 2, 12, 9
    qkv = rng.standard_normal((3, (H + 2 * Hkv) * hd)).astype(np.float32)  # [B, (H + 2 Hkv) hd]
    cos, sin = (rng.standard_normal((3, hd)).astype(np.float32) for _ in range(2))
    kc, vc = (rng.standard_normal((3, Hkv, C, hd)).astype(np.float32) for _ in range(2))
    valid = rng.random((3, C)) < 0.8
    qn = np.ones(hd, np.float32)

    def run(fn, rows):
        k, v = kc[rows].copy(), vc[rows].copy()
        out = np.empty((len(rows), H * hd), np.float32)
        fn(qkv[rows], H, Hkv, hd, qn, qn, att.QK_HEAD, 1e-6, cos[rows], sin[rows], att.ROPE_NEOX, k, v,
           valid[rows], start, out)
        return out

    batch = run(att._decode_attention, [0, 1, 2])
    assert np.array_equal(run(att._decode_attention_par, [0, 1, 2]), batch)
    for b in range(3):
        assert np.array_equal(run(att._decode_attention, [b])[0], batch[b])


def test_decode_attention_refuses_strided_keys() -> None:
    qkv = np.zeros((1, 4 * 16), np.float32)
    kc = np.zeros((1, 1, 8, 32), np.float32)[..., ::2]  # [B, Hkv, C, 16] every other float
    with pytest.raises(ValueError, match="rows must be contiguous"):
        att.decode_attention(qkv, 2, 1, 16, np.ones(16, np.float32), np.ones(16, np.float32), att.QK_NONE, 1e-6,
                             np.ones((1, 16), np.float32), np.zeros((1, 16), np.float32), att.ROPE_NEOX, kc,
                             np.zeros((1, 1, 8, 16), np.float32), np.ones((1, 8), bool), 0)


def _torch_route(logits: torch.Tensor, k: int, kind: str, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing functions' torch formulas, written out here as the reference."""
    if kind == "softmax":
        w, ids = torch.topk(torch.softmax(logits, -1), k, -1)
    else:
        top, ids = torch.topk(logits, k, -1)
        w = torch.softmax(top, -1) if kind == "topk_softmax" else torch.sigmoid(top)
    if norm and kind != "topk_softmax":
        w = w / w.sum(-1, keepdim=True)
    return w, ids


@pytest.mark.parametrize("kind", ["softmax", "topk_softmax", "topk_sigmoid"])
@pytest.mark.parametrize("norm", [False, True])
def test_routing_matches_torch(kind: str, norm: bool) -> None:
    logits = torch.randn(7, 64, generator=torch.Generator().manual_seed(3)) * 3  # [N, E]
    route = {"softmax": L.route_softmax, "topk_softmax": L.route_topk_softmax, "topk_sigmoid": L.route_topk_sigmoid}
    w, ids = route[kind](logits, 6, norm)
    w_ref, ids_ref = _torch_route(logits, 6, kind, norm)
    assert torch.equal(ids, ids_ref)  # (random logits: no ties) the same experts, largest first
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
