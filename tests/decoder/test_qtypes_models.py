"""Models whose experts are in the low-bit types, end to end: a `--mix` file (gate/up Q2_K,
down Q4_K, one layer Q8_0), a split file (gate/up IQ1_S, down Q2_K, as dynamic low-bit quants
ship, each expert's gate, up and down in different parts), one with Q1_0 experts and one with
NVFP4 experts. Each decodes with
its experts resident as the file's blocks (the CPU kernels) within 1e-4 of Hugging Face's model
run in float64 on the reference-dequantized weights (gguf-py; Q1_0: tests/qref.py), and streamed
through a real daemon's arena equals resident bit for bit."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from moestream.decoder.experts.bank import ExpertBank
from moestream.common.layout import ModelLayout
from moestream.decoder.experts.arena import open_arena
from moestream.decoder.experts.prefetch import Prefetcher
from moestream.decoder.experts.resident import QuantResidentExperts
from moestream.decoder.generation.loop import generate
from moestream.decoder.models import get_model_module
from moestream.decoder.models.weights import load_dense

from hf_reference import max_logit_diff

pytest.importorskip("transformers")
from test_models_hf import build_hf  # noqa: E402  (the qwen3moe HF model with the GGUF's weights)

TOL = 1e-4
BASE = dict(arch="qwen3moe", layers=3, experts=8, top_k=2)
MODELS = {  # name -> (make_model kwargs, expected expert types of layers 0..2 as (gate, up, down))
    "mix": (dict(quant="Q8_0", mix="gate_up=Q2_K,down=Q4_K,layers:1=Q8_0"),
            [(Q.Q2_K, Q.Q2_K, Q.Q4_K), (Q.Q8_0,) * 3, (Q.Q2_K, Q.Q2_K, Q.Q4_K)]),
    "split-IQ1_S-Q2_K": (dict(quant="Q8_0", mix="gate_up=IQ1_S,down=Q2_K", split_max_size=60_000),
                         [(Q.IQ1_S, Q.IQ1_S, Q.Q2_K)] * 3),
    "Q1_0": (dict(quant="Q8_0", expert_quant="Q1_0"), [(Q.Q1_0,) * 3] * 3),
    "NVFP4": (dict(quant="Q8_0", expert_quant="NVFP4"), [(Q.NVFP4,) * 3] * 3),
}
PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9]


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, make_tiny_model):
    kwargs, types = MODELS[request.param]
    path = make_tiny_model(**BASE, **kwargs)
    layout = ModelLayout(path)
    for layer, want in enumerate(types):  # each tensor in its own type
        got = tuple(layout.tensors[f"blk.{layer}.ffn_{p}_exps.weight"].qtype for p in ("gate", "up", "down"))
        assert got == want, f"layer {layer}: {got}"
    if "split_max_size" in kwargs:  # an expert's gate, up and down read from three parts
        assert len({p.file for p in layout.experts.parts(0, 0)}) == 3, layout.files
    return path


def hf_float64(path):
    hf = build_hf(path).double()
    hf.set_experts_implementation("eager")  # the grouped matmul has no float64 kernel
    return hf


def test_resident_matches_float64_reference(model):
    diff = max_logit_diff(model, hf_float64, prompt_len=12, decode_steps=4,
                          source=QuantResidentExperts)
    print(f"max abs logit diff {diff:.3g}")
    assert diff <= TOL, f"max abs logit diff vs float64 HF = {diff:.3g} > {TOL}"


def test_streamed_equals_resident(model, start_daemon):
    layout = ModelLayout(model)
    m = get_model_module(layout.hparams.arch).Model(layout.hparams, load_dense(layout, "cpu", progress=False))
    with QuantResidentExperts(layout) as resident:
        want = generate(m.with_bank(ExpertBank(resident)), [PROMPT, PROMPT[:4]], 4, keep_logits=True)
    daemon = start_daemon(model, arena_slots=6)  # a quarter of the 24 experts: evictions
    with open_arena(layout, daemon.endpoint) as src:
        got = generate(m.with_bank(ExpertBank(src)), [PROMPT, PROMPT[:4]], 4, keep_logits=True, observer=Prefetcher(m, src, 1))
        assert src.stats().counts.bytes_fetched > 0
    assert got.tokens == want.tokens
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
