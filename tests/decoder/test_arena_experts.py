"""The CPU expert path: experts computed on their quantized blocks, resident (the file's map)
or streamed (straight from a real daemon's arena, which is the only cache).

Streamed must equal resident bit for bit with any arena size, prefetch depth and prompt
split; both must agree with the dequantized-weight reference (`ResidentExperts`, gguf-checked
dequantizers + torch matmuls) within float32 summation-order noise.
"""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest
import torch
from moestream.decoder.experts.bank import ExpertBank
from moestream.common.client import IodRequestError
from moestream.common.layout import ModelLayout
from moestream.decoder.experts.arena import WIDE_MISS_SHARE, MissShare, open_arena
from moestream.decoder.experts.source import ResidentExperts
from moestream.decoder.generation.loop import generate, forward_step
from moestream.decoder.models import get_model_module
from moestream.decoder.experts.prefetch import Prefetcher
from moestream.decoder.generation.traces import RoutingRecorder
from moestream.decoder.experts.resident import QuantResidentExperts
from moestream.decoder.models.weights import load_dense

PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9, 77, 31, 2, 501]
N_NEW = 6
MODEL = dict(arch="qwen3moe", layers=3, experts=8, top_k=2)  # 24 experts


class Setup:
    def __init__(self, path):
        self.path, self.layout = path, ModelLayout(path)
        hp = self.layout.hparams
        self.model = get_model_module(hp.arch).Model(hp, load_dense(self.layout, "cpu", progress=False))
        self.n_experts = hp.n_layer * hp.n_expert

    def run(self, source, hook=None, prompts=(PROMPT,)):
        return generate(self.model.with_bank(ExpertBank(source)), list(prompts), N_NEW, keep_logits=True, observer=hook)


@pytest.fixture(scope="module")
def setups(make_tiny_model):
    made = {}

    def get(quant: str) -> Setup:
        if quant not in made:
            made[quant] = Setup(make_tiny_model(quant=quant, **MODEL))
        return made[quant]

    return get


def same_run(a, b) -> bool:
    return a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K", "Q6_K", "Q4_0"])
def test_resident_quant_matches_the_dequantized_reference(setups, quant):
    s = setups(quant)
    with QuantResidentExperts(s.layout) as quant_src, ResidentExperts(s.layout) as dequant_src:
        q, ref = s.run(quant_src), s.run(dequant_src)
    for a, b in zip(q.logits, ref.logits):  # same weights, float32: only the summation order differs
        assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())
    st = QuantResidentExperts(s.layout).stats().as_dict()
    expert_bytes = sum(s.layout.experts.blob_bytes(layer) * s.layout.hparams.n_expert for layer in range(3))
    assert st["bytes"] == expert_bytes and st["slot_format"] == "quant"  # the file's bytes, no more


@pytest.mark.parametrize("quant, slots, depth", [("Q8_0", 6, 0), ("Q8_0", 6, 2), ("Q4_K", 6, 1), ("Q8_0", 24, 1)])
def test_streamed_equals_resident_bit_for_bit(setups, start_daemon, quant, slots, depth):
    s = setups(quant)
    with QuantResidentExperts(s.layout) as resident:
        want = s.run(resident, prompts=(PROMPT, PROMPT[:5]))
    daemon = start_daemon(s.path, arena_slots=slots)
    with open_arena(s.layout, daemon.endpoint) as src:
        hook = Prefetcher(s.model, src, depth) if depth else None
        got = s.run(src, hook, prompts=(PROMPT, PROMPT[:5]))
        st = src.stats()
    assert same_run(got, want)
    assert st.counts.acquired > 0 and st.counts.bytes_fetched > 0
    if depth:
        assert st.prefetch.prefetch_sent > 0


@pytest.mark.parametrize("slots, width", [(24, 1), (6, 3)])
def test_prefetch_width_follows_the_misses(make_tiny_model, start_daemon, slots, width):
    """All guesses but the least likely are read ahead while most wanted experts miss the arena (a
    cold one; one of 6 slots for 24 experts), each token's top-1 once they hit (every expert fits
    in 24): same logits bit for bit either way; a width the user gives wins."""
    s = Setup(make_tiny_model(quant="Q8_0", arch="qwen3moe", layers=3, experts=8, top_k=4))
    with QuantResidentExperts(s.layout) as resident:
        want = s.run(resident, prompts=(PROMPT[:4],))
    daemon = start_daemon(s.path, arena_slots=slots)
    with open_arena(s.layout, daemon.endpoint) as src:
        hook = Prefetcher(s.model, src, 1)
        assert hook.top_k == 3  # nothing measured yet: as if everything missed
        got = s.run(src, hook, prompts=(PROMPT[:4],))
        st = hook.stats()
        assert hook.top_k == width
        assert (0 < st.wide < st.hints) if width == 1 else st.wide == st.hints  # wide at first, or throughout
        assert Prefetcher(s.model, RoutingRecorder(src), 1).top_k == width  # `generate --trace-out` wraps it
        assert Prefetcher(s.model, src, 1, top_k=2).top_k == 2
        assert Prefetcher(s.model, src, 1, top_k=9).top_k == 4  # never more than the model routes to
    assert same_run(got, want)


def test_the_miss_share_decays_per_step():
    m = MissShare()
    assert m.share == 1.0  # a cold arena: as if everything missed
    m.step(400, 400)  # a prefill: all missed
    m.step(400, 400)  # a step that used nothing counts for nothing
    assert m.share == 1.0
    m.step(410, 460)  # decode steps, each 10 of 60 missed
    m.step(420, 520)
    assert m.share == pytest.approx(0.25 + 0.25 * (1 / 6) + 0.5 * (1 / 6))
    assert m.share < WIDE_MISS_SHARE


def test_token_by_token_equals_one_prompt(setups, start_daemon):
    s = setups("Q8_0")
    daemon = start_daemon(s.path, arena_slots=6)
    with open_arena(s.layout, daemon.endpoint) as src, QuantResidentExperts(s.layout) as resident:
        cache = s.model.new_cache(1, len(PROMPT))
        steps = [forward_step(s.model.with_bank(ExpertBank(src)), torch.tensor([[t]]), cache) for t in PROMPT]  # [1, 1, V] each
        whole = forward_step(s.model.with_bank(ExpertBank(resident)), torch.tensor([PROMPT]), s.model.new_cache(1, len(PROMPT)))
    assert (torch.cat(steps, dim=1) - whole).abs().max().item() < 1e-4


def test_an_arena_smaller_than_a_layers_working_set_still_decodes(setups, start_daemon):
    """A 16-token prompt routes each layer to most of its 8 experts; an arena of 2 slots (the
    top-k) holds a fraction: the layer is computed in pieces as leases come and go back."""
    s = setups("Q8_0")
    with QuantResidentExperts(s.layout) as resident:
        want = s.run(resident)
    daemon = start_daemon(s.path, arena_slots=2)
    with open_arena(s.layout, daemon.endpoint) as src:
        got = s.run(src, Prefetcher(s.model, src, 2))  # prefetch: over the limit, skipped
        assert src.stats().prefetch.prefetch_sent == 0
    assert same_run(got, want)


def test_a_prefetch_that_failed_is_fetched_again_now(setups, start_daemon):
    """Prefetches given up (cancelled in flight, or dropped by the daemon) never fail the layer."""
    s = setups("Q8_0")
    daemon = start_daemon(s.path, arena_slots=8)
    x = torch.randn(3, s.layout.hparams.n_embd)
    weights = torch.full((3, 2), 0.5)
    ids = torch.tensor([[0, 1], [2, 3], [1, 4]])
    with open_arena(s.layout, daemon.endpoint, prefetch_limit=8) as src, QuantResidentExperts(s.layout) as resident:
        want = resident.mix(0, x, weights, ids)
        src.prefetch_ahead({0: [0, 1, 2, 3, 4]})
        mine = src.prefetches._futures[0]
        src.client.cancel([mine[0], mine[1], mine[4]])  # gone before the layer runs
        dropped: cf.Future = cf.Future()
        dropped.set_exception(IodRequestError("dropped", "stale prefetch (queued 5.4s)"))
        mine[4] = dropped  # as the daemon reports a prefetch dropped as stale
        cf.wait([mine[2], mine[3]], timeout=10)
        failed = sum(1 for f in mine.values() if f.cancelled() or f.exception() is not None)
        got = src.mix(0, x, weights, ids)
        assert torch.equal(got, want)
        p = src.stats().prefetch
        assert p.useful + p.not_cached == 5 and p.not_cached == 1  # the dropped one was no use
        st = src.stats().counts  # each failed one is fetched `now`, or read where the arena has it already
        assert st.demand + st.direct == failed >= 1


def test_predictions_if_cached_never_read(setups, start_daemon):
    """`cached` prefetches (a daemon without a directory) lease what the arena holds and never
    cause a read; a right guess then leaves the layer nothing to wait for."""
    from moestream.tools.status import get_status

    s = setups("Q8_0")
    daemon = start_daemon(s.path, arena_slots=8, extra_args=["--no-directory"])
    x, weights, ids = torch.randn(1, s.layout.hparams.n_embd), torch.full((1, 2), 0.5), torch.tensor([[1, 2]])
    with open_arena(s.layout, daemon.endpoint, prefetch_limit=8) as src, QuantResidentExperts(s.layout) as resident:
        assert src.client.arena.directory is None
        src.prefetch_ahead({}, if_cached={0: [1, 2]})  # nothing in the arena yet
        got = src.mix(0, x, weights, ids)
        reads = get_status(daemon.status_endpoint)["reads"]
        assert reads == 2  # the two demand reads only: the cached guesses read nothing
        src.begin_step()
        before = src.stats().prefetch
        src.prefetch_ahead({}, if_cached={0: [1, 2, 5]})  # 1, 2 are in the arena now; 5 is not
        assert torch.equal(src.mix(0, x, weights, ids), got) and torch.equal(got, resident.mix(0, x, weights, ids))
        p = src.stats().prefetch
        assert get_status(daemon.status_endpoint)["reads"] == reads  # no read for 5, none for 1, 2
        assert (p.hidden - before.hidden) + (p.late - before.late) == 2  # both guesses used


def test_experts_in_the_arena_cost_no_request(setups, start_daemon, wait_status):
    """With the daemon's directory, an expert already in the arena is computed without a fetch or
    a lease (and a guess that it is there sends nothing); the hit reaches the daemon afterwards."""
    s = setups("Q8_0")
    daemon = start_daemon(s.path, arena_slots=8)
    x, weights, ids = torch.randn(2, s.layout.hparams.n_embd), torch.full((2, 2), 0.5), torch.tensor([[1, 2], [2, 6]])
    with open_arena(s.layout, daemon.endpoint, prefetch_limit=8) as src, QuantResidentExperts(s.layout) as resident:
        want = resident.mix(0, x, weights, ids)
        assert torch.equal(src.mix(0, x, weights, ids), want)  # cold: three fetches
        first = wait_status(daemon.status_endpoint, lambda st: st["requests"] == 3 and st["arena"]["leases"] == 0)
        src.begin_step()
        src.prefetch_ahead({0: [1, 2, 6]}, if_cached={0: [3]})  # all there but 3: only 3 could be a message
        for _ in range(3):
            assert torch.equal(src.mix(0, x, weights, ids), want)
        st = src.stats()
        assert st.counts.direct == 9 and st.counts.demand == 3 and st.prefetch.prefetch_sent == 0
        after = wait_status(daemon.status_endpoint, lambda st: st["direct_hits"] == 9)  # sent unasked, soon
        assert after["requests"] == first["requests"] and after["reads"] == first["reads"] == 3


def test_a_prompts_rows_weigh_in_the_arenas_policy(setups, start_daemon, wait_status):
    """A step of several rows tells the daemon how many each expert served (`fetch`'s uses):
    expert 0, chosen by all six rows of a prompt, outlives experts 1-3 (two rows each) when a
    token's experts 4 and 5 need room, so the next token's 0 is read once, not twice (counted
    one a request, 0 is the oldest and would go first)."""
    s = setups("Q8_0")
    daemon = start_daemon(s.path, arena_slots=4)
    prompt = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1], [0, 2], [0, 3]])
    with open_arena(s.layout, daemon.endpoint, prefetch_limit=0) as src:
        for ids in (prompt, torch.tensor([[4, 5]]), torch.tensor([[0, 3]])):
            x = torch.randn(len(ids), s.layout.hparams.n_embd)
            src.mix(0, x, torch.full(ids.shape, 0.5), ids)
            src.begin_step()
        st = wait_status(daemon.status_endpoint, lambda st: st["arena"]["leases"] == 0)
    assert st["reads"] == 6  # 0-3, then 4 and 5 in place of 1 and 2: 0 and 3 are still there


def test_a_prompts_hits_weigh_their_rows_too(setups, start_daemon, wait_status):
    """Experts a several-row step finds in the arena (lease-free, through the directory) are
    reported with the rows each served: after a second prompt's six rows chose 1 and 2 or 3,
    expert 1 (2 + 6 uses) and 0 (6) outweigh 2 and 3 (2 + 3), so a token's 4 and 5 take their
    slots and the next token's 0 and 1 are read once. Counted one a hit, 1 would weigh 3 and go."""
    s = setups("Q8_0")
    daemon = start_daemon(s.path, arena_slots=4)
    first = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 1], [0, 2], [0, 3]])
    second = torch.tensor([[1, 2], [1, 3], [1, 2], [1, 3], [1, 2], [1, 3]])
    with open_arena(s.layout, daemon.endpoint, prefetch_limit=0) as src:
        for ids in (first, second, torch.tensor([[4, 5]]), torch.tensor([[0, 1]])):
            x = torch.randn(len(ids), s.layout.hparams.n_embd)
            src.mix(0, x, torch.full(ids.shape, 0.5), ids)
            src.begin_step()
            src.client.ping(10)  # (the hits' report goes out before the next step's fetch)
        assert src.stats().counts.direct == 3 + 2  # the second prompt's three, then 0 and 1
        st = wait_status(daemon.status_endpoint, lambda st: st["arena"]["leases"] == 0)
    assert st["reads"] == 6


CHURN = """
import random, sys, time
from moestream.common.client import IodClient
c = IodClient(sys.argv[1], name="churn")
rng, end = random.Random(0), time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    keys = rng.sample([(layer, e) for layer in range(3) for e in range(8)], 4)
    for f in c.fetch(keys, "now"):
        try:
            c.release(f.result(10))
        except Exception:
            pass  # refused for room while the decoder's own leases fill the arena: ask again
c.close()
"""


def test_streamed_equals_resident_while_another_decoder_churns_the_arena(setups, start_daemon):
    """Lease-free reads stay exact while a second process keeps evicting and reloading the slots
    they read: every changed slot is seen and its expert computed again from a lease."""
    import subprocess
    import sys

    s = setups("Q8_0")
    with QuantResidentExperts(s.layout) as resident:
        want = s.run(resident, prompts=(PROMPT, PROMPT[:5]))
    daemon = start_daemon(s.path, arena_slots=10)
    churn = subprocess.Popen([sys.executable, "-c", CHURN, daemon.endpoint, "20"])
    try:
        with open_arena(s.layout, daemon.endpoint) as src:
            for _ in range(3):
                assert same_run(s.run(src, prompts=(PROMPT, PROMPT[:5])), want)
            st = src.stats()
        assert st.counts.direct > 0 and st.counts.demand > 0  # both paths taken under churn
    finally:
        churn.kill()
        churn.wait()


def test_quant_on_cuda_or_with_slots_is_a_clear_error(tiny_model):
    from moestream.decoder.config import ConfigError, DecoderConfig

    with pytest.raises(ConfigError, match="the daemon's arena is the only expert cache"):
        DecoderConfig(model=str(tiny_model), iod="ipc:///x", prompts=["a"], slots=4, device="cpu")
    if not torch.cuda.is_available():
        return
    with pytest.raises(ConfigError, match="is the CPU path"):
        DecoderConfig(model=str(tiny_model), resident=True, prompts=["a"], device="cuda", slot_format="quant")


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K"])
def test_dense_weights_kept_quantized_match_dequantized(setups, quant):
    """`keep_quantized`: 2-D quantized dense weights stay as their blocks (1/4 to 1/7 of float32),
    computed by the same kernels; the forward agrees with the dequantized-weight model."""
    from moestream.decoder.models import load_model
    from moestream.decoder.models.weights import QuantWeight, load_tensor

    s = setups(quant)
    quant_model = load_model(s.layout, keep_quantized=True)
    kept = {n: w for n, w in quant_model.layers[0].items() if isinstance(w, QuantWeight)}
    assert "attn_q" in kept and isinstance(quant_model.embed, QuantWeight)
    w = kept["attn_q"]
    assert w.nbytes == s.layout.tensors["blk.0.attn_q.weight"].nbytes
    # the embedding table (untied: the model has output.weight) stays a view of the file's map; the
    # weights read whole every step are private copies
    assert np.shares_memory(quant_model.embed.m.data, s.layout.data())
    assert not np.shares_memory(quant_model.lm_head.m.data, s.layout.data())
    assert not np.shares_memory(w.m.data, s.layout.data())
    ids = torch.tensor([3, 0, 17, 3])
    table = load_tensor(s.layout, "token_embd.weight", "cpu", torch.float32)  # gguf-checked dequantizer
    assert torch.equal(quant_model.embed.rows(ids, torch.float32), table[ids])
    with QuantResidentExperts(s.layout) as experts:
        tokens = torch.tensor([PROMPT])
        got = forward_step(quant_model.with_bank(ExpertBank(experts)), tokens, quant_model.new_cache(1, len(PROMPT)))
        want = forward_step(s.model.with_bank(ExpertBank(experts)), tokens, s.model.new_cache(1, len(PROMPT)))
    assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "llama", "olmoe"])
def test_every_architecture_runs_quantized(make_tiny_model, arch):
    """The CPU default (experts and dense weights on their blocks) against the dequantized model,
    for every architecture (Qwen2-MoE's shared expert included), prompt and decode steps."""
    from moestream.decoder.models import load_model

    path = make_tiny_model(arch=arch, quant="Q8_0", layers=2, experts=8, top_k=2)
    layout = ModelLayout(path)
    quant, ref = load_model(layout, keep_quantized=True), load_model(layout)
    with QuantResidentExperts(layout) as q_src, ResidentExperts(layout) as ref_src:
        got = generate(quant.with_bank(ExpertBank(q_src)), [PROMPT[:9]], 4, keep_logits=True)
        want = generate(ref.with_bank(ExpertBank(ref_src)), [PROMPT[:9]], 4, keep_logits=True)
    for a, b in zip(got.logits, want.logits):
        assert (a - b).abs().max().item() <= 1e-4 * max(1.0, b.abs().max().item())
