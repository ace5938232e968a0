"""The tiny-model tooling: train config, corpus split, GGUF export vs HF, trace recording and stats."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from moestream.decoder.experts.bank import ExpertBank
from moestream.common.layout import ModelLayout
from moestream.decoder.experts.source import ResidentExperts
from moestream.decoder.generation.loop import generate
from moestream.decoder.models import load_model
from moestream.authoring.tiny_corpus import (
    EXCLUDED_DIRS,
    corpus_files,
    inference_tokenizer,
    is_held_out,
    stdlib_dir,
    train_tokenizer,
)
from moestream.decoder.generation.tokenizer import GGUFTokenizer
from moestream.authoring.trace_stats import predictability, skew
from moestream.decoder.generation.traces import Recorder
from moestream.authoring.train_tiny import TrainConfig, lr_at

pytest.importorskip("transformers")


@pytest.mark.parametrize("bad,word", [(dict(hidden=100), "hidden"), (dict(heads=4, kv_heads=3), "kv-heads"),
                                      (dict(top_k=9, experts=8), "top-k"), (dict(steps=0), "steps")])
def test_train_config_rejects_bad_values(tmp_path, bad, word):
    with pytest.raises(ValueError, match=word):
        TrainConfig(out=tmp_path, **bad)


def test_lr_warms_up_then_decays_to_the_floor(tmp_path):
    cfg = TrainConfig(out=tmp_path, steps=200, warmup=20, lr=1e-3, min_lr_frac=0.1)
    lrs = [lr_at(s, cfg) for s in range(cfg.steps + 1)]
    assert lrs[0] == pytest.approx(1e-3 / 20) and lrs[19] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[19:], lrs[20:]))
    assert lrs[-1] == pytest.approx(1e-4)


def test_corpus_split_is_sorted_disjoint_and_small():
    files = corpus_files()
    if len(files) < 100:
        pytest.skip(f"too few stdlib sources under {stdlib_dir()}")
    assert files == sorted(files) and len(set(files)) == len(files)
    assert not any(EXCLUDED_DIRS.intersection(f.split("/")[:-1]) for f in files)
    held = [f for f in files if is_held_out(f)]
    assert 0.02 < len(held) / len(files) < 0.10  # sha256 mod 20: ~5 %
    assert [f for f in files if is_held_out(f)] == held  # a pure function of the path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A train_tiny run directory holding a random (untrained) small model and a real tokenizer."""
    from moestream.authoring.train_tiny import build_model

    run = tmp_path_factory.mktemp("run")
    cfg = TrainConfig(out=run, vocab=512, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=32, experts=8,
                      top_k=2, expert_ff=64, context=64)
    cfg_dict = {k: str(v) if k == "out" else v for k, v in dataclasses.asdict(cfg).items()}
    torch.manual_seed(0)
    model = build_model(cfg_dict)
    with torch.no_grad():
        for name, p in model.named_parameters():  # make every tensor matter: norms != 1, decisive routers
            if p.ndim == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5 * 3)
    (run / "config.json").write_text(json.dumps(cfg_dict))
    torch.save(model.state_dict(), run / "model.pt")
    texts = [(stdlib_dir() / f).read_text(encoding="utf-8", errors="replace") for f in corpus_files()[:30]]
    (run / "tokenizer.json").write_text(train_tokenizer(texts, 512).to_str())
    np.save(run / "heldout_ids.npy", np.random.default_rng(0).integers(0, 512, 200).astype(np.int32))
    return run, texts


def test_export_reproduces_the_hf_model_in_our_decoder(tiny_run, tmp_path):
    from moestream.authoring.export_gguf import export, max_logit_diff

    run, _ = tiny_run
    f32, q8 = export(run, tmp_path, ["F32", "Q8_0"])
    hp = ModelLayout(f32).hparams
    assert (hp.arch, hp.n_layer, hp.n_expert, hp.n_expert_used, hp.head_dim, hp.n_vocab) == ("qwen3moe", 2, 8, 2, 32, 512)
    diff, dloss = max_logit_diff(run, f32, tokens=48)
    assert diff < 1e-4 and dloss < 1e-5, (diff, dloss)
    _, dloss_q8 = max_logit_diff(run, q8, tokens=48)
    assert dloss_q8 < 0.05


def test_gguf_tokenizer_encodes_like_the_training_tokenizer(tiny_run, tmp_path):
    from moestream.authoring.export_gguf import export
    from tokenizers import Tokenizer

    run, texts = tiny_run
    (path,) = export(run, tmp_path, ["Q8_0"])
    ours = GGUFTokenizer.from_layout(ModelLayout(path))
    trained = inference_tokenizer(Tokenizer.from_file(str(run / "tokenizer.json")))
    sample = texts[0][:3000] + "\nx = 12345 + 0x1F  # déjà vu\n<|im_end|>"
    assert ours.encode(sample) == trained.encode(sample, add_special_tokens=False).ids
    assert ours.decode(ours.encode(texts[1][:2000])) == texts[1][:2000]


class _Logged(ResidentExperts):
    """Resident experts that log which experts each layer acquired."""

    def __init__(self, layout):
        super().__init__(layout)
        self.log: list[tuple[int, set[int]]] = []

    def acquire(self, layer, experts):
        self.log.append((layer, {int(e) for e in experts}))
        return super().acquire(layer, experts)


def test_recorder_sees_exactly_the_experts_the_moe_block_fetches(make_tiny_model):
    layout = ModelLayout(make_tiny_model(quant="F32", layers=3, experts=8, top_k=2))
    model, src = load_model(layout), _Logged(layout)
    rec = Recorder(model)
    with torch.inference_mode():
        generate(model.with_bank(ExpertBank(src)), [[5, 9, 31, 7, 100]], 6, observer=rec)
    real, pred = rec.arrays()
    assert real.shape == (5 + 5, 3, 2) and pred.shape == (10, 2, 3, 2)
    per_forward = [{int(e) for e in ids.flatten().tolist()} for f in rec.real for ids in f]
    assert per_forward == [experts for _, experts in src.log]
    assert (pred[:, :, 0] == -1).all() and (pred[:, 1, 1] == -1).all() and (pred[:, 0, 1] >= 0).all()


def test_trace_stats_on_known_traces():
    real = np.array([[[0, 1], [2, 3]], [[0, 1], [4, 5]], [[1, 0], [2, 3]], [[0, 1], [4, 5]]])  # [4, 2, 2]
    s0, s1 = skew(real, 8)
    assert s0["top1_share"] == 0.5 and s0["entropy_bits"] == pytest.approx(1.0) and s0["unused"] == 6
    assert s1["entropy_bits"] == pytest.approx(2.0) and s1["top_quarter_share"] == 0.5
    pred = np.full((4, 1, 2, 2), -1)
    pred[:, 0, 1] = real[:, 1]
    p = predictability(real, pred)
    assert p["by_depth"][0]["per_layer"] == {1: 1.0}
    assert p["prev_token"] == pytest.approx(0.5)  # layer 0 repeats, layer 1 alternates
    pred[:, 0, 1] = [[6, 7]] * 4
    assert predictability(real, pred)["by_depth"][0]["mean"] == 0.0
