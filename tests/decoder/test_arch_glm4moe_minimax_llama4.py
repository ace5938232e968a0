"""glm4moe (GLM-4.5/4.6/4.7), minimax-m2 and llama4 files written by make-model.

- logits against Hugging Face's `Glm4MoeForCausalLM`, `MiniMaxM2ForCausalLM`, `Llama4ForCausalLM`
  built from their own config classes with the file's metadata (read with gguf-py) and the GGUF
  tensors dequantized by gguf-py: prompt + greedy decode through our cache, F32 and Q8_0;
  GLM with and without q/k norm, its NextN block in the file and not run; Llama 4 with MoE on every
  layer and on every 2nd, top-1 and top-2, and its chunked attention crossing chunk boundaries;
- streamed == resident bit for bit through a real daemon with a quarter of the experts cached;
- the tensor names are the ones llama.cpp's loader knows (gguf-py's tables); bad metadata is one error.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf import GGUFReader
from moestream.decoder.experts.bank import ExpertBank
from moestream.common.layout import ModelFormatError, ModelLayout
from moestream.decoder.experts.arena import open_arena
from moestream.decoder.experts.prefetch import Prefetcher
from moestream.decoder.experts.resident import QuantResidentExperts
from moestream.decoder.generation.loop import generate
from moestream.decoder.models import get_model_module, load_model
from moestream.decoder.models.arch.llama4 import hf_experts
from hf_reference import gguf_tensors, max_logit_diff

transformers = pytest.importorskip("transformers")
T = transformers

PROMPT_LEN, DECODE_STEPS, TOL = 16, 6, 1e-4
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9], [400, 2, 33]]


def meta(path) -> dict:
    r = GGUFReader(path)
    arch = r.get_field("general.architecture").contents()
    return {k.removeprefix(arch + "."): f.contents() for k, f in r.fields.items() if k.startswith(arch + ".")}


def _common(m: dict, tensors: dict) -> dict:
    return dict(vocab_size=tensors["token_embd.weight"].shape[0], hidden_size=m["embedding_length"],
                num_attention_heads=m["attention.head_count"], num_key_value_heads=m["attention.head_count_kv"],
                head_dim=m["attention.key_length"], rms_norm_eps=m["attention.layer_norm_rms_epsilon"],
                max_position_embeddings=m["context_length"], num_experts_per_tok=m["expert_used_count"],
                tie_word_embeddings="output.weight" not in tensors)


def hf_config(path, tensors: dict, chunk: int | None = None):
    """The HF config of the file's family from its metadata as gguf-py reads it (not our layout)."""
    m = meta(path)
    arch, c = GGUFReader(path).get_field("general.architecture").contents(), _common(m, tensors)
    n_layer = m["block_count"] - m.get("nextn_predict_layers", 0)
    rope = {"rope_type": "default", "rope_theta": m["rope.freq_base"]}
    if arch == "glm4moe":
        return T.Glm4MoeConfig(**c, num_hidden_layers=n_layer, intermediate_size=m["feed_forward_length"],
                               moe_intermediate_size=m["expert_feed_forward_length"], n_routed_experts=m["expert_count"],
                               n_shared_experts=m["expert_shared_count"], first_k_dense_replace=m["leading_dense_block_count"],
                               routed_scaling_factor=m.get("expert_weights_scale", 1.0), n_group=1, topk_group=1,
                               norm_topk_prob=m.get("expert_weights_norm", False), attention_bias=True,
                               use_qk_norm="blk.0.attn_q_norm.weight" in tensors,
                               rope_parameters={**rope, "partial_rotary_factor": m["rope.dimension_count"] / c["head_dim"]})
    if arch == "minimax-m2":
        return T.MiniMaxM2Config(**c, bos_token_id=None, eos_token_id=None, num_hidden_layers=n_layer, intermediate_size=m["expert_feed_forward_length"],
                                 num_local_experts=m["expert_count"],
                                 rope_parameters={**rope, "partial_rotary_factor": m["rope.dimension_count"] / c["head_dim"]})
    assert arch == "llama4"
    return T.Llama4TextConfig(**c, num_hidden_layers=n_layer, intermediate_size=m["expert_feed_forward_length"],
                              intermediate_size_mlp=m["feed_forward_length"], num_local_experts=m["expert_count"],
                              interleave_moe_layer_step=m["interleave_moe_layer_step"], attention_chunk_size=chunk or 8192,
                              use_qk_norm=m["expert_count"] != 128, rope_parameters=rope)


HF_MODELS = {"glm4moe": "Glm4MoeForCausalLM", "minimax-m2": "MiniMaxM2ForCausalLM", "llama4": "Llama4ForCausalLM"}


def hf_state_dict(arch: str, tensors: dict, n_layer: int) -> dict:
    mod, sd = get_model_module(arch), {}
    for i in range(n_layer):  # (a NextN block, i >= n_layer, has no HF counterpart)
        for gguf_name, hf_name in mod.TENSOR_NAMES.items():
            if gguf_name.format(i=i) in tensors:
                sd[hf_name.format(i=i)] = tensors[gguf_name.format(i=i)]
        for hf_name, parts in mod.HF_FUSED.items():
            if parts[0].format(i=i) in tensors:
                sd[hf_name.format(i=i)] = torch.cat([tensors[p.format(i=i)] for p in parts], dim=1)  # [E, 2ff, d]
        if arch == "llama4" and f"blk.{i}.ffn_gate_exps.weight" in tensors:
            sd.update(hf_experts(tensors, i))
    return sd


def build_hf(path, chunk: int | None = None):
    tensors = gguf_tensors(path)
    arch = GGUFReader(path).get_field("general.architecture").contents()
    cfg = hf_config(path, tensors, chunk)
    model = getattr(T, HF_MODELS[arch])(cfg).eval()
    model.config._attn_implementation = "eager"
    ref, sd = model.state_dict(), hf_state_dict(arch, tensors, cfg.num_hidden_layers)
    for name, t in sd.items():
        assert name in ref and t.shape == ref[name].shape, (name, t.shape)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= ({"lm_head.weight"} if cfg.tie_word_embeddings else set()), missing  # every weight copied
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model


CASES = {
    "glm4moe": dict(arch="glm4moe", layers=3),  # layer 0 dense, NextN block 3 in the file
    "glm4moe-air": dict(arch="glm4moe", layers=3, top_k=3, arch_opts=(("qk_norm", False), ("nextn", 0))),
    "glm4moe-q8": dict(arch="glm4moe", layers=2, quant="Q8_0"),
    "minimax-m2": dict(arch="minimax-m2", layers=2, top_k=3),
    "minimax-m2-q8": dict(arch="minimax-m2", layers=2, quant="Q8_0", heads=8, kv_heads=2, head_dim=16),
    "llama4": dict(arch="llama4", layers=4, top_k=1),  # Maverick-like: MoE on layers 1 and 3, NoPE layer 3
    "llama4-scout": dict(arch="llama4", layers=4, top_k=2, arch_opts=(("moe_step", 1),)),
    "llama4-q8": dict(arch="llama4", layers=4, quant="Q8_0", top_k=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(make_tiny_model, case):
    kw = {"quant": "F32", **CASES[case]}
    path = make_tiny_model(**kw)
    diff = max_logit_diff(path, build_hf, PROMPT_LEN, DECODE_STEPS, check_greedy=kw["quant"] == "F32")
    print(f"{case}: max abs logit diff vs HF = {diff:.3g}")
    assert diff <= TOL, f"{case}: max abs logit diff {diff} > {TOL}"


@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_chunked_attention_matches_hf(make_tiny_model, monkeypatch, top_k):
    """With a chunk of 5 tokens, a 16-token prompt and 6 decode steps cross four chunk boundaries;
    llama.cpp's chunk is 8192 (the file does not carry it), so both sides are told 5."""
    import moestream.decoder.models.arch.llama4 as llama4

    monkeypatch.setattr(llama4, "CHUNK", 5)
    path = make_tiny_model(arch="llama4", quant="F32", layers=4, top_k=top_k)
    diff = max_logit_diff(path, lambda p: build_hf(p, chunk=5), PROMPT_LEN, DECODE_STEPS, check_greedy=True)
    assert diff <= TOL
    monkeypatch.setattr(llama4, "CHUNK", 8192)  # a check that the chunk matters: HF at 5, ours at 8192
    assert max_logit_diff(path, lambda p: build_hf(p, chunk=5), PROMPT_LEN, 0) > 1e-3


def test_the_files_are_what_llama_cpp_reads(make_tiny_model):
    """Every tensor name is one llama.cpp's loader has for the family (gguf-py's tables)."""
    archs = {"glm4moe": gguf.MODEL_ARCH.GLM4_MOE, "minimax-m2": gguf.MODEL_ARCH.MINIMAXM2,
             "llama4": gguf.MODEL_ARCH.LLAMA4}
    for case in ("glm4moe", "minimax-m2", "llama4"):
        path = make_tiny_model(quant="F32", **CASES[case])
        known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[archs[case]]}
        for t in GGUFReader(path).tensors:
            base = t.name.removesuffix(".weight").removesuffix(".bias")
            generic = base if not base.startswith("blk.") else "blk.{bid}." + base.split(".", 2)[2]
            assert generic in known, (case, t.name)
    glm = ModelLayout(make_tiny_model(quant="F32", **CASES["glm4moe"]))
    assert glm.hparams.n_layer == 3 and glm.kv("glm4moe.block_count") == 4  # the NextN block: not run
    assert glm.experts.moe_layers == [1, 2] and "blk.3.nextn.eh_proj.weight" in glm.dense
    from moestream.decoder.models.weights import load_dense

    loaded = load_dense(glm, "cpu", progress=False)  # the NextN block is skipped, the stack is whole
    assert not any(n.startswith("blk.3.") for n in loaded) and "blk.2.ffn_gate_inp.weight" in loaded
    l4 = ModelLayout(make_tiny_model(quant="F32", **CASES["llama4"]))
    assert l4.experts.moe_layers == [1, 3] and "blk.0.ffn_gate.weight" in l4.dense


# -- streaming -------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["glm4moe-q8", "minimax-m2-q8", "llama4-q8"])
def test_streamed_equals_resident_bit_for_bit(make_tiny_model, start_daemon, case):
    path = make_tiny_model(**CASES[case])
    layout = ModelLayout(path)
    model = load_model(layout, keep_quantized=True)
    with QuantResidentExperts(layout) as resident:
        want = generate(model.with_bank(ExpertBank(resident)), PROMPTS, 6, keep_logits=True)
    daemon = start_daemon(path, arena_slots=max(layout.hparams.n_expert_used, layout.experts.n_blobs // 4))
    with open_arena(layout, daemon.endpoint) as src:
        got = generate(model.with_bank(ExpertBank(src)), PROMPTS, 6, keep_logits=True, observer=Prefetcher(model, src, 1))
        st = src.stats()
    assert got.tokens == want.tokens and all(torch.equal(x, y) for x, y in zip(got.logits, want.logits))
    assert st.counts.acquired > 0 and st.counts.bytes_fetched > 0


@pytest.mark.parametrize("case", ["glm4moe-q8", "llama4-q8"])
def test_streamed_slot_cache_equals_resident_bit_for_bit(make_tiny_model, start_daemon, case):
    """The device slot cache's path (here on the CPU, dequantized slots) with evictions: GLM's dense
    layer and Llama 4's dense layers never fetch, Llama 4's (token, expert) rows come through whole."""
    from moestream.common.client import IodClient
    from moestream.decoder.experts.gpu.slot_cache import DeviceSlotCache
    from moestream.decoder.experts.source import ResidentExperts
    from moestream.decoder.experts.gpu.streamed import StreamedExperts

    path = make_tiny_model(**CASES[case])
    layout = ModelLayout(path)
    model = load_model(layout)
    slots = max(layout.hparams.n_expert_used, layout.experts.n_blobs // 4)
    with ResidentExperts(layout) as resident:
        want = generate(model.with_bank(ExpertBank(resident)), PROMPTS, 6, keep_logits=True)
    daemon = start_daemon(path)
    cache = DeviceSlotCache(layout.experts, slots)
    client = IodClient(daemon.endpoint, expect_fingerprint=layout.fingerprint.as_dict())
    with StreamedExperts(client, layout, cache, owns_client=True) as src:
        got = generate(model.with_bank(ExpertBank(src)), PROMPTS, 6, keep_logits=True, observer=Prefetcher(model, src, 1))
        st = src.stats().as_dict()
    assert got.tokens == want.tokens and all(torch.equal(x, y) for x, y in zip(got.logits, want.logits))
    assert st["misses"] > slots and st["cache"]["evictions"] > 0


# -- bad input -------------------------------------------------------------------------------
def test_bad_metadata_is_one_clear_error(tmp_path):
    from moestream.authoring.gguf_write import write_moe_gguf
    from moestream.authoring.make_model import build_tensors, model_hparams

    hp = model_hparams("glm4moe", layers=2, experts=8, top_k=2, hidden=64, expert_ff=64, heads=4, kv_heads=2, vocab=64)
    hp["extra"]["rope.dimension_count"] = 7
    write_moe_gguf(tmp_path / "odd.gguf", "glm4moe", hp, build_tensors("glm4moe", hp), "F32", None)
    with pytest.raises(ModelFormatError, match=r"rope.dimension_count=7 must be even"):
        load_model(ModelLayout(tmp_path / "odd.gguf"))
    with pytest.raises(ValueError, match=r"unknown llama4 option\(s\) \['nextn'\]"):
        model_hparams("llama4", layers=2, experts=8, top_k=2, hidden=64, expert_ff=64, heads=4, kv_heads=2,
                      vocab=64, arch_opts={"nextn": 1})
