"""One tiny-model runner for every architecture in the decoder's registry.

Each architecture gets, for free: output shape and dtype, the KV-cache path (incremental
decode == one full forward), a left-padded batch == each sequence alone, the `after_layer`
hook and `router_logits`, and the MoE block's contract with its `ExpertBank` (one `mix` per layer
with the routed ids, pads never routed).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from moestream.decoder.experts.bank import ExpertBank
from moestream.decoder.generation.loop import forward_step
from moestream.common.layout import ModelLayout
from moestream.decoder.experts.source import ExpertBackend, ResidentExperts
from moestream.decoder.models import architectures, load_model
from moestream.decoder.models.moe_transformer import OnLayer

T = 12


class Recording(ExpertBackend):
    """Wraps a source and records the calls the model makes."""

    def __init__(self, inner: ExpertBackend):
        self.inner, self.calls = inner, []

    def begin_step(self):
        self.calls.append(("step",))

    def mix(self, layer, x, weights, ids):
        assert x.shape[0] == weights.shape[0] == ids.shape[0] and weights.shape == ids.shape
        self.calls.append(("mix", layer, tuple(sorted(set(ids.flatten().tolist()))), x.shape[0]))
        return self.inner.mix(layer, x, weights, ids)


@pytest.fixture(scope="module", params=architectures())
def arch_model(request, make_tiny_model):
    path = make_tiny_model(arch=request.param, quant="F32")
    layout = ModelLayout(path)
    return layout, load_model(layout), ResidentExperts(layout)


def rows_per_token(layout) -> int:
    """Rows a token is in a `mix`: one, or one per routed expert where the weight scales the input (Llama 4)."""
    return layout.hparams.n_expert_used if layout.spec.weight_on_input else 1


def tokens(layout, batch, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, layout.hparams.n_vocab, (batch, length), generator=g)  # [B, T]


@torch.inference_mode()
def test_shape_dtype_and_source_contract(arch_model):
    layout, model, experts = arch_model
    hp, rec = layout.hparams, Recording(experts)
    seen = []
    logits = forward_step(model.with_bank(ExpertBank(rec)), tokens(layout, 2, T), model.new_cache(2, T),
                           observer=OnLayer(lambda i, h: seen.append((i, tuple(h.shape)))))
    assert logits.shape == (2, T, hp.n_vocab) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert seen == [(i, (2 * T, hp.n_embd)) for i in range(hp.n_layer)]
    mixes = [c for c in rec.calls if c[0] == "mix"]
    moe_layers = [i for i in range(hp.n_layer) if hp.is_moe_layer(i)]  # (DeepSeek's leading layers are dense)
    assert [c[1] for c in mixes] == moe_layers and all(c[3] == 2 * T * rows_per_token(layout) for c in mixes)
    assert rec.calls[0] == ("step",)
    h = torch.randn(3, hp.n_embd)
    assert model.router_logits(moe_layers[0], h).shape == (3, hp.n_expert)


@torch.inference_mode()
def test_cache_path_matches_full_forward(arch_model):
    layout, model, experts = arch_model
    seq = tokens(layout, 2, T, seed=1)
    full = forward_step(model.with_bank(ExpertBank(experts)), seq, model.new_cache(2, T))  # [2, T, V]
    cache = model.new_cache(2, T)
    parts = [forward_step(model.with_bank(ExpertBank(experts)), seq[:, :5], cache)]
    parts += [forward_step(model.with_bank(ExpertBank(experts)), seq[:, t:t + 1], cache) for t in range(5, T)]
    inc = torch.cat(parts, dim=1)  # [2, T, V]
    assert (inc - full).abs().max().item() < 1e-4
    assert torch.equal(inc.argmax(-1), full.argmax(-1))


@torch.inference_mode()
def test_padded_batch_matches_each_sequence_alone(arch_model):
    layout, model, experts = arch_model
    a, b = tokens(layout, 1, T, seed=2), tokens(layout, 1, 5, seed=3)
    batch = torch.zeros(2, T, dtype=torch.int64)
    batch[0], batch[1, T - 5:] = a[0], b[0]
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, :T - 5] = False
    rec = Recording(experts)
    out = forward_step(model.with_bank(ExpertBank(rec)), batch, model.new_cache(2, T + 1), valid=valid)  # [2, T, V]
    alone_a = forward_step(model.with_bank(ExpertBank(experts)), a, model.new_cache(1, T))
    alone_b = forward_step(model.with_bank(ExpertBank(experts)), b, model.new_cache(1, 5))
    assert (out[0] - alone_a[0]).abs().max().item() < 1e-4
    assert (out[1, T - 5:] - alone_b[0]).abs().max().item() < 1e-4
    assert all(c[3] == (T + 5) * rows_per_token(layout) for c in rec.calls if c[0] == "mix")  # pads never reach experts


@torch.inference_mode()
def test_pads_are_not_routed(arch_model):
    layout, model, experts = arch_model
    hp = layout.hparams
    rec = Recording(experts)
    valid = torch.zeros(1, 4, dtype=torch.bool)
    valid[0, -1] = True  # one real token: each layer routes exactly top_k experts
    forward_step(model.with_bank(ExpertBank(rec)), tokens(layout, 1, 4), model.new_cache(1, 4), valid=valid)
    mixes = [c for c in rec.calls if c[0] == "mix"]
    n_moe = sum(hp.is_moe_layer(i) for i in range(hp.n_layer))
    assert len(mixes) == n_moe and all(len(c[2]) == hp.n_expert_used and c[3] == rows_per_token(layout) for c in mixes)


@torch.inference_mode()
def test_bfloat16_runs(arch_model):
    layout, _, _ = arch_model
    model = load_model(layout, dtype=torch.bfloat16)
    experts = ResidentExperts(layout, dtype=torch.bfloat16)
    logits = forward_step(model.with_bank(ExpertBank(experts)), tokens(layout, 2, 4), model.new_cache(2, 4))
    assert logits.dtype == torch.bfloat16 and logits.shape == (2, 4, layout.hparams.n_vocab)
    assert torch.isfinite(logits.float()).all()


@torch.inference_mode()
def test_shared_expert_gate_as_the_converter_writes_it_decodes_the_same(tmp_path):
    """ggml [d, 1] (convert_hf_to_gguf.py) and [d] (squeezed) shared-expert gates: same logits."""
    from moestream.authoring import make_model as mm
    from moestream.authoring.gguf_write import write_moe_gguf

    hp = mm.model_hparams("qwen2moe", layers=2, experts=4, top_k=2, hidden=64, expert_ff=64, heads=4,
                          kv_heads=2, vocab=300)
    tensors = mm.build_tensors("qwen2moe", hp)
    logits = []
    for i, shape in enumerate([(64,), (1, 64)]):
        for layer in range(2):
            name = f"blk.{layer}.ffn_gate_inp_shexp.weight"
            tensors[name] = np.asarray(tensors[name]).reshape(shape)
        write_moe_gguf(tmp_path / f"{i}.gguf", "qwen2moe", hp, tensors, "F32", None)
        layout = ModelLayout(tmp_path / f"{i}.gguf")
        model = load_model(layout)
        with ResidentExperts(layout) as experts:
            logits.append(forward_step(model.with_bank(ExpertBank(experts)), torch.tensor([[3, 1, 4, 1, 5]]), model.new_cache(1, 5)))
    assert torch.equal(logits[0], logits[1])
