"""Prefetch: router look-ahead predictions, landing modes (eager / lazy) and prediction points,
accounting, failures, and the batched hit path."""

from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest
import torch
from moestream.decoder.experts.bank import ExpertBank
from moestream.common.client import IodClient, IodRequestError
from moestream.common.layout import ModelLayout
from moestream.tools.spawn import spawn_daemon
from moestream.decoder.experts.source import ResidentExperts
from moestream.decoder.generation.loop import generate, forward_step
from moestream.decoder.models import load_model
from moestream.decoder.models.moe_transformer import OnLayer
from moestream.decoder.experts.prefetch import Prefetcher
from moestream.decoder.generation.sampling import SamplingParams
from moestream.decoder.experts.gpu.slot_cache import DeviceSlotCache
from moestream.decoder.experts.gpu.streamed import StreamedExperts

MODEL = dict(arch="qwen3moe", quant="Q8_0", layers=3, experts=8, top_k=2)
PROMPTS = [[5, 17, 99, 3, 250, 41], [7, 300]]


def same(got, want, experts):
    return all(torch.equal(got[e].gate, want[e].gate) and torch.equal(got[e].up, want[e].up)
               and torch.equal(got[e].down, want[e].down) for e in experts)


@pytest.fixture(scope="module")
def setup(make_tiny_model):
    path = make_tiny_model(**MODEL)
    layout = ModelLayout(path)
    with spawn_daemon(path) as daemon:
        yield layout, load_model(layout), ResidentExperts(layout), daemon.endpoint


def streamed(layout, endpoint, landing="eager", slots=6, wrap=None):
    cache = DeviceSlotCache(layout.experts, slots)
    client = IodClient(endpoint, expect_fingerprint=layout.fingerprint.as_dict())
    return StreamedExperts(wrap(client) if wrap else client, layout, cache, owns_client=True, landing=landing)


class Hints(ResidentExperts):
    def __init__(self, layout):
        super().__init__(layout)
        self.hints: list[tuple[int, list[int]]] = []

    def prefetch_ahead(self, predictions, defer=False, if_cached=None):
        self.hints += [(layer, list(experts)) for layer, experts in predictions.items()]


def reference_topk(model, layer, h, k):
    """ffn_norm (RMSNorm written out here) then the router, softmax, top-k: the experts to expect."""
    w = model.layers[layer]
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + model.hparams.rms_eps) * w["ffn_norm"]
    probs = torch.softmax(x @ w["ffn_gate_inp"].T, dim=-1)  # [n, E]
    return sorted(set(torch.topk(probs, k, dim=-1).indices.flatten().tolist()))


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetcher_hints_the_next_layers_top_k(setup, depth):
    layout, model, _, _ = setup
    src = Hints(layout)
    hook = Prefetcher(model, src, depth)
    seen = []
    cache = model.new_cache(1, 8)
    forward_step(model.with_bank(ExpertBank(src)), torch.tensor([[5, 17, 99, 3]]), cache,
                  observer=OnLayer(lambda i, h: (seen.append(h.clone()), hook.after_layer(i, h))))
    want = [(nxt, reference_topk(model, nxt, seen[layer], 2))
            for layer in range(3) for nxt in range(layer + 1, min(layer + 1 + depth, 3))]
    assert src.hints == want
    assert hook.predictions == sum(len(e) for _, e in want)


def test_prefetcher_rejects_a_bad_depth(setup):
    with pytest.raises(ValueError, match="prefetch depth"):
        Prefetcher(setup[1], None, -1)


def test_prefetches_land_on_the_receiver_thread(setup):
    layout, _, resident, endpoint = setup
    writers = {}
    with streamed(layout, endpoint) as src:
        real_write = src.cache.write

        def write(key, parts):
            writers[key] = threading.current_thread().name
            real_write(key, parts)

        src.cache.write = write
        src.begin_step()
        src.prefetch(1, [2, 6])
        assert src.receiver.drain(10.0)
        got = src.acquire(1, [2, 6])
        want = resident.acquire(1, [2, 6])
        assert same(got, want, (2, 6))
        src.release(1, [2, 6])
        st = src.stats().as_dict()
    assert writers == {(1, 2): "moestream-receiver", (1, 6): "moestream-receiver"}
    assert st["misses"] == 0 and st["useful"] == st["hidden"] == 2 and st["hidden_share"] == 1.0
    assert st["hits"] == 0  # a prefetched expert counts as useful, not as a hit
    assert st["prefetch_bytes"] == st["bytes_fetched"] > 0 and st["cache"]["pinned"] == 0


def test_wrong_predictions_are_counted_and_unpinned(setup):
    layout, _, _, endpoint = setup
    with streamed(layout, endpoint) as src:
        src.begin_step()
        src.prefetch(2, [0, 1])
        src.acquire(2, [1, 5])
        src.release(2, [1, 5])
        assert src.receiver.drain(10.0)
        st = src.stats().as_dict()
        src.acquire(2, [1, 5])  # both resident now, nothing prefetched: two plain hits
        src.release(2, [1, 5])
        again = src.stats().as_dict()
    assert st["hits"] == 0 and again["hits"] == 2 and again["acquired"] == 4 and again["hit_rate"] == 0.5
    assert st["prefetch_sent"] == 2 and st["useful"] == 1 and st["wasted"] + st["cancelled"] == 1
    assert st["misses"] == 1 and st["predicted"] == 2 and st["predicted_right"] == 1
    assert st["prefetch_precision"] == 0.5 and st["cache"]["pinned"] == 0


class HeldAhead:
    """The real client, except that the answers to `ahead` fetches are held back until the
    test passes them on (`pass_on`) or fails them (`fail`); with `send=False` those fetches
    never reach the daemon."""

    def __init__(self, send=True):
        self.client, self.send, self.held = None, send, []  # (the real future, the one handed out)

    def wrap(self, client):
        self.client = client
        return self

    def fetch(self, keys, priority="now", uses=None):
        if priority != "ahead":
            return self.client.fetch(keys, priority, uses)
        real = self.client.fetch(keys, priority) if self.send else [None] * len(keys)
        out = [cf.Future() for _ in keys]
        self.held += zip(real, out)
        return out

    def pass_on(self):
        for real, out in self.held:
            out.set_result(real.result(10))

    def fail(self, error):
        for _, out in self.held:
            out.set_exception(error)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_failed_prefetch_is_fetched_again_on_demand(setup):
    layout, _, resident, endpoint = setup
    held = HeldAhead(send=False)
    with streamed(layout, endpoint, wrap=held.wrap) as src:
        src.begin_step()
        src.prefetch(0, [4])
        assert (0, 4) in src.cache and not src.cache.wait((0, 4), timeout=0)  # claimed, in flight
        boom = threading.Timer(0.2, lambda: held.fail(IodRequestError("read_failed", "boom")))
        boom.start()
        got = src.acquire(0, [4])  # waits on the in-flight prefetch, which fails, then fetches now
        boom.join()
        assert torch.equal(got[4].up, resident.acquire(0, [4])[4].up)
        src.release(0, [4])
        st = src.stats().as_dict()
    assert st["refetched"] == 1 and st["misses"] == 1 and st["cache"]["pinned"] == 0


def test_every_prefetch_is_judged_in_a_real_decode(setup):
    layout, model, _, endpoint = setup
    with streamed(layout, endpoint) as src:
        hook = Prefetcher(model, src, 1)
        generate(model.with_bank(ExpertBank(src)), [[5, 17, 99, 3, 250], [7, 300]], 12, SamplingParams(temperature=1.0, seed=1),
                 observer=hook)
        assert src.receiver.drain(10.0)  # a wasted prefetch still landing holds its slot until it lands
        st = src.stats().as_dict()
    assert st["prefetch_sent"] > 0 and st["hidden"] > 0
    assert st["prefetch_sent"] == st["useful"] + st["wasted"] + st["cancelled"]
    assert 0 < st["hidden_share"] <= 1 and st["useful"] == st["hidden"] + st["late"]
    assert st["cache"]["pinned"] == 0


def test_lazy_prefetch_claims_no_slot_and_lands_on_use(setup):
    layout, _, resident, endpoint = setup
    with streamed(layout, endpoint, "lazy") as src:
        src.begin_step()
        src.prefetch(1, [2, 6])
        assert len(src.cache) == 0  # nothing evicted or claimed for a guess
        assert src.ahead.wait_answered(10.0)  # both leases are in the arena
        got = src.acquire(1, [2, 6])
        assert same(got, resident.acquire(1, [2, 6]), [2, 6])
        src.release(1, [2, 6])
        st = src.stats().as_dict()
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
        st = src.stats().as_dict()
        assert not src.client._held
    assert st["useful"] == 1 and st["misses"] == 1 and st["wasted"] + st["cancelled"] == 1
    assert st["cache"]["resident"] == 2 and st["cache"]["pinned"] == 0


def test_compute_thread_takes_over_a_landing_the_receiver_has_not_started(setup):
    layout, _, resident, endpoint = setup
    held = HeldAhead()
    with streamed(layout, endpoint, "eager", wrap=held.wrap) as src:
        src.begin_step()
        src.prefetch(0, [3])  # the receiver hears of its lease only once the test passes it on
        writers = []
        real_write = src.cache.write
        src.cache.write = lambda key, parts: (writers.append(threading.current_thread().name), real_write(key, parts))
        later = threading.Timer(0.2, held.pass_on)
        later.start()
        got = src.acquire(0, [3])  # takes the landing over, then waits for the lease
        later.join()
        assert same(got, resident.acquire(0, [3]), [3])
        src.release(0, [3])
        assert src.receiver.drain(10.0)  # the receiver saw it taken and skipped it
        st = src.stats().as_dict()
    assert writers == ["MainThread"] and st["landed_by_compute"] == 1 and st["useful"] == 1
    assert st["cache"]["pinned"] == 0 and st["prefetch_sent"] == st["useful"]


@pytest.mark.parametrize("landing", ["eager", "lazy"])
@pytest.mark.parametrize("at", ["layer", "attention"])
def test_every_landing_and_prediction_point_is_bit_identical(setup, landing, at):
    layout, model, resident, endpoint = setup
    sampling = SamplingParams(temperature=1.0, seed=3)
    want = generate(model.with_bank(ExpertBank(resident)), PROMPTS, 6, sampling, keep_logits=True)
    with streamed(layout, endpoint, landing) as src:
        hook = Prefetcher(model, src, 1, at=at)
        got = generate(model.with_bank(ExpertBank(src)), PROMPTS, 6, sampling, observer=hook, keep_logits=True)
        src.close()
        st = src.stats().as_dict()
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

        def prefetch_ahead(self, predictions, defer=False, if_cached=None):
            calls.append(("hint", defer, sorted(predictions)))

    hook = Prefetcher(model, Source(layout), 2, at="attention")
    forward_step(model.with_bank(ExpertBank(hook.bank)), torch.tensor([[5, 17, 99]]), model.new_cache(1, 4), observer=hook)
    assert calls == [("hint", True, [1, 2]), ("acquire", 0), ("hint", True, [2]), ("acquire", 1), ("acquire", 2)]


def test_prefetch_stays_within_the_daemons_lease_quota_beside_another_client(make_tiny_model, start_daemon):
    """With another client connected, a decoder holding lazy prefetch leases past its quota would
    wait on its own demand until `deadline`: prefetches stay within the quota the welcome carries."""
    path = make_tiny_model(arch="qwen3moe", quant="Q8_0", layers=4, experts=16, top_k=2)
    layout = ModelLayout(path)
    model, resident = load_model(layout), ResidentExperts(layout)
    d = start_daemon(path, arena_slots=9, extra_args=["--queue-deadline", "2"])  # quota 4 of 9
    want = generate(model.with_bank(ExpertBank(resident)), PROMPTS, 8, keep_logits=True)
    with IodClient(d.endpoint, name="other"), streamed(layout, d.endpoint, "lazy", slots=16) as src:
        assert src.client.lease_quota == 4 and src.ahead.max_in_flight == 2
        got = generate(model.with_bank(ExpertBank(src)), PROMPTS, 8, observer=Prefetcher(model, src, 3), keep_logits=True)
        st = src.stats().as_dict()
    assert got.tokens == want.tokens and st["prefetch_sent"] > 0
