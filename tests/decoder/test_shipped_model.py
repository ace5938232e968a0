"""The trained tiny qwen3moe shipped in `src/moestream/data/`, and its routing traces.

The loss check computes both numbers here, nothing is copied from the model card: the model's
next-token loss on held-out stdlib files (the split the training script never trained on)
against a unigram model fitted to a slice of the training files, both on the same tokens.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from moestream.decoder.experts.bank import ExpertBank
from moestream.common.client import IodClient
from moestream.common.layout import ModelLayout
from moestream.common.traces import load_trace
from moestream.tools.spawn import spawn_daemon
from moestream.decoder.experts.source import ResidentExperts
from moestream.decoder.generation.loop import generate, forward_step
from moestream.decoder.models import load_model
from moestream.decoder.experts.prefetch import Prefetcher
from moestream.decoder.experts.gpu.slot_cache import DeviceSlotCache
from moestream.decoder.experts.gpu.streamed import StreamedExperts
from moestream.authoring.tiny_corpus import (
    corpus_files,
    is_held_out,
    stdlib_dir,
    unigram_loss,
)
from moestream.decoder.generation.tokenizer import GGUFTokenizer

import moestream

DATA = Path(moestream.__file__).parent / "data"
MODEL = DATA / "tiny-qwen3moe-q8_0.gguf"
TRACES = DATA / "traces"
PROMPT = "import os\nimport sys\n\ndef main("
WINDOWS, WINDOW = 4, 128


@pytest.fixture(scope="module")
def shipped():
    if not MODEL.is_file():
        pytest.fail(f"{MODEL} is missing: the package must ship the trained model")
    layout = ModelLayout(MODEL)
    with ResidentExperts(layout) as experts:
        yield layout, load_model(layout), experts, GGUFTokenizer.from_layout(layout)


def test_shipped_model_is_a_small_trained_qwen3moe(shipped):
    layout, _, _, tok = shipped
    hp = layout.hparams
    assert hp.arch == "qwen3moe" and hp.n_expert >= 16 and hp.n_layer >= 4
    assert layout.quant_types().keys() <= {"Q8_0", "F32"}
    assert MODEL.stat().st_size < 15 * 2**20
    assert tok.vocab_size == hp.n_vocab and tok.encode("<|im_end|>") == [tok.eos_id]


def test_resident_greedy_generation_produces_text(shipped):
    _, model, experts, tok = shipped
    with torch.inference_mode():
        res = generate(model.with_bank(ExpertBank(experts)), [tok.encode(PROMPT)], 24)
    text = tok.decode(res.tokens[0])
    assert len(res.tokens[0]) >= 8 and len(set(res.tokens[0])) >= 4, f"degenerate output {text!r}"
    assert text.strip() and all(c.isprintable() or c in "\n\t" for c in text), f"not text: {text!r}"


def _heldout_windows(tok) -> torch.Tensor:
    """WINDOWS token windows of WINDOW+1 tokens, from held-out files in sorted order."""
    root, rels = stdlib_dir(), [r for r in corpus_files() if is_held_out(r)]
    ids: list[int] = []
    for rel in rels:
        ids += tok.encode((root / rel).read_text(encoding="utf-8", errors="replace"))
        if len(ids) > WINDOWS * (WINDOW + 1):
            break
    if len(ids) <= WINDOWS * (WINDOW + 1):
        pytest.skip(f"too few held-out stdlib sources under {root}")
    return torch.tensor(ids[: WINDOWS * (WINDOW + 1)]).view(WINDOWS, WINDOW + 1)  # [W, T+1]


def _train_unigram_ids(tok, max_bytes: int = 400_000) -> np.ndarray:
    """Token ids of every 8th training file, up to `max_bytes` of source."""
    root, rels = stdlib_dir(), [r for r in corpus_files() if not is_held_out(r)][::8]
    texts, total = [], 0
    for rel in rels:
        texts.append((root / rel).read_text(encoding="utf-8", errors="replace"))
        total += len(texts[-1])
        if total > max_bytes:
            break
    return np.asarray([i for t in texts for i in tok.encode(t)], dtype=np.int64)


def test_heldout_loss_is_clearly_below_unigram(shipped):
    layout, model, experts, tok = shipped
    win = _heldout_windows(tok)  # [W, T+1]
    with torch.inference_mode():
        logits = forward_step(model.with_bank(ExpertBank(experts)), win[:, :-1], model.new_cache(WINDOWS, WINDOW))  # [W, T, V]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), win[:, 1:].flatten()).item()
    unigram = unigram_loss(_train_unigram_ids(tok), win[:, 1:].flatten().numpy(), layout.hparams.n_vocab)
    print(f"held-out loss {loss:.3f} nats/token, unigram {unigram:.3f}")
    assert loss < unigram - 1.5, f"held-out loss {loss:.3f} is not clearly below the unigram {unigram:.3f}"


def test_streamed_decoding_gives_identical_tokens(shipped):
    layout, model, experts, tok = shipped
    prompts = [tok.encode(PROMPT), tok.encode("import os\nimport sys\n")]
    with torch.inference_mode():
        want = generate(model.with_bank(ExpertBank(experts)), prompts, 12)
    with spawn_daemon(MODEL) as daemon:
        cache = DeviceSlotCache(layout.experts, layout.hparams.n_layer * layout.hparams.n_expert // 4)
        client = IodClient(daemon.endpoint, expect_fingerprint=layout.fingerprint.as_dict())
        with StreamedExperts(client, layout, cache, owns_client=True) as src, torch.inference_mode():
            got = generate(model.with_bank(ExpertBank(src)), prompts, 12, observer=Prefetcher(model, src, 1))
            stats = src.stats().as_dict()
    assert got.tokens == want.tokens
    assert stats["misses"] > 0 and stats["cache"]["evictions"] > 0


def test_traces_parse_and_match_the_model(shipped):
    layout, _, _, _ = shipped
    hp = layout.hparams
    meta = json.loads((TRACES / "meta.json").read_text())
    assert meta["model"] == MODEL.name
    assert meta["model_sha256"] == hashlib.sha256(MODEL.read_bytes()).hexdigest(), "traces are of another file"
    real, decode = np.load(TRACES / "routing.npy"), np.load(TRACES / "decode.npy")
    pred = np.load(TRACES / "predicted.npy")
    assert real.shape == (meta["tokens"], hp.n_layer, hp.n_expert_used) and real.shape[0] >= 2000
    assert decode.shape == (meta["decode_tokens"], hp.n_layer, hp.n_expert_used)
    assert pred.shape == (meta["tokens"], hp.n_layer - 1, hp.n_layer, hp.n_expert_used)
    assert real.min() >= 0 and real.max() < hp.n_expert and pred.max() < hp.n_expert
    for row in real[:50]:  # top-k ids of one token and layer are distinct
        assert all(len(set(r)) == hp.n_expert_used for r in row)
    steps = load_trace(TRACES / "routing.npy")
    assert len(steps) == meta["tokens"] and len(steps[0]) == hp.n_layer * hp.n_expert_used
    assert sum(s["prompt"] + s["generated"] for s in meta["segments"]) == meta["tokens"]
    assert (TRACES / "REPORT.md").read_text().startswith("# Routing traces")
