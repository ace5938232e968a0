"""deepseek2 (DeepSeek-V2/V3/R1, Kimi-K2): MLA attention, leading dense layers, grouped sigmoid
routing with the selection bias, shared experts.

- logits against Hugging Face's `DeepseekV3ForCausalLM` with the same weights (F32, gguf-py's
  dequantizer, prompt + greedy decode through our latent cache), in llama.cpp's current file form
  (q_lora, attn_k_b/attn_v_b, YaRN, expert groups) and the older one (attn_kv_b, plain attn_q);
- streamed == resident bit for bit with 25 % of the experts cached, through a real daemon (the
  arena-backed CPU path and the device slot cache), the dense layers never fetched;
- the daemon refuses a request for a dense layer; the routing against a plain reference;
  unsupported variants are one clear error.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader
from moestream.decoder.experts.bank import ExpertBank
from moestream.common.client import IodClient, IodRequestError
from moestream.common.layout import ModelFormatError, ModelLayout
from moestream.decoder.experts.arena import open_arena
from moestream.decoder.experts.source import ResidentExperts
from moestream.decoder.generation.loop import generate
from moestream.decoder.models import get_model_module, load_model
from moestream.decoder.models.arch.deepseek2 import Routing, hf_kv_b, route_grouped
from moestream.decoder.experts.prefetch import Prefetcher
from moestream.decoder.experts.resident import QuantResidentExperts
from moestream.decoder.experts.gpu.slot_cache import DeviceSlotCache
from moestream.decoder.experts.gpu.streamed import StreamedExperts
from moestream.decoder.models.weights import load_dense
from hf_reference import gguf_tensors, max_logit_diff

transformers = pytest.importorskip("transformers")

PROMPT_LEN, DECODE_STEPS, TOL = 16, 4, 1e-4
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9], [400, 2, 33]]
# current converter form: q_lora, k_b/v_b split, YaRN, 4 groups of 2 (2 kept), selection bias
CURRENT = dict(arch="deepseek2", quant="F32", layers=3, experts=8, top_k=3)
# older converter form with the other branches: attn_kv_b, plain attn_q, no YaRN/groups/bias/renorm
LEGACY = dict(arch="deepseek2", quant="F32", layers=3, experts=8, top_k=2,
              mla=(("legacy_kv_b", True), ("q_lora_rank", 0), ("yarn_factor", 0), ("groups", (1, 1)),
                   ("bias", False), ("weights_norm", False), ("weights_scale", 1.5)))
# streaming: 2 dense + 2 MoE layers x 12 experts = 24 experts, 6 slots = 25 %
STREAMED = dict(arch="deepseek2", quant="Q8_0", layers=4, experts=12, top_k=2, mla=(("dense_layers", 2),))


# -- against Hugging Face --------------------------------------------------------------------
def meta(path) -> dict:
    r = GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("deepseek2.")}


def hf_config(path):
    """DeepseekV3Config from the file's metadata, read here with gguf-py (not our layout)."""
    m = {k.removeprefix("deepseek2."): v for k, v in meta(path).items()}
    t = {name: tuple(reversed(x.shape.tolist())) for name, x in ((x.name, x) for x in GGUFReader(path).tensors)}
    rope = {"rope_type": "default", "rope_theta": m["rope.freq_base"]}
    if m.get("rope.scaling.type") == "yarn":
        mscale = m["rope.scaling.yarn_log_multiplier"] / 0.1  # DeepSeek-V3: mscale == mscale_all_dim
        rope = {"rope_type": "yarn", "rope_theta": m["rope.freq_base"], "factor": m["rope.scaling.factor"],
                "original_max_position_embeddings": m["rope.scaling.original_context_length"],
                "mscale": mscale, "mscale_all_dim": mscale, "beta_fast": 32.0, "beta_slow": 1.0}
    k_head = m.get("attention.key_length_mla", m["attention.key_length"])
    return transformers.DeepseekV3Config(
        vocab_size=t["token_embd.weight"][0], hidden_size=m["embedding_length"], intermediate_size=m["feed_forward_length"],
        moe_intermediate_size=m["expert_feed_forward_length"], num_hidden_layers=m["block_count"],
        num_attention_heads=m["attention.head_count"], num_key_value_heads=m["attention.head_count"],
        n_shared_experts=m["expert_shared_count"], n_routed_experts=m["expert_count"],
        routed_scaling_factor=m["expert_weights_scale"], kv_lora_rank=m["attention.kv_lora_rank"],
        q_lora_rank=m.get("attention.q_lora_rank") or None, qk_rope_head_dim=m["rope.dimension_count"],
        qk_nope_head_dim=k_head - m["rope.dimension_count"],
        v_head_dim=m.get("attention.value_length_mla", m["attention.value_length"]),
        n_group=max(1, m["expert_group_count"]), topk_group=max(1, m["expert_group_used_count"]),
        num_experts_per_tok=m["expert_used_count"], first_k_dense_replace=m["leading_dense_block_count"],
        norm_topk_prob=bool(m.get("expert_weights_norm", False)), rms_norm_eps=m["attention.layer_norm_rms_epsilon"],
        max_position_embeddings=m["context_length"], rope_parameters=rope, rope_interleave=True,
        tie_word_embeddings=False, attention_bias=False)


def compare(path) -> float:
    return max_logit_diff(path, build_hf, PROMPT_LEN, DECODE_STEPS)


def build_hf(path):
    tensors, mod = gguf_tensors(path), get_model_module("deepseek2")
    cfg = hf_config(path)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    model.config._attn_implementation = "eager"
    ref = model.state_dict()
    sd = {}
    for i in range(cfg.num_hidden_layers):
        for gguf_name, hf_name in mod.TENSOR_NAMES.items():
            if gguf_name.format(i=i) in tensors:
                sd[hf_name.format(i=i)] = tensors[gguf_name.format(i=i)]
        if f"blk.{i}.attn_k_b.weight" in tensors:  # the converter's split, joined back
            sd[f"model.layers.{i}.self_attn.kv_b_proj.weight"] = hf_kv_b(tensors[f"blk.{i}.attn_k_b.weight"],
                                                                        tensors[f"blk.{i}.attn_v_b.weight"])
        for hf_name, parts in mod.HF_FUSED.items():
            if parts[0].format(i=i) in tensors:
                sd[hf_name.format(i=i)] = torch.cat([tensors[p.format(i=i)] for p in parts], dim=1)  # [E, 2ff, d]
    for name, t in sd.items():
        assert name in ref and t.shape == ref[name].shape, (name, t.shape)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert all(n.endswith("e_score_correction_bias") for n in missing), missing  # only an absent bias (zeros)
    return model


@pytest.mark.parametrize("form", ["current", "legacy"])
def test_logits_match_hf(make_tiny_model, form):
    path = make_tiny_model(**(CURRENT if form == "current" else LEGACY))
    diff = compare(path)
    print(f"deepseek2 {form}: max abs logit diff vs HF = {diff:.3g}")
    assert diff <= TOL, f"deepseek2 {form}: max abs logit diff {diff} > {TOL}"


def test_the_file_is_what_llama_cpp_reads(make_tiny_model):
    """Names, shapes and keys of llama.cpp's deepseek2 loader (gguf-py's tables), MQA-form MLA."""
    import gguf

    path = make_tiny_model(**CURRENT)
    names = {t.name for t in GGUFReader(path).tensors}
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.DEEPSEEK2]}
    for n in names:
        base = n.removesuffix(".weight").removesuffix(".bias")
        generic = base if not base.startswith("blk.") else "blk.{bid}." + base.split(".", 2)[2]
        assert generic in known, n
    assert "blk.0.ffn_gate.weight" in names and "blk.0.ffn_gate_inp.weight" not in names  # dense layer 0
    assert {"blk.1.attn_k_b.weight", "blk.1.exp_probs_b.bias"} <= names and "blk.1.attn_kv_b.weight" not in names
    m = meta(path)
    assert m["deepseek2.attention.head_count_kv"] == 1 and m["deepseek2.leading_dense_block_count"] == 1
    assert m["deepseek2.attention.key_length"] == 32 + 16 and m["deepseek2.attention.key_length_mla"] == 48
    assert m["deepseek2.expert_gating_func"] == 2 and m["deepseek2.rope.scaling.type"] == "yarn"
    layout = ModelLayout(path)
    assert layout.experts.moe_layers == [1, 2] and layout.experts.n_blobs == 16
    assert layout.hparams.n_ff_shexp == layout.hparams.n_ff_exp  # one shared expert, no width key


# -- routing -----------------------------------------------------------------------------------
def reference_route(logits, bias, r: Routing):
    """Token by token, as DeepSeek-V3's description reads: groups by their top-2 biased scores."""
    E = logits.shape[1]
    per = E // max(r.n_group, 1)
    weights, ids = [], []
    for row, scores in enumerate(torch.sigmoid(logits) if r.gating == "sigmoid" else torch.softmax(logits, -1)):
        choice = [float(s) + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
        if r.n_group > 1:
            rank = sorted(range(r.n_group), key=lambda g: -sum(sorted(choice[g * per:(g + 1) * per])[-2:]))
            allowed = {e for g in rank[:r.topk_group] for e in range(g * per, (g + 1) * per)}
        else:
            allowed = set(range(E))
        picked = sorted(allowed, key=lambda e: -choice[e])[:r.top_k]
        w = [float(scores[e]) for e in picked]
        if r.norm:
            w = [x / sum(w) for x in w]
        weights.append([x * r.scale for x in w])
        ids.append(picked)
    return torch.tensor(weights), torch.tensor(ids)


@pytest.mark.parametrize("r", [Routing("sigmoid", 3, 4, 2, True, 2.5), Routing("softmax", 2, 1, 1, False, 1.0),
                               Routing("sigmoid", 4, 8, 3, False, 1.0)])
def test_routing_matches_a_plain_reference(r):
    g = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(64, 16, generator=g), 0.3 * torch.randn(16, generator=g)
    w, ids = route_grouped(logits, bias, r)
    rw, rids = reference_route(logits, bias, r)
    order, rorder = ids.sort(-1), rids.sort(-1)
    assert torch.equal(order.values, rorder.values)
    assert torch.allclose(w.gather(1, order.indices), rw.gather(1, rorder.indices), atol=1e-6)
    assert not torch.equal(ids.sort(-1).values, route_grouped(logits, None, r)[1].sort(-1).values)  # bias matters


# -- streaming -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def streamed_setup(make_tiny_model):
    path = make_tiny_model(**STREAMED)
    layout = ModelLayout(path)
    model = get_model_module("deepseek2").Model(layout.hparams, load_dense(layout, "cpu", progress=False))
    return path, layout, model


def same(a, b) -> bool:
    return a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


class Routed:
    """Observer: the layers that routed tokens (to see that dense ones never do)."""

    def __init__(self, inner=None):
        self.layers, self.inner = set(), inner

    def __getattr__(self, name):
        return getattr(self.inner, name) if self.inner is not None else (lambda *a: None)

    def routed(self, layer, ids):
        self.layers.add(layer)


def test_streamed_arena_equals_resident_bit_for_bit(streamed_setup, start_daemon):
    path, layout, model = streamed_setup
    slots = layout.experts.n_blobs // 4  # 25 % of the 24 experts
    with QuantResidentExperts(layout) as resident:
        want = generate(model.with_bank(ExpertBank(resident)), PROMPTS, 6, keep_logits=True)
    daemon = start_daemon(path, arena_slots=slots)
    with open_arena(layout, daemon.endpoint) as src:
        hook = Prefetcher(model, src, 2)  # looks 2 layers ahead from layer 0: across dense layer 1
        got = generate(model.with_bank(ExpertBank(src)), PROMPTS, 6, keep_logits=True, observer=hook)
        st = src.stats()
    assert same(got, want)
    assert st.counts.acquired > 0 and st.counts.bytes_fetched > 0 and st.prefetch.prefetch_sent > 0


def test_streamed_slot_cache_equals_resident_bit_for_bit(streamed_setup, start_daemon):
    path, layout, model = streamed_setup
    slots = layout.experts.n_blobs // 4
    with ResidentExperts(layout) as resident:
        want = generate(model.with_bank(ExpertBank(resident)), PROMPTS, 6, keep_logits=True)
    daemon = start_daemon(path)
    cache = DeviceSlotCache(layout.experts, slots)
    client = IodClient(daemon.endpoint, expect_fingerprint=layout.fingerprint.as_dict())
    with StreamedExperts(client, layout, cache, owns_client=True) as src:
        seen = Routed()
        got = generate(model.with_bank(ExpertBank(src)), PROMPTS, 6, keep_logits=True, observer=Prefetcher(model, src, 1))
        generate(model.with_bank(ExpertBank(src)), PROMPTS[:1], 1, observer=seen)
        st = src.stats().as_dict()
    assert same(got, want)
    assert st["misses"] > slots and st["cache"]["evictions"] > 0 and st["prefetch_sent"] > 0
    assert seen.layers == {2, 3}  # the dense layers 0 and 1 never route


def test_the_daemon_refuses_a_dense_layer(streamed_setup, start_daemon):
    path, _, _ = streamed_setup
    daemon = start_daemon(path, arena_slots=4)
    with IodClient(daemon.endpoint) as c:
        with pytest.raises(IodRequestError, match="layer 1 has a dense FFN"):
            c.fetch([(1, 0)])[0].result(timeout=10)
        lease = c.fetch([(2, 0)])[0].result(timeout=10)  # a MoE layer is served
        c.release(lease)


# -- unsupported variants --------------------------------------------------------------------
def _variant(tmp_path, name: str, change):
    """The tiny model written with its hparams changed by `change(hp)`; its path."""
    from moestream.authoring.gguf_write import write_moe_gguf
    from moestream.authoring.make_model import build_tensors, model_hparams

    hp = model_hparams("deepseek2", layers=2, experts=8, top_k=2, hidden=64, expert_ff=64, heads=4, kv_heads=1,
                       vocab=64)
    change(hp)
    path = tmp_path / f"{name}.gguf"
    write_moe_gguf(path, "deepseek2", hp, build_tensors("deepseek2", hp), "F32", None)
    return path


@pytest.mark.parametrize("name,change,message", [
    ("gating", lambda hp: hp["extra"].update({"expert_gating_func": 3}), "expert_gating_func=3 is not supported"),
    ("rope", lambda hp: hp["extra"].update({"rope.scaling.type": "linear"}), "rope scaling 'linear' is not supported"),
    ("groups", lambda hp: hp["extra"].update({"expert_group_count": 3}), "expert groups do not fit"),
])
def test_unsupported_variants_are_one_clear_error(tmp_path, name, change, message):
    with pytest.raises(ModelFormatError, match=message):
        load_model(ModelLayout(_variant(tmp_path, name, change)))


def test_a_file_missing_its_kv_split_names_the_tensor(tmp_path, make_tiny_model):
    from moestream.authoring.gguf_write import write_moe_gguf
    from moestream.authoring.make_model import build_tensors, model_hparams

    hp = model_hparams("deepseek2", layers=2, experts=8, top_k=2, hidden=64, expert_ff=64, heads=4, kv_heads=1,
                       vocab=64)
    tensors = build_tensors("deepseek2", hp)
    del tensors["blk.1.attn_v_b.weight"]
    write_moe_gguf(tmp_path / "m.gguf", "deepseek2", hp, tensors, "F32", None)
    with pytest.raises(ModelFormatError, match="missing tensor 'blk.1.attn_v_b.weight' required by deepseek2"):
        ModelLayout(tmp_path / "m.gguf")


# -- the command line ------------------------------------------------------------------------
def test_inspect_and_generate_resident_and_streamed_give_the_same_text(streamed_setup, start_daemon, capsys):
    """The CLI in process (its parsing, loading and error handling; a real daemon process)."""
    import json

    from moestream.cli import main

    path, layout, _ = streamed_setup
    assert main(["inspect", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "deepseek2" in shown and "first 2 layer(s) dense" in shown
    base = ["generate", "--model", str(path), "--prompt", "The quick brown fox", "-n", "8", "--json", "--no-progress"]
    assert main([*base, "--resident"]) == 0
    resident = json.loads(capsys.readouterr().out)
    daemon = start_daemon(path, arena_slots=layout.experts.n_blobs // 4)
    assert main([*base, "--iod", daemon.endpoint]) == 0
    streamed = json.loads(capsys.readouterr().out)
    assert resident["tokens"] == streamed["tokens"] and resident["text"] == streamed["text"]
    assert len(resident["tokens"][0]) == 8


def test_dense_weights_kept_quantized_decode_like_the_dequantized_ones(streamed_setup):
    """The CPU default (2-D dense weights on their Q8_0 blocks; MLA's 3-D k_b/v_b decoded at load)
    against the dequantized model, prompt and decode steps."""
    from moestream.decoder.models import load_model as load

    _, layout, model = streamed_setup
    quant = load(layout, keep_quantized=True)
    with QuantResidentExperts(layout) as experts:
        got = generate(quant.with_bank(ExpertBank(experts)), PROMPTS, 4, keep_logits=True)
        want = generate(model.with_bank(ExpertBank(experts)), PROMPTS, 4, keep_logits=True)
    for a, b in zip(got.logits, want.logits):
        assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())
