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
@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("a", SHAPES, ids=["gqa-head-neox", "mha-none-norm", "gqa-full-partial", "gqa-hd40"])
def test_decode_attention_matches_torch(a: L.AttnShape, kv: torch.dtype) -> None:
    """Token by token after a left-padded prompt, the compiled step and torch's ops from the same
    cache (float32, or float16: a key may round to the next float16 from one path's float32
    rounding): same outputs (1e-5; 2e-3 with float16), same keys and values written."""
    g = torch.Generator().manual_seed(1)
    w, B, T0, steps = _weights(a, g), 3, 5, 4
    tol = 1e-5 if kv == torch.float32 else 2e-3
    valid = torch.ones(B, T0, dtype=torch.bool)
    valid[1, :3] = False  # a left-padded prompt
    caches = [L.KVCache.empty(1, B, a.n_head_kv, a.head_dim, T0 + steps, torch.device("cpu"), kv)
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
        torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
    torch.testing.assert_close(caches[0].k[0], caches[1].k[0], rtol=tol / 10, atol=tol / 10)
    assert caches[0].k[0].dtype == kv and torch.equal(caches[0].v[0], caches[1].v[0])


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


LONG = 2 * att.CHUNK + 37  # a cache index past two whole chunks, the last one part full


def _attend(H: int, Hkv: int, hd: int, start: int, rows: list[int], fn=None, same_q: bool = False,
            kv: type = np.float32) -> tuple:
    """Random q/k/v rows and caches of 3 sequences (the second's first chunk and a bit all pads,
    the others with scattered pads), no q/k norm and no rotation; the kernel's output for `rows`,
    and the caches (as float32) and mask it saw. kv=np.float16: the caches in float16, passed as
    their int16 bits."""
    rng = np.random.default_rng(3)
    C = start + 1
    qkv = rng.standard_normal((3, (H + 2 * Hkv) * hd)).astype(np.float32)  # [B, (H + 2 Hkv) hd]
    if same_q:  # every query head asks the same: each head's output must come out the same
        qkv[:, :H * hd] = np.tile(qkv[:, :hd], H)
    kc, vc = (rng.standard_normal((3, Hkv, C, hd)).astype(np.float32) for _ in range(2))
    valid = rng.random((3, C)) < 0.8
    valid[1, :att.CHUNK + 5] = False
    cos, sin = np.ones((3, hd), np.float32), np.zeros((3, hd), np.float32)
    k, v = kc[rows].astype(kv), vc[rows].astype(kv)
    bits = (k.view(np.int16), v.view(np.int16)) if kv == np.float16 else (k, v)
    out = np.empty((len(rows), H * hd), np.float32)
    (fn or att._decode_attention)(qkv[rows], H, Hkv, hd, np.ones(1, np.float32), np.ones(1, np.float32),
                                  att.QK_NONE, 1e-6, cos[rows], sin[rows], att.ROPE_NEOX, *bits, valid[rows], start,
                                  out)
    return out, qkv[rows], k.astype(np.float32), v.astype(np.float32), valid[rows]


@pytest.mark.parametrize("kv", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("H,Hkv,hd", [(8, 2, 64), (6, 2, 40), (4, 4, 16), (10, 2, 32)],
                         ids=["rep4-hd64", "rep3-hd40", "mha-hd16", "rep5-hd32"])
def test_decode_attention_over_chunks_matches_float64(H: int, Hkv: int, hd: int, kv: type) -> None:
    """A context of several key chunks (one all pads): each head's softmax over every real key,
    joined from the chunks, against float64 numpy on the same caches (float32 or float16); this
    token's k and v written, rounded to the cache's type as numpy rounds."""
    out, qkv, k, v, valid = _attend(H, Hkv, hd, LONG, [0, 1, 2], kv=kv)
    rep, nq, nk = H // Hkv, H * hd, Hkv * hd
    for b in range(3):
        np.testing.assert_array_equal(k[b, :, LONG], qkv[b, nq:nq + nk].reshape(Hkv, hd).astype(kv))
        np.testing.assert_array_equal(v[b, :, LONG], qkv[b, nq + nk:].reshape(Hkv, hd).astype(kv))
        seen = valid[b].copy()
        seen[LONG] = True
        for h in range(H):
            q = qkv[b, h * hd:(h + 1) * hd].astype(np.float64)
            keys, vals = k[b, h // rep][seen].astype(np.float64), v[b, h // rep][seen].astype(np.float64)
            s = keys @ q / np.sqrt(hd)
            p = np.exp(s - s.max())
            want = p @ vals / p.sum()
            np.testing.assert_allclose(out[b, h * hd:(h + 1) * hd], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("H,Hkv,hd", [(8, 2, 64), (6, 1, 40)], ids=["rep4", "rep6-hd40"])  # rep6: 4 + 2
def test_decode_attention_over_chunks_same_bits_every_way(H: int, Hkv: int, hd: int, kv: type) -> None:
    """Over several chunks: serial or parallel, alone or in a batch, a head in a block of four or
    alone (every head asking the same q): the same bits."""
    batch = _attend(H, Hkv, hd, LONG, [0, 1, 2], same_q=True, kv=kv)[0]
    assert np.array_equal(_attend(H, Hkv, hd, LONG, [0, 1, 2], att._decode_attention_par, same_q=True, kv=kv)[0],
                          batch)
    for b in range(3):
        assert np.array_equal(_attend(H, Hkv, hd, LONG, [b], same_q=True, kv=kv)[0][0], batch[b])
    heads, rep = batch.reshape(3, H, hd), H // Hkv
    for h in range(H):  # the heads of one kv head see the same keys
        assert np.array_equal(heads[:, h], heads[:, h - h % rep])


def test_four_sums_at_once_are_hsums() -> None:
    """`st_hsum4` (four lane sums in shared shuffles) equals `hsum` on each vector, bit for bit."""
    from numba import njit
    from moestream.decoder.kernels.cpu.simd import vectors as vec

    @njit
    def both(x):  # x [4, 16] float32 -> [2, 4]: st_hsum4's, hsum's
        out = np.empty((2, 4), np.float32)
        xa, oa = vec.addr(x), vec.addr(out)
        a0, a1, a2, a3 = vec.ld_f32(xa, 0), vec.ld_f32(xa, 16), vec.ld_f32(xa, 32), vec.ld_f32(xa, 48)
        vec.st_hsum4(oa, 0, a0, a1, a2, a3)
        out[1, 0], out[1, 1], out[1, 2], out[1, 3] = vec.hsum(a0), vec.hsum(a1), vec.hsum(a2), vec.hsum(a3)
        return out

    rng = np.random.default_rng(4)
    for _ in range(20):
        x = (rng.standard_normal((4, 16)) * 10.0 ** rng.integers(-3, 4, (4, 16))).astype(np.float32)
        got = both(x)
        assert np.array_equal(got[0], got[1])
        np.testing.assert_allclose(got[0], x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-3)


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
