"""Every architecture's forward pass against Hugging Face's model of that family.

Each HF model is built from its own config class with the GGUF's hyper-parameters and the
GGUF tensors copied in by name, dequantized with gguf-py's numpy reference (not our
dequantizer). The routing renormalization is left at each HF config's default (except
qwen3moe's, whose HF default differs from its real checkpoints), so the test also checks that
`common.arch` picked the family's behaviour. Mixtral's q/k are un-permuted
(llama.cpp's converter permuted them for its interleaved rope) before HF sees them, so the
test also covers the rope style. Logits are compared over a 16-token prompt and at each of 8
greedy decode steps (ours through the KV cache, HF on the whole sequence). For quantized files
HF gets the gguf-py-dequantized weights.
"""

from __future__ import annotations

import pytest
import torch
from moestream.common.layout import ModelLayout
from moestream.decoder.models import get_model_module
from hf_reference import gguf_tensors, max_logit_diff

transformers = pytest.importorskip("transformers")

PROMPT_LEN, DECODE_STEPS, TOL = 16, 8, 1e-4


def _common(hp, tied: bool) -> dict:
    return dict(
        vocab_size=hp.n_vocab, hidden_size=hp.n_embd, num_hidden_layers=hp.n_layer, num_attention_heads=hp.n_head,
        num_key_value_heads=hp.n_head_kv, num_experts_per_tok=hp.n_expert_used, rms_norm_eps=hp.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": hp.rope_base},
        max_position_embeddings=hp.context_length, tie_word_embeddings=tied,
    )


def hf_model(hp, tied: bool):
    """An HF model of hp's family with default (random) weights."""
    c = _common(hp, tied)
    if hp.arch == "qwen3moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **c, intermediate_size=4 * hp.n_embd, moe_intermediate_size=hp.n_ff_exp, head_dim=hp.head_dim,
            num_experts=hp.n_expert, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False,
            norm_topk_prob=True))  # HF's config default is False; Qwen3-MoE checkpoints and llama.cpp use True
    if hp.arch == "llama":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **c, intermediate_size=hp.n_ff_exp, num_local_experts=hp.n_expert, sliding_window=None))
    if hp.arch == "qwen2moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **c, intermediate_size=hp.n_ff_shexp, moe_intermediate_size=hp.n_ff_exp,
            shared_expert_intermediate_size=hp.n_ff_shexp, num_experts=hp.n_expert, qkv_bias=True,
            decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False))
    if hp.arch == "olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **c, intermediate_size=hp.n_ff_exp, num_experts=hp.n_expert, clip_qkv=None))
    raise AssertionError(hp.arch)


def hf_state_dict(mod, tensors: dict[str, torch.Tensor], hp) -> dict[str, torch.Tensor]:
    """GGUF tensors renamed (and fused / un-permuted / reshaped) into HF's state dict."""
    unpermute = getattr(mod, "HF_UNPERMUTE", {})
    sd = {}
    for i in range(hp.n_layer):
        for gguf_name, hf_name in mod.TENSOR_NAMES.items():
            src = gguf_name.format(i=i)
            if src in tensors:
                t = tensors[src]
                if gguf_name in unpermute:
                    t = mod.unpermute_qk(t, getattr(hp, unpermute[gguf_name]))
                sd[hf_name.format(i=i)] = t
        for hf_name, parts in mod.HF_FUSED.items():
            sd[hf_name.format(i=i)] = torch.cat([tensors[p.format(i=i)] for p in parts], dim=1)  # [E, 2ff, d]
    return sd


def compare(path) -> float:
    return max_logit_diff(path, build_hf, PROMPT_LEN, DECODE_STEPS, check_greedy=True)


def build_hf(path):
    layout = ModelLayout(path)
    hp, mod, tensors = layout.hparams, get_model_module(layout.hparams.arch), gguf_tensors(path)
    tied = "output.weight" not in tensors
    model = hf_model(hp, tied).eval()
    model.config._attn_implementation = "eager"
    ref = model.state_dict()
    sd = hf_state_dict(mod, tensors, hp)
    for name, t in sd.items():  # only a squeezed [1, d] (qwen2moe's shared gate) may differ in shape
        assert name in ref, f"no HF tensor {name}"
        assert t.shape == ref[name].shape or (t.dim() == 1 and ref[name].shape == (1, t.shape[0])), name
        sd[name] = t.reshape(ref[name].shape)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= ({"lm_head.weight"} if tied else set()), missing  # every weight was copied
    if tied:
        model.tie_weights()
    return model


@pytest.mark.parametrize("arch,quant", [("qwen3moe", "F32"), ("qwen3moe", "Q8_0"), ("qwen3moe", "Q4_K"),
                                        ("llama", "F32"), ("qwen2moe", "F32"), ("olmoe", "F32"), ("llama", "Q8_0"),
                                        ("qwen2moe", "Q8_0")])
def test_logits_match_hf(make_tiny_model, arch, quant):
    diff = compare(make_tiny_model(arch=arch, quant=quant))
    print(f"{arch} {quant}: max abs logit diff vs HF = {diff:.3g}")
    assert diff <= TOL, f"{arch} {quant}: max abs logit diff {diff} > {TOL}"


def test_qwen3moe_head_dim_not_hidden_over_heads(make_tiny_model):
    """head_dim != hidden / heads (qwen3moe stores attention.key_length), 3 layers, top-4 of 8."""
    path = make_tiny_model(quant="F32", layers=3, top_k=4, head_dim=32, heads=4, kv_heads=1)
    assert compare(path) <= TOL


def test_mixtral_wider_gqa(make_tiny_model):
    """Mixtral with 8 query heads on 2 kv heads, 3 layers, top-3 of 6: un-permute per head count."""
    path = make_tiny_model(arch="llama", quant="F32", layers=3, experts=6, top_k=3, heads=8, kv_heads=2)
    assert compare(path) <= TOL


def test_unpermute_inverts_llama_cpp_permute():
    """`unpermute_qk` undoes convert_hf_to_gguf's `permute` (written out here from its definition)."""
    from moestream.decoder.models.arch.mixtral import unpermute_qk

    def permute(w, n_head):  # llama.cpp: reshape(n_head, 2, hd/2, ...).swapaxes(1, 2)
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(4 * 8, 5)  # 4 heads of dim 8
    assert torch.equal(unpermute_qk(permute(w, 4), 4), w)
    assert not torch.equal(permute(w, 4), w)
