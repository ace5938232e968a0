"""Our qwen3moe forward pass against Hugging Face's `Qwen3MoeForCausalLM`.

The HF model is built from a `Qwen3MoeConfig` with the GGUF's hyper-parameters and its
tensors copied in by name, dequantized with gguf-py's numpy reference (not our dequantizer),
so the check covers the tensor mapping, GGUF's reversed shape order, rope style, q/k norms,
routing and the expert SwiGLU. Logits are compared over a 16-token prompt and at each of 8
greedy decode steps (ours through the KV cache, HF on the whole sequence).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from moestream.common.layout import ModelLayout
from moestream.decoder.experts import ResidentExperts
from moestream.decoder.models import load_model
from moestream.decoder.models.qwen3moe import HF_FUSED, TENSOR_NAMES

transformers = pytest.importorskip("transformers")

PROMPT_LEN, DECODE_STEPS, TOL = 16, 8, 1e-4


def gguf_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor as float32 in numpy (= HF) shape order, via gguf-py alone."""
    out = {}
    for t in GGUFReader(path).tensors:
        arr = gguf_dequantize(np.asarray(t.data), t.tensor_type)
        out[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist()))))
    return out


def hf_config(hp, tied: bool):
    return transformers.Qwen3MoeConfig(
        vocab_size=hp.n_vocab, hidden_size=hp.n_embd, intermediate_size=4 * hp.n_embd,
        moe_intermediate_size=hp.n_ff_exp, num_hidden_layers=hp.n_layer, num_attention_heads=hp.n_head,
        num_key_value_heads=hp.n_head_kv, head_dim=hp.head_dim, num_experts=hp.n_expert,
        num_experts_per_tok=hp.n_expert_used, norm_topk_prob=hp.norm_topk_prob, rms_norm_eps=hp.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": hp.rope_base},
        max_position_embeddings=hp.context_length, tie_word_embeddings=tied, decoder_sparse_step=1,
        mlp_only_layers=[], attention_bias=False,
    )


def hf_state_dict(tensors: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    sd = {}
    for i in range(n_layer):
        for gguf_name, hf_name in TENSOR_NAMES.items():
            src = gguf_name.format(i=i)
            if src in tensors:
                sd[hf_name.format(i=i)] = tensors[src]
        for hf_name, parts in HF_FUSED.items():
            sd[hf_name.format(i=i)] = torch.cat([tensors[p.format(i=i)] for p in parts], dim=1)  # [E, 2ff, d]
    return sd


def build_hf(path):
    hp = ModelLayout(path).hparams
    tensors = gguf_tensors(path)
    tied = "output.weight" not in tensors
    model = transformers.Qwen3MoeForCausalLM(hf_config(hp, tied)).eval()
    model.config._attn_implementation = "eager"
    missing, unexpected = model.load_state_dict(hf_state_dict(tensors, hp.n_layer), strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= ({"lm_head.weight"} if tied else set()), missing  # every weight was copied
    if tied:
        model.tie_weights()
    return model


def compare(path) -> float:
    """Max |ours - HF| over the prompt's logits and each greedy decode step."""
    layout = ModelLayout(path)
    ours, experts, hf = load_model(layout), ResidentExperts(layout), build_hf(path)
    seq = torch.randint(0, layout.hparams.n_vocab, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    cache = ours.new_cache(1, PROMPT_LEN + DECODE_STEPS)
    worst = 0.0
    with torch.inference_mode():
        logits = ours.forward(seq, cache, experts)  # [1, T, V]
        for step in range(DECODE_STEPS + 1):
            ref = hf(input_ids=seq).logits  # [1, T, V]
            mine = logits if step == 0 else logits[:, -1:]
            worst = max(worst, (mine - ref[:, -mine.shape[1]:]).abs().max().item())
            if step == DECODE_STEPS:
                break
            nxt = ref[:, -1].argmax(-1, keepdim=True)  # [1, 1] HF's greedy choice drives both
            assert nxt.item() == mine[:, -1].argmax(-1).item(), f"greedy token differs at step {step}"
            seq = torch.cat([seq, nxt], dim=1)
            logits = ours.forward(nxt, cache, experts)  # [1, 1, V]
    return worst


@pytest.mark.parametrize("quant", ["F32", "Q8_0", "Q4_K"])
def test_logits_match_hf(make_tiny_model, quant):
    path = make_tiny_model(quant=quant)
    diff = compare(path)
    print(f"{quant}: max abs logit diff vs HF = {diff:.3g}")
    assert diff <= TOL, f"{quant}: max abs logit diff {diff} > {TOL}"


def test_logits_match_hf_wide_heads(make_tiny_model):
    """head_dim != hidden / heads (qwen3moe stores attention.key_length), 3 layers, top-4 of 8."""
    path = make_tiny_model(quant="F32", layers=3, top_k=4, head_dim=32, heads=4, kv_heads=1)
    assert compare(path) <= TOL
