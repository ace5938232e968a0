"""A split model decodes as its single file does: dense weights and resident experts from the
parts' maps (gate, up and down of one expert in three parts), and streamed through a real daemon
that reads the parts == resident, bit for bit, on the CPU arena path and the device slot cache."""

from __future__ import annotations

import pytest
import torch
from moestream.decoder.experts.bank import ExpertBank
from moestream.authoring.make_model import make_model
from moestream.common.client import IodClient
from moestream.common.layout import ModelLayout
from moestream.decoder.experts.arena import open_arena
from moestream.decoder.experts.prefetch import Prefetcher
from moestream.decoder.experts.resident import QuantResidentExperts
from moestream.decoder.experts.gpu.slot_cache import DeviceSlotCache
from moestream.decoder.experts.source import ResidentExperts
from moestream.decoder.experts.gpu.streamed import StreamedExperts
from moestream.decoder.generation.loop import generate
from moestream.decoder.models import get_model_module
from moestream.decoder.models.weights import load_dense

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9], [400, 2, 33]]
N_NEW = 6
MODEL = dict(arch="qwen3moe", quant="Q8_0", layers=3, experts=8, top_k=2, seed=11)


class Model:
    def __init__(self, path):
        self.path, self.layout = path, ModelLayout(path)
        hp = self.layout.hparams
        self.dense = load_dense(self.layout, "cpu", progress=False)
        self.model = get_model_module(hp.arch).Model(hp, self.dense)

    def run(self, source, hook=None):
        return generate(self.model.with_bank(ExpertBank(source)), PROMPTS, N_NEW, keep_logits=True, observer=hook)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("split-decode")
    (root / "one").mkdir()
    (root / "parts").mkdir()
    single = Model(make_model(root / "one" / "m.gguf", **MODEL))
    split = Model(make_model(root / "parts" / "m.gguf", split_max_size=40_000, **MODEL))
    assert len(split.layout.files) >= 5
    assert all(len({p.file for p in split.layout.experts.parts(layer, 0)}) == 3 for layer in range(3))
    return single, split


def same_run(a, b) -> bool:
    return a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_dense_weights_and_resident_experts_equal_the_single_files(pair):
    single, split = pair
    assert single.dense.keys() == split.dense.keys()
    for name, w in single.dense.items():
        assert torch.equal(w, split.dense[name]), name
    with QuantResidentExperts(single.layout) as a, QuantResidentExperts(split.layout) as b:
        assert same_run(split.run(b), single.run(a))  # the kernels read gate/up/down from three maps
    with ResidentExperts(single.layout) as a, ResidentExperts(split.layout) as b:
        assert same_run(split.run(b), single.run(a))  # raw slots packed from three parts or from one file


@pytest.mark.parametrize("depth", [0, 2])
def test_streamed_from_the_arena_equals_resident(pair, start_daemon, depth):
    _, split = pair
    with QuantResidentExperts(split.layout) as resident:
        want = split.run(resident)
    daemon = start_daemon(split.path, arena_slots=6)
    with open_arena(split.layout, daemon.endpoint) as src:
        got = split.run(src, Prefetcher(split.model, src, depth) if depth else None)
        st = src.stats()
    assert same_run(got, want) and st.counts.bytes_fetched > 0


def test_streamed_into_the_slot_cache_equals_resident(pair, start_daemon):
    _, split = pair
    with ResidentExperts(split.layout) as resident:
        want = split.run(resident)
    daemon = start_daemon(split.path, arena_slots=8)
    cache = DeviceSlotCache(split.layout.experts, 6)
    client = IodClient(daemon.endpoint, expect_fingerprint=split.layout.fingerprint.as_dict())
    with StreamedExperts(client, split.layout, cache, owns_client=True) as src:
        got = split.run(src, Prefetcher(split.model, src, 1))
        src.close()
    assert same_run(got, want)


def test_the_served_name_is_the_models_not_the_parts(pair):
    from moestream.decoder.serve.config import ServeConfig

    _, split = pair
    assert ServeConfig(model=str(split.layout.files[2].path), resident=True).model_id == "m"
