"""`moestream plan`: its forecast arithmetic on a made model, checked against sizes read from
the file with gguf-py's reader (not our layout), and its one-line errors."""

from __future__ import annotations

import json

import pytest
from gguf import GGUFReader
from moestream.common.layout import ModelLayout
from moestream.tools import plan as pl

MiB = 1 << 20


def _sizes_from_file(path) -> tuple[float, int, int]:
    """(mean expert bytes, dense bytes, n_blobs) from gguf-py's tensor table."""
    tensors = GGUFReader(path).tensors
    experts = sum(int(t.n_bytes) for t in tensors if "_exps." in t.name)
    dense = sum(int(t.n_bytes) for t in tensors if "_exps." not in t.name)
    n_blobs = 2 * 8  # layers x experts below
    return experts / n_blobs, dense, n_blobs


def test_forecast_arithmetic_on_a_made_model(make_tiny_model, capsys):
    path = make_tiny_model(layers=2, experts=8, top_k=2)
    expert, dense, n_blobs = _sizes_from_file(path)
    shape = pl.shape_of(ModelLayout(path))
    memory = pl.own_bytes(shape) + 6 * shape.slot_bytes
    code = pl.main([str(path), "--memory", str(memory), "--curve", "qwen3-235b", "--bandwidth", "1e8",
                    "--compute-tok-s", "50", "--miss-cpu", "2.5", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0
    s = r["shape"]
    assert s["expert_bytes"] == pytest.approx(expert) and s["dense_bytes"] == dense
    # the made model is untied and quantized: the decoder reads its embedding table from the map
    table = next(int(t.n_bytes) for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    assert s["mapped_bytes"] == table and r["own_bytes"] == (dense - table + pl.DECODER_BASE_BYTES
                                                             + pl.DAEMON_BASE_BYTES + pl.HEADROOM_BYTES)
    f = r["forecasts"][0]
    slots = 6
    share = slots / n_blobs
    # the curve, linear between its points: 0.25 -> 0.80, 1.0 -> 1.0
    hit = 0.80 + (1.0 - 0.80) * (share - 0.25) / 0.75  # 6 of 16 slots: between 25 % and 100 %
    assert f["slots"] == slots and f["cached"] == pytest.approx(share)
    assert f["hit_rate"] == pytest.approx(hit)
    misses = (1 - f["hit_rate"]) * 2 * 2  # MoE layers x top-k
    missed = misses * expert
    assert f["missed_bytes_per_token"] == pytest.approx(missed)
    compute = 1 / 50
    assert f["compute_s"] == pytest.approx(compute) and r["miss_cpu_s"] == pytest.approx(2.5e-3)
    # one bandwidth at every depth: a layer's m misses take the longer of their reads, less the
    # compute of its 2 - m hits meanwhile (an expert's share of the compute by bytes), and m x a
    # miss's CPU (on the cores the hits use: not hidden)
    read, cpu, q = expert / 1e8, 2.5e-3, 1 - f["hit_rate"]
    per_expert = compute * expert / (2 * 2 * expert + dense - table)
    io = 2 * (2 * q * (1 - q) * max(read - per_expert, cpu) + q * q * 2 * max(read, cpu))
    assert f["io_s"] == pytest.approx(io) and f["tok_s"] == pytest.approx(1 / (compute + io))
    # prefetched, the reads hide behind compute and their CPU joins it
    assert f["tok_s_prefetched"] == pytest.approx(1 / max(compute + misses * 2.5e-3, missed / 1e8))
    assert f["cold_fill_s"] == pytest.approx(slots * s["slot_bytes"] / 1e8)
    assert r["least_memory"] == r["own_bytes"] + 4 * s["slot_bytes"]


def test_curve_interpolation_and_a_memory_too_small(make_tiny_model, capsys):
    assert pl.curve_hit_rate([(0.25, 0.8)], 0.125) == pytest.approx(0.4)
    assert pl.curve_hit_rate([(0.25, 0.8)], 1.5) == 1.0
    path = make_tiny_model(layers=2, experts=8, top_k=2)
    assert pl.main([str(path), "--memory", "10MiB"]) == 0
    assert "too small: it runs from" in capsys.readouterr().out


def test_a_trace_gives_the_hit_rates(make_tiny_model, tmp_path, capsys):
    path = make_tiny_model(layers=2, experts=8, top_k=2)
    steps = [[[0, 0], [0, 1], [1, 0], [1, 1]]] * 5  # the same four experts every token
    (tmp_path / "t.json").write_text(json.dumps({"n_layer": 2, "n_expert": 8, "steps": steps}))
    assert pl.main([str(path), "--trace", str(tmp_path / "t.json"), "--memory", "1GiB", "--json"]) == 0
    f = json.loads(capsys.readouterr().out)["forecasts"][0]
    assert f["hit_rate"] == 1.0 and f["missed_bytes_per_token"] == 0.0


@pytest.mark.parametrize("argv, message", [(["/nonexistent.gguf"], "no such file"),
                                            (["MODEL", "--memory", "5x"], "bad size"),
                                            (["MODEL", "--curve", "gpt-9"], "unknown curve"),
                                            (["MODEL", "--miss-cpu", "-1"], "--miss-cpu must be >= 0")])
def test_bad_input_is_one_line(make_tiny_model, capsys, argv, message):
    argv = [str(make_tiny_model(layers=2, experts=8, top_k=2)) if a == "MODEL" else a for a in argv]
    assert pl.main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_split_model_is_planned_from_every_part(make_tiny_model, capsys):
    first = make_tiny_model(layers=2, experts=8, top_k=2, split_max_size="200K")
    parts = sorted(first.parent.glob(first.name.replace("00001-of", "0000*-of")))
    assert len(parts) == 2
    assert pl.main([str(first), "--memory", "1GiB", "--probe", "--json"]) == 0  # reads experts from both parts
    r = json.loads(capsys.readouterr().out)
    assert r["shape"]["file_bytes"] == sum(p.stat().st_size for p in parts)
    assert r["shape"]["n_expert"] * r["shape"]["moe_layers"] == 16 and r["bandwidth"] > 0


def test_the_probe_is_the_median_of_rounds_on_other_experts(make_tiny_model):
    layout = ModelLayout(make_tiny_model(layers=2, experts=8, top_k=2))  # 16 experts
    one = layout.experts.blob_bytes(0)
    r = pl.probe_bandwidth(layout, 0, 5 * one, depth=1, rounds=3)  # 5 experts a round, 16 in all
    assert r["experts"] == 15 and r["bytes"] >= 15 * one
    assert len(r["rounds"]) == 3 and r["rounds"] == sorted(r["rounds"]) and abs(r["bytes_per_s"] - r["rounds"][1]) <= 1
    short = pl.probe_bandwidth(layout, 0, 12 * one, depth=1, rounds=3)  # the second round takes what is left
    assert short["experts"] == 16 and len(short["rounds"]) == 2


def test_a_layer_that_misses_few_experts_reads_at_their_depth():
    """Per layer the m missed experts of top-k (binomial) are read together, at the bandwidth of
    m experts' reads in flight (linear from one expert's to top-k's); prefetched reads are deep."""
    s = pl.Shape(moe_layers=10, n_expert=8, top_k=2, expert_bytes=1e6, slot_bytes=1 << 20, dense_bytes=0,
                 file_bytes=10 ** 9)
    q = 0.25  # hit rate 0.75
    one, two = 0.5e9, 1e9  # bytes/s: one expert's parts in flight, both experts'
    by_hand = 10 * (2 * q * (1 - q) * 1e6 / one + q * q * 2e6 / two)  # P(m = 1) x 1 MB, P(m = 2) x 2 MB
    assert pl.demand_io_s(s, 0.75, two, one) == pytest.approx(by_hand)
    assert pl.demand_io_s(s, 0.75, two) == pytest.approx(10 * 2 * q * 1e6 / two)  # one depth: missed bytes / bw
    f = pl.forecast_slots(s, 1 << 30, 8, 0.75, two, 0.0, fill_bandwidth=2e9, miss_cpu_s=0.0, one_bandwidth=one)
    assert f.io_s == pytest.approx(by_hand) and f.tok_s == pytest.approx(1 / by_hand)  # (no compute to overlap)
    f = pl.forecast_slots(s, 1 << 30, 8, 0.75, two, 0.01, fill_bandwidth=2e9, miss_cpu_s=0.0, one_bandwidth=one)
    assert f.tok_s_prefetched == pytest.approx(1 / max(0.01, f.missed_bytes_per_token / 2e9))
    assert f.cold_fill_s == pytest.approx(8 * (1 << 20) / 2e9)


def test_a_layer_waits_for_the_longer_of_its_reads_and_its_misses_cpu():
    """The daemon handles one miss while the layer's others read: a layer's m misses cost the
    longer of their reads and m x the CPU a miss takes, not the sum."""
    s = pl.Shape(moe_layers=10, n_expert=8, top_k=2, expert_bytes=1e6, slot_bytes=1 << 20, dense_bytes=0,
                 file_bytes=10 ** 9)
    q, one, two, cpu = 0.25, 0.5e9, 1e9, 1.5e-3  # reads: 2 ms for one miss, 2 ms for two (twice as deep)
    by_hand = 10 * (2 * q * (1 - q) * max(1e6 / one, cpu) + q * q * max(2e6 / two, 2 * cpu))  # 2 ms, then 3 ms
    assert pl.demand_io_s(s, 0.75, two, one, cpu) == pytest.approx(by_hand)
    assert by_hand < pl.demand_io_s(s, 0.75, two, one) + 10 * 2 * q * cpu  # less than reads + CPU
    f = pl.forecast_slots(s, 1 << 30, 8, 0.75, two, 0.0, miss_cpu_s=cpu, one_bandwidth=one)
    assert f.tok_s == pytest.approx(1 / by_hand) and f.compute_s == 0.0


def test_a_layers_hits_are_computed_while_its_misses_read():
    """The decoder sends a layer's fetch, then computes its hits: a layer waits only for what is
    left of its reads after k - m hits' compute (an expert's share of the token's compute by
    bytes), never less than nothing, nor less than its misses' CPU, which shares the hits' cores."""
    s = pl.Shape(moe_layers=10, n_expert=8, top_k=2, expert_bytes=1e6, slot_bytes=1 << 20, dense_bytes=0,
                 file_bytes=10 ** 9)
    q, one, two = 0.25, 0.5e9, 1e9  # one miss: 2 ms of reads; two: 2 ms
    compute = 0.03  # 20 experts a token, no dense bytes: 1.5 ms an expert
    by_hand = 10 * (2 * q * (1 - q) * (2e-3 - 1.5e-3) + q * q * 2e-3)  # one miss waits 0.5 ms; two miss 2 ms
    assert pl.demand_io_s(s, 0.75, two, one, 0.0, 1.5e-3) == pytest.approx(by_hand)
    f = pl.forecast_slots(s, 1 << 30, 8, 0.75, two, compute, miss_cpu_s=0.0, one_bandwidth=one)
    assert f.io_s == pytest.approx(by_hand) and f.tok_s == pytest.approx(1 / (compute + by_hand))
    assert pl.demand_io_s(s, 0.75, two, one, 0.0, 1.0) == pytest.approx(10 * q * q * 2e-3)  # only 2 misses wait
    with_cpu = 10 * (2 * q * (1 - q) * 1e-3 + q * q * 2e-3)  # one miss: its 1 ms of CPU outlasts 0.5 ms of reads
    assert pl.demand_io_s(s, 0.75, two, one, 1e-3, 1.5e-3) == pytest.approx(with_cpu)
