"""Qwen3-Next and Qwen3.5-MoE (hybrid Gated DeltaNet + gated attention, sigmoid-gated shared expert).

- Logits against Hugging Face's `Qwen3NextForCausalLM` / `Qwen3_5MoeForCausalLM` (their pure-torch
  delta-rule and conv fallbacks) with the GGUF's weights, dequantized by gguf-py and converted
  back to HF's layout by inverting llama.cpp's converter (norms - 1, in_proj_qkvz re-interleaved,
  A_log = log(-ssm_a), Qwen3.5's value heads un-tiled), over a prompt and greedy decode steps.
- A left-padded batch equals each prompt run alone (pads never touch the recurrent state).
- Streamed from a real daemon's arena (25 % of the experts) == resident, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from moestream.decoder.experts.bank import ExpertBank
from moestream.common.layout import ModelFormatError, ModelLayout
from moestream.decoder.experts.arena import open_arena
from moestream.decoder.experts.source import ResidentExperts
from moestream.decoder.generation.loop import generate, forward_step
from moestream.decoder.models import get_model_module, load_model
from moestream.decoder.experts.prefetch import Prefetcher
from moestream.decoder.experts.resident import QuantResidentExperts
from hf_reference import gguf_tensors, max_logit_diff

transformers = pytest.importorskip("transformers")

ARCHS = ("qwen3next", "qwen35moe")
MODEL = dict(layers=4, experts=8, top_k=2)  # layers 0-2 Gated DeltaNet, layer 3 full attention
PROMPT_LEN, DECODE_STEPS, TOL = 12, 4, 1e-4
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12, 64], [400, 2, 33]]
N_NEW = 5


# -- the HF reference ---------------------------------------------------------------------------
def hf_config(hp):
    common = dict(
        vocab_size=hp.n_vocab, hidden_size=hp.n_embd, num_hidden_layers=hp.n_layer, num_attention_heads=hp.n_head,
        num_key_value_heads=hp.n_head_kv, head_dim=hp.head_dim, num_experts_per_tok=hp.n_expert_used,
        num_experts=hp.n_expert, moe_intermediate_size=hp.n_ff_exp, shared_expert_intermediate_size=hp.n_ff_shexp,
        rms_norm_eps=hp.rms_eps, max_position_embeddings=hp.context_length, tie_word_embeddings=False,
        linear_conv_kernel_dim=hp.ssm_conv_kernel, linear_key_head_dim=hp.ssm_state_size,
        linear_value_head_dim=hp.ssm_inner_size // hp.ssm_time_step_rank, linear_num_key_heads=hp.ssm_group_count,
        linear_num_value_heads=hp.ssm_time_step_rank,
        layer_types=["linear_attention" if r else "full_attention" for r in hp.recurrent],
    )
    rope = {"rope_type": "default", "rope_theta": hp.rope_base, "partial_rotary_factor": hp.rope_dim / hp.head_dim}
    if hp.arch == "qwen3next":
        return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **common, rope_parameters=rope, intermediate_size=hp.n_ff_shexp, decoder_sparse_step=1,
            mlp_only_layers=[], norm_topk_prob=True))
    return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**common, rope_parameters=rope))


def untile_v_heads(t: torch.Tensor, dim: int, hp, head_dim: int) -> torch.Tensor:
    """Undo llama.cpp's grouped -> tiled value-head reorder (Qwen3.5) along `dim`."""
    nk, r = hp.ssm_group_count, hp.ssm_time_step_rank // hp.ssm_group_count
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], r, nk, head_dim, *shape[dim + 1:]).transpose(dim, dim + 1)  # tiled (r, nk) -> (nk, r)
    return t.reshape(shape)


def to_hf(mod, tensors: dict[str, torch.Tensor], hp) -> dict[str, torch.Tensor]:
    """GGUF tensors (numpy order) -> HF state dict, inverting llama.cpp's converter."""
    dv, kd = hp.ssm_inner_size // hp.ssm_time_step_rank, hp.ssm_group_count * hp.ssm_state_size
    t = dict(tensors)
    for name in list(t):
        short = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if short in mod.NORM_PLUS_ONE:
            t[name] = t[name] - 1
        if short == "ssm_a":
            t[name] = torch.log(-t[name])
        if short == "ssm_conv1d.weight":
            t[name] = t[name][:, None, :]  # [C, 1, K]
    if hp.arch == "qwen35moe":  # value heads back to HF's grouped order
        for i in (i for i in range(hp.n_layer) if hp.recurrent[i]):
            p = f"blk.{i}."
            for qkv_like in ("attn_qkv.weight", "ssm_conv1d.weight"):
                w = t[p + qkv_like]
                t[p + qkv_like] = torch.cat([w[:2 * kd], untile_v_heads(w[2 * kd:], 0, hp, dv)])
            t[p + "attn_gate.weight"] = untile_v_heads(t[p + "attn_gate.weight"], 0, hp, dv)
            for n in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
                t[p + n] = untile_v_heads(t[p + n], 0, hp, 1)
            t[p + "ssm_out.weight"] = untile_v_heads(t[p + "ssm_out.weight"], 1, hp, dv)
    sd = {}
    for i in range(hp.n_layer):
        for g, h in mod.TENSOR_NAMES.items():
            if g.format(i=i) in t:
                sd[h.format(i=i)] = t[g.format(i=i)]
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.cat(
            [t[f"blk.{i}.ffn_gate_exps.weight"], t[f"blk.{i}.ffn_up_exps.weight"]], dim=1)  # [E, 2ff, d]
        if hp.arch == "qwen3next" and hp.recurrent[i]:
            sd[f"model.layers.{i}.linear_attn.in_proj_qkvz.weight"] = interleave_qkvz(
                t[f"blk.{i}.attn_qkv.weight"], t[f"blk.{i}.attn_gate.weight"], hp)
    return sd


def interleave_qkvz(qkv: torch.Tensor, z: torch.Tensor, hp) -> torch.Tensor:
    """attn_qkv [C, d] + attn_gate [nv*dv, d] -> HF's in_proj_qkvz (= old files' ssm_in): per key
    head its q, its k, then its value heads' v and z rows."""
    nk, dk, d = hp.ssm_group_count, hp.ssm_state_size, qkv.shape[1]
    kd = nk * dk
    q, k, v = qkv[:kd].reshape(nk, dk, d), qkv[kd:2 * kd].reshape(nk, dk, d), qkv[2 * kd:].reshape(nk, -1, d)
    return torch.cat([q, k, v, z.reshape(nk, -1, d)], dim=1).reshape(-1, d)


def compare(path) -> float:
    return max_logit_diff(path, build_hf, PROMPT_LEN, DECODE_STEPS)


def build_hf(path):
    layout = ModelLayout(path)
    hp = layout.hparams
    model = hf_config(hp).eval()
    model.config._attn_implementation = "eager"
    ref = model.state_dict()
    sd = to_hf(get_model_module(hp.arch), gguf_tensors(path), hp)
    for name, t in sd.items():
        assert name in ref, f"no HF tensor {name}"
        assert t.numel() == ref[name].numel(), name
        sd[name] = t.reshape(ref[name].shape)  # (the shared gate: [d] -> HF's [1, d])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf(make_tiny_model, arch):
    diff = compare(make_tiny_model(arch=arch, quant="F32", **MODEL))
    print(f"{arch} F32: max abs logit diff vs HF = {diff:.3g}")
    assert diff <= TOL


# -- the Gated DeltaNet pieces ------------------------------------------------------------------
def test_chunked_prefill_equals_token_by_token():
    """The chunked delta rule over 150 tokens (3 chunks, pads at a row's start and in its middle)
    and the vectorized conv give what feeding the same tokens one step at a time gives."""
    from moestream.decoder.models.arch.qwen3next import causal_conv, delta_rule

    g = torch.Generator().manual_seed(0)
    B, T, H, dk, dv, C, K = 2, 150, 4, 8, 8, 12, 4
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=g), dim=-1) for _ in range(2))
    v, beta = torch.randn(B, T, H, dv, generator=g), torch.rand(B, T, H, generator=g)
    decay = -2 * torch.rand(B, T, H, generator=g)  # log-decay < 0
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :37], valid[0, 70:75] = False, False
    s_all, s_one = (torch.randn(B, H, dk, dv, generator=torch.Generator().manual_seed(1)) for _ in range(2))
    whole = delta_rule(q, k, v, beta, decay, valid, s_all)
    steps = torch.cat([delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], beta[:, t:t + 1], decay[:, t:t + 1],
                                  valid[:, t:t + 1], s_one) for t in range(T)], dim=1)
    assert (whole - steps)[valid].abs().max().item() <= 1e-5 and (s_all - s_one).abs().max().item() <= 1e-5
    x, kernel = torch.randn(B, T, C, generator=g), torch.randn(C, K, generator=g)
    c_all, c_one = torch.zeros(B, K - 1, C), torch.zeros(B, K - 1, C)
    whole = causal_conv(x, valid, c_all, kernel)
    steps = torch.cat([causal_conv(x[:, t:t + 1], valid[:, t:t + 1], c_one, kernel) for t in range(T)], dim=1)
    assert torch.allclose(whole[valid], steps[valid], atol=1e-6) and torch.equal(c_all, c_one)


# -- batching and streaming ---------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3next"])  # (test_models.py checks a padded forward for both)
def test_left_padded_batch_equals_each_prompt_alone(make_tiny_model, arch):
    """The short prompt is left-padded by 7: its conv window and delta state must not see the pads,
    in the prompt step and in the decode steps after it."""
    layout = ModelLayout(make_tiny_model(arch=arch, quant="F32", **MODEL))
    model = load_model(layout)
    with ResidentExperts(layout) as experts:
        batch = generate(model.with_bank(ExpertBank(experts)), PROMPTS, N_NEW, keep_logits=True)
        alone = [generate(model.with_bank(ExpertBank(experts)), [p], N_NEW, keep_logits=True) for p in PROMPTS]
    for b, single in enumerate(alone):
        assert batch.tokens[b] == single.tokens[0]
        for step, (x, y) in enumerate(zip(batch.logits, single.logits)):
            assert torch.allclose(x[b], y[0], atol=1e-5), f"sequence {b}, step {step}"


@pytest.mark.parametrize("arch,depth", [("qwen3next", 0), ("qwen35moe", 1)])
def test_streamed_equals_resident_bit_for_bit(make_tiny_model, start_daemon, arch, depth):
    path = make_tiny_model(arch=arch, quant="Q8_0", **MODEL)
    layout = ModelLayout(path)
    model = load_model(layout)
    slots = layout.hparams.n_layer * layout.hparams.n_expert // 4  # 25 % of the experts
    with QuantResidentExperts(layout) as resident:
        want = generate(model.with_bank(ExpertBank(resident)), PROMPTS, N_NEW, keep_logits=True)
    daemon = start_daemon(path, arena_slots=slots)
    with open_arena(layout, daemon.endpoint) as src:
        hook = Prefetcher(model, src, depth) if depth else None
        got = generate(model.with_bank(ExpertBank(src)), PROMPTS, N_NEW, keep_logits=True, observer=hook)
        st = src.stats()
    assert got.tokens == want.tokens
    assert all(torch.equal(x, y) for x, y in zip(got.logits, want.logits))
    assert st.counts.acquired > 0 and st.counts.bytes_fetched > 0


# -- files ------------------------------------------------------------------------------------
def test_written_names_and_keys_are_llama_cpps(make_tiny_model):
    """Every tensor make-model writes is one gguf-py lists for the family, with the ssm keys."""
    from gguf import GGUFReader
    from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

    for arch in ARCHS:
        path = make_tiny_model(arch=arch, quant="F32", **MODEL)
        enum = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
        allowed = {TENSOR_NAMES[t].format(bid="{i}") for t in MODEL_TENSORS[enum]}
        reader = GGUFReader(path)
        for t in reader.tensors:
            parts = t.name.split(".")
            base = ".".join(["blk", "{i}", *parts[2:]] if parts[0] == "blk" else parts)
            assert base.removesuffix(".weight").removesuffix(".bias") in allowed, t.name
        keys = {f.name for f in reader.fields.values()}
        for k in ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
                  "full_attention_interval", "rope.dimension_count", "attention.key_length"):
            assert f"{arch}.{k}" in keys, k


def test_missing_deltanet_tensor_is_a_clear_error(make_tiny_model, tmp_path):
    """A file whose linear-attention layer lacks attn_qkv (e.g. an old `ssm_in` one) names it."""
    from moestream.authoring.gguf_write import write_moe_gguf
    from moestream.authoring.make_model import build_tensors, model_hparams

    hp = model_hparams("qwen3next", layers=4, experts=8, top_k=2, hidden=64, expert_ff=64, heads=4, kv_heads=2,
                       vocab=64)
    tensors = build_tensors("qwen3next", hp)
    del tensors["blk.1.attn_qkv.weight"]
    write_moe_gguf(tmp_path / "bad.gguf", "qwen3next", hp, tensors, "F32", None)
    with pytest.raises(ModelFormatError, match=r"missing tensor 'blk\.1\.attn_qkv\.weight' required by qwen3next"):
        ModelLayout(tmp_path / "bad.gguf")


def test_legacy_ssm_in_file_decodes_the_same(make_tiny_model, tmp_path):
    """An older Qwen3-Next GGUF (HF's in_proj_qkvz as one `ssm_in`) gives the split file's logits."""
    from moestream.authoring.gguf_write import write_moe_gguf
    from moestream.authoring.make_model import model_hparams

    path = make_tiny_model(arch="qwen3next", quant="F32", **MODEL)
    hp = ModelLayout(path).hparams
    tensors = {n: t.numpy() for n, t in gguf_tensors(path).items()}
    for i in (i for i in range(hp.n_layer) if hp.recurrent[i]):
        qkv, z = (torch.from_numpy(tensors.pop(f"blk.{i}.{n}.weight")) for n in ("attn_qkv", "attn_gate"))
        tensors[f"blk.{i}.ssm_in.weight"] = interleave_qkvz(qkv, z, hp).numpy()
    whp = model_hparams("qwen3next", layers=4, experts=8, top_k=2, hidden=hp.n_embd, expert_ff=hp.n_ff_exp,
                        heads=hp.n_head, kv_heads=hp.n_head_kv, vocab=hp.n_vocab)
    write_moe_gguf(tmp_path / "legacy.gguf", "qwen3next", whp, tensors, "F32", None)
    seq = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        out = []
        for p in (path, tmp_path / "legacy.gguf"):
            layout = ModelLayout(p)
            model = load_model(layout)
            out.append(forward_step(model.with_bank(ExpertBank(ResidentExperts(layout))), seq, model.new_cache(1, seq.shape[1])))
    assert "blk.0.ssm_in.weight" in ModelLayout(tmp_path / "legacy.gguf").dense
    assert (out[0] - out[1]).abs().max().item() <= 1e-5


def test_mtp_block_after_the_stack_is_not_run(tmp_path):
    """A Qwen3.5 file with an MTP block (block_count = 5, nextn_predict_layers = 1) decodes as its
    4-layer stack alone: the extra block's experts are not indexed, its layers not run."""
    from moestream.authoring.gguf_write import write_moe_gguf
    from moestream.authoring.make_model import build_tensors, model_hparams

    hp = model_hparams("qwen35moe", layers=5, experts=8, top_k=2, hidden=64, expert_ff=64, heads=4, kv_heads=2,
                       vocab=64)
    hp["full_attention_interval"] = 4
    tensors = build_tensors("qwen35moe", hp)
    write_moe_gguf(tmp_path / "mtp.gguf", "qwen35moe", {**hp, "extra": {"nextn_predict_layers": 1}}, tensors,
                   "F32", None)
    write_moe_gguf(tmp_path / "stack.gguf", "qwen35moe", {**hp, "n_layer": 4},
                   {n: t for n, t in tensors.items() if not n.startswith("blk.4.")}, "F32", None)
    seq, out = torch.tensor([[5, 17, 9, 3, 50, 41]]), []
    with torch.inference_mode():
        for name in ("mtp.gguf", "stack.gguf"):
            layout = ModelLayout(tmp_path / name)
            assert layout.hparams.n_layer == 4 and layout.experts.n_layer == 4
            model = load_model(layout)
            out.append(forward_step(model.with_bank(ExpertBank(ResidentExperts(layout))), seq, model.new_cache(1, 6)))
    assert torch.equal(out[0], out[1])
