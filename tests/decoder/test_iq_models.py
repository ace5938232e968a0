"""A dynamic-quant style model end to end: IQ1_S gate/up experts with Q4_K down experts (made by
make-model), its resident logits against Hugging Face's model in float64 on the weights gguf-py
dequantizes, and streamed through a real moestream-iod bit-identical to resident decoding."""

from __future__ import annotations

import pytest
import torch
from hf_reference import max_logit_diff
from moestream.common.layout import ModelLayout

pytest.importorskip("transformers")
from test_models_hf import build_hf  # noqa: E402
from test_streamed import Bench, run_streamed  # noqa: E402

MODEL = dict(arch="qwen3moe", quant="F32", expert_quant="IQ1_S", mix="down=Q4_K", layers=2,
             experts=8, top_k=2)
TOL = 1e-4


@pytest.fixture(scope="module")
def bench(make_tiny_model):
    b = Bench(make_tiny_model(**MODEL))
    yield b
    b.stop()


def test_file_mixes_types_per_part(bench) -> None:
    types = {t.name: t.qtype.name for t in ModelLayout(bench.path).tensors.values() if "_exps." in t.name}
    assert len(types) == 6 and all(q == ("Q4_K" if "down" in n else "IQ1_S") for n, q in types.items()), types


def _hf_float64(path):
    model = build_hf(path).double()
    model.config._experts_implementation = "eager"  # the grouped-GEMM path takes no float64
    return model


def test_resident_logits_match_float64_reference(bench) -> None:
    diff = max_logit_diff(bench.path, _hf_float64, prompt_len=16, decode_steps=8, check_greedy=True)
    assert diff <= TOL, f"max abs logit diff vs float64 HF {diff:.3g} > {TOL}"


def test_streamed_is_bit_identical_to_resident(bench) -> None:
    result, st = run_streamed(bench, bench.n_experts // 4, depth=1)
    assert result.tokens == bench.reference.tokens
    assert all(torch.equal(g, w) for g, w in zip(result.logits, bench.reference.logits))
    assert st["misses"] > bench.n_experts // 4 and st["cache"]["evictions"] > 0 and st["bytes_fetched"] > 0
