"""Files quantized by llama.cpp's own quantizer (`llama_model_quantize`, llama-cpp-python 0.3.36:
`pip install 'moestream[bench]'`), every low-bit type moestream takes: our kernels on its blocks.

An F32 qwen3moe from `make-model` is quantized by llama.cpp to each file type (the IQ1/IQ2 types
with an importance matrix of ones, which they require), as a user's download would be: llama.cpp
picks the types per tensor itself (a Q2_K file keeps some tensors at Q4_K, an IQ1_S file some at
IQ2/Q4), so every file is a mix. For each: every tensor's bytes decode bit for bit as gguf-py's
numpy code (Q1_0: tests/qref.py) with our torch dequantizer, our resident decoder (the numba
kernels on the file's blocks) is within 1e-4 of Hugging Face's model in float64 on the
dequantized weights, and llama.cpp's own logits on the same file agree with ours as closely as
its int8 activation quantization allows. Skipped where llama-cpp-python is not installed (CI)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from moestream.decoder.experts.bank import ExpertBank
from moestream.decoder.generation.loop import forward_step
from moestream.common.layout import ModelLayout
from moestream.decoder.experts.resident import QuantResidentExperts
from moestream.decoder.kernels.dequant.blocks import dequantize
from qref import dequantize as ref_dequantize

from hf_reference import max_logit_diff

L = pytest.importorskip("llama_cpp")
pytest.importorskip("transformers")
from test_models_hf import build_hf  # noqa: E402

# NVFP4 is not among this llama.cpp quantizer's output types ("invalid output file type 39")
FTYPES = ["Q1_0", "TQ1_0", "TQ2_0", "Q2_K", "Q3_K_M", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
          "IQ3_S", "IQ4_NL", "IQ4_XS", "Q4_1", "Q5_0", "Q5_1"]
NEED_IMATRIX = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS"}
MODEL = dict(arch="qwen3moe", quant="F32", layers=2, experts=8, top_k=2, hidden=256, expert_ff=256, vocab=512)
TOL = 1e-4


def _imatrix(path) -> tuple[ctypes.Array, list]:
    """Importance 1 for every input column of every matrix (null-terminated, as llama.h wants)."""
    keep, entries = [], []
    for t in GGUFReader(path).tensors:
        if len(t.shape) < 2:
            continue
        n = int(t.shape[0]) * (int(t.shape[2]) if len(t.shape) > 2 else 1)  # ne0 per expert
        data = np.ones(n, np.float32)
        keep.append(data)
        entries.append((t.name.encode(), data.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n))
    arr = (L.llama_model_imatrix_data * (len(entries) + 1))()
    for i, (name, ptr, n) in enumerate(entries):
        arr[i].name, arr[i].data, arr[i].size = name, ptr, n
    return arr, keep


@pytest.fixture(scope="module", params=FTYPES)
def quantized(request, make_tiny_model, tmp_path_factory):
    src = make_tiny_model(**MODEL)
    out = tmp_path_factory.mktemp("lcq") / f"m-{request.param}.gguf"
    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{request.param}")
    params.nthread = 2
    if request.param in NEED_IMATRIX:
        arr, keep = _imatrix(src)
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(L.llama_model_imatrix_data))
    rc = L.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize({request.param}) returned {rc}"
    return out


def test_every_tensor_dequantizes_as_gguf_py(quantized):
    types = set()
    for t in GGUFReader(quantized).tensors:
        raw = np.asarray(t.data).reshape(-1)
        want = ref_dequantize(raw.reshape(1, -1) if t.tensor_type not in (Q.F32, Q.F16) else raw,
                              t.tensor_type).reshape(-1)
        got = dequantize(torch.from_numpy(raw.view(np.uint8).copy()), t.tensor_type,
                         tuple(int(s) for s in t.shape.tolist())).reshape(-1).numpy()  # ggml ne order
        assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32)), t.name
        types.add(Q(t.tensor_type).name)
    print(f"{quantized.name}: {sorted(types)}")


def test_resident_matches_float64_reference(quantized):
    def hf64(path):
        hf = build_hf(path).double()
        hf.set_experts_implementation("eager")
        return hf

    diff = max_logit_diff(quantized, hf64, prompt_len=12, decode_steps=3, source=QuantResidentExperts)
    print(f"{quantized.name}: max abs logit diff vs float64 HF {diff:.3g}")
    assert diff <= TOL


def test_llamacpp_logits_agree(quantized, tmp_path):
    """llama.cpp computes quantized matmuls on int8-quantized activations: ~1.5 % of the logits'
    scale where routing agrees (Q4_1 .. Q5_1: 0.04-0.07 of ~3.8), more where a near-tie in routing
    flips (then that position and, through the cache, some after it); so: half the positions
    within 10 % and the same greedy token at 70 % of them."""
    from moestream.decoder.models import load_model

    prompt = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64]
    layout = ModelLayout(quantized)
    model = load_model(layout)
    with QuantResidentExperts(layout) as experts, torch.inference_mode():
        ours = forward_step(model.with_bank(ExpertBank(experts)), torch.tensor([prompt]), model.new_cache(1, len(prompt)))[0]  # [T, V]
    theirs = torch.from_numpy(_llamacpp_logits(quantized, prompt, tmp_path))  # [T, V]
    scale = theirs.abs().max().item()
    per_pos = (ours - theirs).abs().amax(-1)  # [T]
    close = (per_pos <= 0.1 * scale).float().mean().item()
    same = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    print(f"{quantized.name}: max |ours - llama.cpp| per position {[round(v, 3) for v in per_pos.tolist()]} "
          f"(max |logit| {scale:.3g}); same argmax {same:.0%}")
    # a near-tie in routing that llama.cpp's int8 activations flip moves a whole position: most
    # positions must agree closely, not every one
    assert close >= 0.5 and same >= 0.7, f"{close:.0%} of positions within 10 %, argmax agrees at {same:.0%}"


# Weights used in place (`--no-repack`, as bench capped runs it): the repacking buffer types
# crashed llama.cpp 0.3.36 on this AMX-capable VM (SIGSEGV on a 256-wide Q8_0 model).
_CHILD = """
import sys, numpy as np, llama_cpp
from moestream.decoder.bench.capped.llamacpp_peer import _no_extra_bufts
_no_extra_bufts()
llm = llama_cpp.Llama(sys.argv[1], n_ctx=64, logits_all=True, verbose=False, n_threads=2)
ids = [int(t) for t in sys.argv[2].split(",")]
llm.eval(ids)
np.save(sys.argv[3], np.array(llm.scores[:len(ids)], dtype=np.float32))
"""


def _llamacpp_logits(path, prompt: list[int], tmp_path) -> np.ndarray:
    """llama.cpp in a process of its own (its OpenMP runtime and torch's do not share one)."""
    out = tmp_path / "scores.npy"
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path), ",".join(map(str, prompt)), str(out)],
                       capture_output=True, text=True, timeout=300, env=os.environ)
    assert r.returncode == 0, r.stderr[-2000:]
    return np.load(out)
