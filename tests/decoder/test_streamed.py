"""Streamed experts against a real moestream-iod process: bit-identical to resident decoding."""

from __future__ import annotations

import pytest
import torch
from moestream.decoder.experts.bank import ExpertBank
from moestream.common.client import IodClient, IodUnavailable
from moestream.common.layout import ModelLayout
from moestream.common.policy import SlotPolicy
from moestream.tools.spawn import spawn_daemon
from moestream.decoder.experts.source import ResidentExperts
from moestream.decoder.generation.loop import generate
from moestream.decoder.models import get_model_module
from moestream.decoder.experts.prefetch import Prefetcher
from moestream.decoder.generation.sampling import SamplingParams
from moestream.decoder.experts.gpu.slot_cache import DeviceSlotCache
from moestream.decoder.experts.gpu.streamed import StreamedExperts, open_streamed
from moestream.decoder.models.weights import load_dense
from policy_check import CheckedPolicy

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9], [400, 2, 33]]
N_NEW = 8
MODEL = dict(arch="qwen3moe", layers=3, experts=8, top_k=2)  # 24 experts: 6 slots is 25 %
SHAPES = {"Q4_K": dict(layers=2)}  # K-quants are 256 wide and slow to dequantize on a CPU: 16 experts


class Bench:
    """One model, its layout, dense weights, resident reference run, and a lazily started daemon."""

    def __init__(self, path):
        self.path, self.layout = path, ModelLayout(path)
        hp = self.layout.hparams
        self.model = get_model_module(hp.arch).Model(hp, load_dense(self.layout, "cpu", progress=False))
        self.n_experts = hp.n_layer * hp.n_expert
        with ResidentExperts(self.layout) as resident:
            self.reference = generate(self.model.with_bank(ExpertBank(resident)), PROMPTS, N_NEW, keep_logits=True)
        self._daemon = None

    @property
    def endpoint(self) -> str:
        if self._daemon is None:
            self._daemon = spawn_daemon(self.path)
        return self._daemon.endpoint

    def stop(self) -> None:
        if self._daemon is not None:
            assert self._daemon.stop() == 0
            self._daemon = None


@pytest.fixture(scope="module")
def benches(make_tiny_model):
    made: dict[str, Bench] = {}

    def get(quant: str) -> Bench:
        if quant not in made:
            made[quant] = Bench(make_tiny_model(quant=quant, **{**MODEL, **SHAPES.get(quant, {})}))
        return made[quant]

    yield get
    for b in made.values():
        b.stop()


def run_streamed(b: Bench, slots: int, depth: int, sampling=SamplingParams(),
                 policy: SlotPolicy | None = None, n_new: int = N_NEW):
    cache = DeviceSlotCache(b.layout.experts, slots, policy=policy)
    client = IodClient(b.endpoint, expect_fingerprint=b.layout.fingerprint.as_dict())
    with StreamedExperts(client, b.layout, cache, owns_client=True) as src:
        hook = Prefetcher(b.model, src, depth) if depth else None
        result = generate(b.model.with_bank(ExpertBank(src)), PROMPTS, n_new, sampling, observer=hook, keep_logits=True)
        src.close()
        return result, src.stats().as_dict()


@pytest.mark.parametrize("quant", ["F32", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("depth", [0, 1])
def test_streamed_is_bit_identical_to_resident(benches, quant, depth):
    b = benches(quant)
    slots = b.n_experts // 4
    result, st = run_streamed(b, slots, depth)
    assert result.tokens == b.reference.tokens
    assert len(result.logits) == len(b.reference.logits) == N_NEW
    for got, want in zip(result.logits, b.reference.logits):
        assert torch.equal(got, want)
    # the cache really streamed: misses, evictions, the prefill bypassing a full cache
    assert st["cache"]["capacity"] == slots and st["misses"] > slots and st["cache"]["evictions"] > 0
    assert st["bypassed"] > 0 and st["bytes_fetched"] > 0
    assert st["cache"]["pinned"] == 0
    if depth:
        assert st["prefetch_sent"] > 0 and st["useful"] > 0
    else:
        assert st["prefetch_sent"] == 0 and st["predicted"] == 0


def test_deeper_prefetch_is_bit_identical_too(benches):
    b = benches("Q8_0")
    result, st = run_streamed(b, b.n_experts // 4, depth=2)
    assert result.tokens == b.reference.tokens
    assert all(torch.equal(g, w) for g, w in zip(result.logits, b.reference.logits))
    assert st["prefetch_sent"] > 0


def test_long_random_decode_never_evicts_pinned_or_overfills(benches):
    b = benches("Q8_0")
    policy = CheckedPolicy(4)
    sampling = SamplingParams(temperature=1.5, seed=3)  # random tokens: routing all over the experts
    result, st = run_streamed(b, 4, depth=2, sampling=sampling, policy=policy, n_new=40)
    assert sum(len(t) for t in result.tokens) > 40
    assert policy.checked > 100 and policy.evicted > 50 and policy.checked == st["cache"]["inserts"]
    assert st["cache"]["pinned"] == 0 and st["cache"]["resident"] <= 4


def _failing_refill(src, key, error):
    """Make `key`'s resident entry look in flight, then fail like a lost prefetch (abort + `error`)."""
    ready, wait, once = src.cache.ready_weights, src.cache.wait, [error]

    def fake_ready(layer, entry):
        return None if once and (layer, entry.slot) == (key[0], src.cache.slot_of(key)) else ready(layer, entry)

    def fake_wait(k, timeout=None):
        if k == key and once:
            src.cache.abort(key)
            raise once.pop()
        return wait(k, timeout)

    src.cache.ready_weights, src.cache.wait = fake_ready, fake_wait


@pytest.mark.parametrize("fails", [False, True])
def test_refetch_keeps_earlier_bypasses_and_failure_forgets_them(benches, fails):
    """2 slots: expert 0 resident, acquire [0, 1, 2] -> 1 gets the free slot, 2 is bypassed; 0's
    fill then fails and is refetched in the same acquire (it must not forget that 2 bypassed),
    or the acquire fails (nothing of it may stay behind for a later release)."""
    from moestream.decoder.experts.gpu.slot_cache import FetchFailed

    b = benches("Q8_0")
    with open_streamed(b.layout, b.endpoint, slots=2, landing="lazy") as src:
        src.acquire(0, [0])
        src.release(0, [0])
        _failing_refill(src, (0, 0), IodUnavailable("gone") if fails else FetchFailed("lost"))
        if fails:
            with pytest.raises(IodUnavailable):
                src.acquire(0, [0, 1, 2])
        else:
            got = src.acquire(0, [0, 1, 2])
            st = src.stats().as_dict()
            assert set(got) == {0, 1, 2} and st["refetched"] == 1 and st["bypassed"] == 1
            assert st["cache"]["pinned"] == 2  # 0 (refetched into its slot) and 1; 2 has none
            src.release(0, [0, 1, 2])
        assert src.cache.pinned() == 0
        src.acquire(0, [2])  # now 2 gets a slot: its release must unpin it, whatever came before
        assert src.cache.slot_of((0, 2)) is not None and src.cache.pinned() == 1
        src.release(0, [2])
        assert src.cache.pinned() == 0


def test_open_streamed_checks_capacity_arguments(benches):
    b = benches("Q8_0")
    with pytest.raises(ValueError, match="exactly one of slots"):
        open_streamed(b.layout, b.endpoint)
    with pytest.raises(ValueError, match="smaller than one"):
        open_streamed(b.layout, b.endpoint, cache_bytes=10)
    with open_streamed(b.layout, b.endpoint, cache_bytes=5 * 2**20 // 10) as src:
        assert src.cache.n_slots == 5 * 2**20 // 10 // src.cache.slot_bytes


def test_daemon_gone_is_a_clear_error_not_a_hang(make_tiny_model):
    path = make_tiny_model(quant="Q8_0", **MODEL)
    layout = ModelLayout(path)
    daemon = spawn_daemon(path)
    try:
        src = open_streamed(layout, daemon.endpoint, slots=4, timeout_s=2.0, reconnect_s=1.0)
        src.fetch_timeout_s = 10.0
        assert set(src.acquire(0, [1, 2])) == {1, 2}
        src.release(0, [1, 2])
    finally:
        daemon.stop()
    with pytest.raises(IodUnavailable, match="did not come back within 1s"):  # not the 10 s fetch timeout
        src.acquire(1, [3])
    assert src.cache.pinned() == 0  # nothing left pinned by the failed acquire
    src.close()
