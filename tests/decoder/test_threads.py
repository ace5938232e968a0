"""The adapted kernel thread count (decoder.kernels.threads) and `bench decode --neighbour`."""

from __future__ import annotations

import json

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from moestream.decoder.kernels.cpu import ffn as qk
from moestream.decoder.kernels.cpu.threads import ThreadTuner


def _run(t: ThreadTuner, cost: dict[int, float], steps: int) -> list[int]:
    picks = []
    for _ in range(steps):
        n = t.pick()
        picks.append(n)
        t.record(n, cost[n])
    return picks


def test_tuner_tries_each_count_then_keeps_the_fastest() -> None:
    t = ThreadTuner(4, explore=4)
    assert t.options == [4, 2, 1]
    picks = _run(t, {4: 3.0, 2: 1.0, 1: 2.0}, 200)  # a busy neighbour: half the cores is fastest
    assert picks[:3] == [4, 2, 1]
    later = picks[3:]
    tries = [i for i, n in enumerate(later) if n != 2]
    assert {later[i] for i in tries} == {4, 1}  # it still tries the others now and then,
    gaps = np.diff(tries)
    assert list(gaps) == sorted(gaps) and gaps[-1] == 16 * 4 > gaps[0]  # less often the more they lose
    assert later.count(2) >= len(later) * 9 // 10


def test_tuner_keeps_trying_a_count_that_comes_close() -> None:
    t = ThreadTuner(2, explore=4)
    later = _run(t, {2: 1.0, 1: 1.2}, 100)[2:]
    tries = [i for i, n in enumerate(later) if n == 1]
    assert max(np.diff(tries)) <= 4  # within 1.5x of the best: tried every `explore` steps


def test_tuner_follows_a_neighbour_that_leaves() -> None:
    t = ThreadTuner(2, explore=4)
    for cost in ({2: 3.0, 1: 1.0}, {2: 0.5, 1: 1.0}):  # busy, then idle
        for _ in range(40):
            n = t.pick()
            t.record(n, cost[n])
    assert min(t.avg, key=t.avg.__getitem__) == 2


def test_thread_count_never_changes_the_bits() -> None:
    """Adapting is invisible in the output: the fused kernels' results are the same bits for any count."""
    from moestream.decoder.bench.kernels import random_matrix

    rng = np.random.default_rng(0)
    mats = [qk.QMatrix(random_matrix(Q.Q8_0, *s, rng), int(Q.Q8_0), *s) for s in ((512, 256), (512, 256), (256, 512))]
    x = rng.standard_normal((3, 256)).astype(np.float32)
    prev = numba.get_num_threads()
    try:
        outs = []
        for n in sorted({1, prev}):
            numba.set_num_threads(n)
            outs.append(qk.swiglu_expert(x, *mats))
    finally:
        numba.set_num_threads(prev)
    for o in outs[1:]:
        np.testing.assert_array_equal(o.view(np.uint32), outs[0].view(np.uint32))


def test_bench_decode_neighbour_json(make_tiny_model, capsys: pytest.CaptureFixture[str]) -> None:
    from moestream.decoder.bench import decode as bench

    model = make_tiny_model(arch="qwen3moe", quant="Q8_0")
    assert bench.main(["--model", str(model), "--neighbour", "-n", "3", "--repeat", "1", "--threads", "2",
                       "--prompt-tokens", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    for cond in ("idle", "busy"):
        c = r[cond]
        assert set(c["tok_s"]) == {"default", "1", "2"} and all(v > 0 for v in c["tok_s"].values())
        assert c["best_fixed"] in (1, 2)
        assert c["default_over_best"] == pytest.approx(c["tok_s"]["default"] / c["tok_s"][str(c["best_fixed"])])


def test_stacked_qkv_is_the_same_bits_as_three_calls() -> None:
    """q, k, v stacked into one weight (one kernel call) give the bits of three separate calls."""
    import torch
    from moestream.decoder.bench.kernels import random_matrix
    from moestream.decoder.models.weights import QuantWeight, stack_rows

    rng = np.random.default_rng(1)
    shapes = ((256, 128), (64, 128), (64, 128))  # q, k, v: [n_out, n_in]
    ws = [QuantWeight(random_matrix(Q.Q8_0, *s, rng), int(Q.Q8_0), *s) for s in shapes]
    x = torch.from_numpy(rng.standard_normal((3, 128)).astype(np.float32))  # [N, n_in]
    apart = [w.linear(x) for w in ws]
    fused = stack_rows(ws)
    assert fused is not None and all(w.group is fused for w in ws)
    together = fused.linear(x).split([s[0] for s in shapes], dim=-1)
    for a, t, w in zip(apart, together, ws):
        assert torch.equal(a, t) and torch.equal(a, w.linear(x))  # the views still compute alone too
    mixed = [ws[0], QuantWeight(random_matrix(Q.Q4_0, 64, 128, rng), int(Q.Q4_0), 64, 128)]
    assert stack_rows(mixed) is None


def test_adapted_steps_give_the_logits_of_fixed_counts(tiny_model) -> None:
    """A decode step under the tuner (numba's and torch's counts switched between 2 and 1) gives
    the same logits, bit for bit, as steps on one fixed kernel thread (torch's count fixed too): the
    model's forward on the CPU kernels, torch's embedding and glue included."""
    import torch
    from moestream.common.layout import ModelLayout
    from moestream.decoder.experts.bank import ExpertBank
    from moestream.decoder.experts.source import ResidentExperts
    from moestream.decoder.generation.loop import generate
    from moestream.decoder.kernels.cpu import threads
    from moestream.decoder.models import load_model

    layout = ModelLayout(tiny_model)
    model = load_model(layout, keep_quantized=True).with_bank(ExpertBank(ResidentExperts(layout)))
    prompts = [[5, 17, 200, 33, 41, 9], [77, 3, 450]]
    saved = (threads.tuner(), numba.get_num_threads(), torch.get_num_threads())
    try:
        numba.set_num_threads(1)
        torch.set_num_threads(2)  # prefill keeps torch's count as set: MKL's multi-row GEMMs round
        threads.set_tuner(None)  # by thread count on some CPUs (seen on Zen 4), a decode step's not
        fixed = generate(model, prompts, 8, keep_logits=True)
        numba.set_num_threads(2)
        torch.set_num_threads(2)
        tuner = ThreadTuner(2, explore=2)
        threads.set_tuner(tuner)
        adapted = generate(model, prompts, 8, keep_logits=True)
        assert set(tuner.avg) == {1, 2} and torch.get_num_threads() == 2  # both ran; torch's count restored
    finally:
        threads.set_tuner(saved[0])
        numba.set_num_threads(saved[1])
        torch.set_num_threads(saved[2])
    assert adapted.tokens == fixed.tokens
    for a, f in zip(adapted.logits, fixed.logits):
        assert torch.equal(a.view(torch.int32), f.view(torch.int32))
