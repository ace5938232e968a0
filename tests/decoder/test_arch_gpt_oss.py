"""gpt-oss: MXFP4 experts with biases and the clamped SwiGLU, attention sinks, alternating
sliding-window layers, YaRN rope, the biased top-k-then-softmax router.

References: gguf-py's numpy MXFP4 dequantizer and float64 math for the kernels; Hugging Face's
`GptOssForCausalLM` (eager attention) with the same weights for the model; the file's own
resident experts for streaming (a real daemon process, a quarter of the experts cached).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from moestream.decoder.experts.bank import ExpertBank
from moestream.common.arch import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from moestream.common.layout import ModelLayout
from moestream.decoder.kernels.cpu import ffn as qk
from moestream.decoder.experts.arena import open_arena
from moestream.decoder.experts.source import ResidentExperts
from moestream.decoder.generation.loop import generate, forward_step
from moestream.decoder.models import get_model_module, load_model
from moestream.decoder.experts.prefetch import Prefetcher
from moestream.decoder.experts.resident import QuantResidentExperts
from hf_reference import gguf_tensors

transformers = pytest.importorskip("transformers")

MODEL = {"arch": "gpt-oss", "quant": "F32", "layers": 3, "experts": 8, "top_k": 2}  # MXFP4 experts (the default)
PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9, 77, 31, 2, 501]  # 16 > the tiny window of 8
TOL = 1e-4


# -- the MXFP4 kernel, biases, the clamped SwiGLU -----------------------------------------------
def mxfp4_bytes(rows: int, cols: int, rng: np.random.Generator, extremes: bool = False) -> np.ndarray:
    """MXFP4 blocks of random values (gguf-py's quantizer); with `extremes` some exponents are set
    to the edges of E8M0 (subnormal and huge scales)."""
    raw = gguf_quantize(rng.standard_normal((rows, cols)).astype(np.float32), Q.MXFP4)  # [rows, cols/32*17]
    if extremes:
        raw.reshape(-1, 17)[:4, 0] = [0, 1, 2, 200]
    return np.ascontiguousarray(raw).reshape(-1)


def ref_matrix(data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return gguf_dequantize(data.reshape(rows, -1), Q.MXFP4).astype(np.float64).reshape(rows, cols)


def test_mxfp4_rows_decode_as_gguf_py():
    rng = np.random.default_rng(0)
    data = mxfp4_bytes(7, 96, rng, extremes=True)
    got = qk.dequantize(qk.QMatrix(data, int(Q.MXFP4), 7, 96))
    want = gguf_dequantize(data.reshape(7, -1), Q.MXFP4)
    assert np.array_equal(got, want)


def oai_expert_ref(x, g, u, d, bg, bu, bd):
    """float64: down(g' * sigmoid(alpha g') * (u' + 1)) + bd, g' = min(g x + bg, limit), u' clamped."""
    gate = np.minimum(x @ g.T + bg, SWIGLU_OAI_LIMIT)
    up = np.clip(x @ u.T + bu, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (gate / (1 + np.exp(-SWIGLU_OAI_ALPHA * gate)) * (up + 1)) @ d.T + bd, gate


@pytest.mark.parametrize("n", [1, 5, 30])  # fused kernel (< DENSE_MIN_ROWS rows) and the dense path
def test_mxfp4_expert_with_biases_and_clamped_swiglu(n):
    rng = np.random.default_rng(n)
    dm, ff = 64, 96
    g, u, d = mxfp4_bytes(ff, dm, rng), mxfp4_bytes(ff, dm, rng), mxfp4_bytes(dm, ff, rng)
    mats = (qk.QMatrix(g, int(Q.MXFP4), ff, dm), qk.QMatrix(u, int(Q.MXFP4), ff, dm),
            qk.QMatrix(d, int(Q.MXFP4), dm, ff))
    bias = tuple(rng.standard_normal(k).astype(np.float32) for k in (ff, ff, dm))
    x = rng.standard_normal((n, dm)).astype(np.float32)  # big enough that the clamps bite
    got = qk.swiglu_expert(x, *mats, bias=bias, act="swiglu_oai_clamped")
    want, gate = oai_expert_ref(x.astype(np.float64), ref_matrix(g, ff, dm), ref_matrix(u, ff, dm),
                                ref_matrix(d, dm, ff), *bias)
    assert (gate >= SWIGLU_OAI_LIMIT).mean() > 0.05  # the clamp is exercised
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    plain = qk.swiglu_expert(x, *mats)  # the same weights with plain SwiGLU, no biases: another result
    assert np.abs(plain - want).max() > 1e-2 * np.abs(want).max()


def test_experts_of_one_call_equal_each_alone():
    """A table of biased experts: each expert's rows are bit-identical to that expert computed alone."""
    rng = np.random.default_rng(3)
    dm, ff, E = 64, 64, 3
    data = np.concatenate([mxfp4_bytes(r, c, rng) for _ in range(E) for r, c in ((ff, dm), (ff, dm), (dm, ff))])
    size = [ff * dm // 32 * 17] * 3
    experts, off = [], 0
    for _ in range(E):
        ms = []
        for (r, c), nb in zip(((ff, dm), (ff, dm), (dm, ff)), size):
            ms.append(qk.QMatrix(data[off:off + nb], int(Q.MXFP4), r, c))
            off += nb
        experts.append((*ms, tuple(rng.standard_normal(k).astype(np.float32) for k in (ff, ff, dm))))
    x = rng.standard_normal((6, dm)).astype(np.float32)
    rows = [np.array([0, 2, 5]), np.array([1]), np.array([0, 1, 2, 3, 4])]
    ys = qk.swiglu_experts(x, qk.expert_table(data, experts), rows, act="swiglu_oai_clamped")
    for y, r, e in zip(ys, rows, experts):
        assert np.array_equal(y, qk.swiglu_expert(x[r], *e[:3], bias=e[3], act="swiglu_oai_clamped"))
    with pytest.raises(ValueError, match="all have biases or all have none"):
        qk.expert_table(data, [experts[0], experts[1][:3]])
    with pytest.raises(ValueError, match="unknown expert activation"):
        qk.swiglu_experts(x, qk.expert_table(data, experts), rows, act="gelu")


# -- the model against Hugging Face ---------------------------------------------------------------
def build_hf(path):
    hp = ModelLayout(path).hparams
    x, mod, tensors = hp.extra, get_model_module(hp.arch), gguf_tensors(path)
    cfg = transformers.GptOssConfig(
        vocab_size=hp.n_vocab, hidden_size=hp.n_embd, num_hidden_layers=hp.n_layer, num_attention_heads=hp.n_head,
        num_key_value_heads=hp.n_head_kv, head_dim=hp.head_dim, num_local_experts=hp.n_expert,
        num_experts_per_tok=hp.n_expert_used, intermediate_size=hp.n_ff_exp, rms_norm_eps=hp.rms_eps,
        sliding_window=x["attention.sliding_window"], max_position_embeddings=hp.context_length,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": hp.rope_base, "factor": x["rope.scaling.factor"],
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": x["rope.scaling.original_context_length"]})
    model = transformers.GptOssForCausalLM(cfg).eval()
    model.config._attn_implementation = "eager"
    sd = {}
    for i in range(hp.n_layer):
        sd.update({h.format(i=i): tensors[g.format(i=i)] for g, h in mod.TENSOR_NAMES.items()})
        sd.update(mod.hf_experts(tensors, i))
    ref = model.state_dict()
    assert all(ref[k].shape == v.shape for k, v in sd.items())
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)  # every weight was copied
    return model


def hf_greedy(hf, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """HF's greedy run: the whole sequence [1, T + steps] and its logits after the prompt and
    after each new token (each on the whole sequence so far, no cache)."""
    seq, refs = torch.tensor([prompt]), []
    with torch.inference_mode():
        for step in range(steps + 1):
            refs.append(hf(input_ids=seq).logits)  # [1, T + step, V]
            if step < steps:
                seq = torch.cat([seq, refs[-1][:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq, refs


# MXFP4 experts (as the real files); F32 experts with head_dim != hidden / heads (as the real
# files: 64 vs 2880 / 64) and 4 query heads per kv head
@pytest.mark.parametrize("variant", [{}, {"expert_quant": "F32", "heads": 8, "kv_heads": 2, "head_dim": 32}])
def test_logits_match_hf(make_tiny_model, variant):
    """Prompt logits, then 8 greedy steps through our KV cache (past the sliding window), for the
    float expert path and the CPU quant kernels, against HF on the whole sequence."""
    path = make_tiny_model(**MODEL, **variant)
    layout, steps = ModelLayout(path), 8
    seq, refs = hf_greedy(build_hf(path), PROMPT, steps)
    ours, T = load_model(layout), len(PROMPT)
    for experts in (ResidentExperts(layout), QuantResidentExperts(layout)):
        cache, worst = ours.new_cache(1, T + steps), 0.0
        with torch.inference_mode():
            got = [forward_step(ours.with_bank(ExpertBank(experts)), seq[:, :T], cache)]  # [1, T, V]
            got += [forward_step(ours.with_bank(ExpertBank(experts)), seq[:, T + i:T + i + 1], cache) for i in range(steps)]  # [1, 1, V] each
        for mine, ref in zip(got, refs):
            worst = max(worst, (mine - ref[:, -mine.shape[1]:]).abs().max().item())
        assert worst <= TOL, f"{type(experts).__name__}: max abs logit diff vs HF {worst}"


def test_left_padding_changes_nothing(make_tiny_model):
    """A short prompt left-padded next to a long one: its logits equal those of it alone (the
    sliding window counts the sequence's own positions, pads never attend or move them)."""
    layout = ModelLayout(make_tiny_model(**MODEL))
    model, experts = load_model(layout), QuantResidentExperts(layout)
    short = PROMPT[3:9]
    alone = generate(model.with_bank(ExpertBank(experts)), [short], 6, keep_logits=True)
    batched = generate(model.with_bank(ExpertBank(experts)), [PROMPT, short], 6, keep_logits=True)
    assert batched.tokens[1] == alone.tokens[0]
    for a, b in zip(alone.logits, batched.logits):
        assert (a[0] - b[1]).abs().max().item() <= 1e-5


def test_unsupported_rope_scaling_is_a_clear_error(make_tiny_model):
    import dataclasses

    from moestream.decoder.models.arch.gpt_oss import Yarn

    hp = ModelLayout(make_tiny_model(**MODEL)).hparams
    assert Yarn.from_hparams(hp) == Yarn(32.0, 4096, 32.0, 1.0)
    bad = dataclasses.replace(hp, extra={**hp.extra, "rope.scaling.type": "longrope"})
    with pytest.raises(ValueError, match="rope scaling 'longrope' is not supported"):
        Yarn.from_hparams(bad)


def _logits(model, backend, one_sequence: bool) -> torch.Tensor:
    """Logits [T, V] of PROMPT as one pass (the kernels' prefill path) or token by token (decode)."""
    model, cache = model.with_bank(ExpertBank(backend)), model.new_cache(1, len(PROMPT))
    if one_sequence:
        return forward_step(model, torch.tensor([PROMPT]), cache)[0]
    return torch.cat([forward_step(model, torch.tensor([[t]]), cache)[0] for t in PROMPT])


@pytest.mark.skipif(not __import__("moestream.decoder.kernels.gpu.quant", fromlist=["x"]).interpreted()
                    and not torch.cuda.is_available(), reason="the Triton kernels need CUDA or TRITON_INTERPRET=1")
@torch.inference_mode()
def test_triton_kernels_with_biases_and_the_clamped_swiglu(make_tiny_model, start_daemon):
    """MXFP4 experts with biases on the fused Triton kernels (raw slots resident, and the device
    slot cache streamed from a daemon): the CPU kernels' logits (checked against HF above) within
    float32 noise, and streamed == resident bit for bit."""
    from moestream.decoder.experts.gpu.streamed import open_streamed

    path = make_tiny_model(**MODEL)
    layout = ModelLayout(path)
    model = load_model(layout)
    fused = ResidentExperts(layout, "cpu", torch.float32, "raw", kernels=True)
    assert fused.stats().kernels == "triton" and all(fused.kernels.supports(i) for i in range(3))
    daemon = start_daemon(path, arena_slots=8)
    for one_sequence in (False, True):
        want = _logits(model, QuantResidentExperts(layout), one_sequence)
        got = _logits(model, fused, one_sequence)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        with open_streamed(layout, daemon.endpoint, slots=6, kernels=True) as src:
            assert torch.equal(_logits(model, src, one_sequence), got)


# -- streaming ----------------------------------------------------------------------------------
def test_streamed_equals_resident_bit_for_bit(make_tiny_model, start_daemon):
    """A quarter of the 24 experts cached in a real daemon's arena (fetched on demand and one
    layer ahead); blobs hold weights + biases."""
    path = make_tiny_model(**MODEL)
    layout = ModelLayout(path)
    assert {n for n, _ in layout.experts.tensors[0]} == {"gate", "up", "down", "gate.bias", "up.bias", "down.bias"}
    model = load_model(layout, keep_quantized=True)
    prompts = [PROMPT, PROMPT[:5]]
    with QuantResidentExperts(layout) as resident:
        want = generate(model.with_bank(ExpertBank(resident)), prompts, 6, keep_logits=True)
    daemon = start_daemon(path, arena_slots=6)
    with open_arena(layout, daemon.endpoint) as src:
        hook = Prefetcher(model, src, 1)
        got = generate(model.with_bank(ExpertBank(src)), prompts, 6, keep_logits=True, observer=hook)
        st = src.stats()
    assert got.tokens == want.tokens and all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    assert st.counts.demand + st.counts.direct > 0 and st.counts.bytes_fetched > 0


def test_cli_generate_resident_and_iod_same_text(make_tiny_model, capsys):
    from moestream.tools.spawn import spawn_daemon
    from moestream.decoder import cli

    path = make_tiny_model(**MODEL)
    args = ["--model", str(path), "--prompt", "def f(x):", "-n", "8", "--no-progress"]
    assert cli.main([*args, "--resident"]) == 0
    resident = capsys.readouterr().out
    with spawn_daemon(path, arena_slots=6) as daemon:  # a quarter of the experts
        assert cli.main([*args, "--iod", daemon.endpoint]) == 0
        streamed = capsys.readouterr().out
    assert streamed == resident and len(resident) > 0
