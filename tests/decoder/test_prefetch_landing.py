"""Prefetch landing modes (eager / lazy), the prediction point, and the batched hit path."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from moestream.common.client import IodClient
from moestream.common.layout import ModelLayout
from moestream.common.spawn import spawn_daemon
from moestream.decoder.experts import ResidentExperts
from moestream.decoder.generate import generate
from moestream.decoder.models import load_model
from moestream.decoder.prefetch import Prefetcher
from moestream.decoder.sampling import SamplingParams
from moestream.decoder.slot_cache import DeviceSlotCache
from moestream.decoder.streamed import StreamedExperts

MODEL = dict(arch="qwen3moe", quant="Q8_0", layers=3, experts=8, top_k=2)
PROMPTS = [[5, 17, 99, 3, 250, 41], [7, 300]]


@pytest.fixture(scope="module")
def setup(make_tiny_model):
    path = make_tiny_model(**MODEL)
    layout = ModelLayout(path)
    with spawn_daemon(path) as daemon:
        yield layout, load_model(layout), ResidentExperts(layout), daemon.endpoint


def streamed(layout, endpoint, landing, slots=6):
    cache = DeviceSlotCache(layout.experts, slots)
    client = IodClient(endpoint, expect_fingerprint=layout.fingerprint.as_dict())
    return StreamedExperts(client, layout, cache, owns_client=True, landing=landing)


def same(got, want, experts):
    return all(torch.equal(got[e].gate, want[e].gate) and torch.equal(got[e].up, want[e].up)
               and torch.equal(got[e].down, want[e].down) for e in experts)


def test_lazy_prefetch_claims_no_slot_and_lands_on_use(setup):
    layout, _, resident, endpoint = setup
    with streamed(layout, endpoint, "lazy") as src:
        src.begin_step()
        src.prefetch(1, [2, 6])
        assert len(src.cache) == 0  # nothing evicted or claimed for a guess
        for fut in src._ahead[1].values():
            fut.result(10)
        got = src.acquire(1, [2, 6])
        assert same(got, resident.acquire(1, [2, 6]), [2, 6])
        src.release(1, [2, 6])
        st = src.stats()
        assert not src.client._held  # every lease went back
    assert st["misses"] == 0 and st["useful"] == st["hidden"] == 2 and st["prefetch_sent"] == 2
    assert st["prefetch_bytes"] == st["bytes_fetched"] > 0 and st["cache"]["pinned"] == 0
    assert st["cache"]["resident"] == 2


def test_lazy_wrong_guesses_hand_their_leases_back(setup):
    layout, _, resident, endpoint = setup
    with streamed(layout, endpoint, "lazy") as src:
        src.begin_step()
        src.prefetch(2, [0, 1])
        got = src.acquire(2, [1, 5])  # 1 joins its in-flight prefetch, 5 is a demand miss
        assert same(got, resident.acquire(2, [1, 5]), [1, 5])
        src.release(2, [1, 5])
        src.client.ping(5.0)  # a lease that arrived after its cancel has been handed back by now
        st = src.stats()
        assert not src.client._held
    assert st["useful"] == 1 and st["misses"] == 1 and st["wasted"] + st["cancelled"] == 1
    assert st["cache"]["resident"] == 2 and st["cache"]["pinned"] == 0


def test_compute_thread_takes_over_a_landing_the_receiver_has_not_started(setup):
    layout, _, resident, endpoint = setup
    with streamed(layout, endpoint, "eager") as src:
        real, held = src.receiver._queue, queue.SimpleQueue()
        src.receiver._queue = held  # the receiver thread never hears of this prefetch
        src.begin_step()
        src.prefetch(0, [3])
        writers = []
        real_write = src.cache.write
        src.cache.write = lambda key, parts: (writers.append(threading.current_thread().name), real_write(key, parts))
        got = src.acquire(0, [3])
        assert same(got, resident.acquire(0, [3]), [3])
        src.release(0, [3])
        src.receiver._queue = real
        while not held.empty():
            real.put(held.get())  # the receiver now sees it taken and skips it
        assert src.receiver.drain(10.0)
        st = src.stats()
    assert writers == ["MainThread"] and st["landed_by_compute"] == 1 and st["useful"] == 1
    assert st["cache"]["pinned"] == 0 and st["prefetch_sent"] == st["useful"]


@pytest.mark.parametrize("landing", ["eager", "lazy"])
@pytest.mark.parametrize("at", ["layer", "attention"])
def test_every_landing_and_prediction_point_is_bit_identical(setup, landing, at):
    layout, model, resident, endpoint = setup
    sampling = SamplingParams(temperature=1.0, seed=3)
    want = generate(model, resident, PROMPTS, 6, sampling, keep_logits=True)
    with streamed(layout, endpoint, landing) as src:
        hook = Prefetcher(model, src, 1, at=at)
        got = generate(model, src, PROMPTS, 6, sampling, after_layer=hook, keep_logits=True)
        src.close()
        st = src.stats()
    assert got.tokens == want.tokens and all(torch.equal(g, w) for g, w in zip(got.logits, want.logits))
    assert st["prefetch_sent"] > 0 and st["useful"] > 0 and st["cache"]["pinned"] == 0
    assert st["prefetch_sent"] == st["useful"] + st["wasted"] + st["cancelled"]
    assert not src.client._held


def test_attention_point_hints_are_sent_after_the_layer_pins_its_own(setup):
    layout, model, _, _ = setup
    calls = []

    class Source(ResidentExperts):
        def acquire(self, layer, experts):
            calls.append(("acquire", layer))
            return super().acquire(layer, experts)

        def prefetch_ahead(self, predictions, before=None):
            calls.append(("hint", before, sorted(predictions)))

    hook = Prefetcher(model, Source(layout), 2, at="attention")
    model.forward(torch.tensor([[5, 17, 99]]), model.new_cache(1, 4), hook.source, after_layer=hook)
    assert calls == [("hint", 0, [1, 2]), ("acquire", 0), ("hint", 1, [2]), ("acquire", 1), ("acquire", 2)]


def test_pin_present_counts_and_pins_under_one_call(setup):
    layout = setup[0]
    cache = DeviceSlotCache(layout.experts, 4)
    cache.claim((0, 1))
    cache.unpin((0, 1))
    present, missing = cache.pin_present(0, [1, 2])
    assert list(present) == [1] and missing == [2]
    assert cache.policy.pin_count((0, 1)) == 1 and cache.policy.hits == 1 and cache.policy.misses == 1
    cache.release_many(0, [1])
    assert cache.policy.pin_count((0, 1)) == 0
    cache.check()
