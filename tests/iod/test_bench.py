"""`moestream bench io` smoke run on a tiny model: every phase runs and the byte counts add up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moestream import bench as dispatcher
from moestream.common.layout import ModelLayout
from moestream.iod import bench


@pytest.fixture(params=["single", "split"])
def tiny_or_split(request: pytest.FixtureRequest, tiny_model: Path, make_tiny_model) -> Path:
    """The tiny model, and the same model split in parts (each read through its own descriptor)."""
    return tiny_model if request.param == "single" else make_tiny_model(arch="qwen3moe", quant="Q8_0",
                                                                        split_max_size=40_000)


def test_bench_io_tiny_model(tiny_or_split: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny_model = tiny_or_split
    layout = ModelLayout(tiny_model)
    n = 6
    assert dispatcher.main(["io", "--model", str(tiny_model), "--experts", str(n), "--hits", "50", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    keys = bench.pick_keys(layout, n, 0)
    assert len(set(keys)) == n
    expected = sum(p.nbytes for k in keys for p in layout.experts.parts(*k))  # the experts' bytes, from the index
    assert r["experts"] == n and r["bytes"] == expected
    assert r["cold_raw_preadv"]["read_bytes"] == expected  # the raw pool really read every range
    assert r["cold"]["served_bytes"] == expected  # the daemon served exactly these bytes, once
    assert "hit" not in r["warm"]  # reported once, at the top level
    hit = r["hit"]
    assert hit["requests"] == 50 and hit["hit_rate"] == 1.0  # repeats are served from the arena
    assert 0 < hit["p50_us"] <= hit["p99_us"]
    assert 0 < hit["echo_p50_us"] <= hit["echo_p99_us"]  # the bare ZeroMQ floor, measured in the same run
    assert hit["p50_vs_echo"] == pytest.approx(hit["p50_us"] / hit["echo_p50_us"], rel=1e-2)


def test_picked_experts_skip_dense_ffn_layers(make_tiny_model) -> None:
    # deepseek2 with a leading dense layer: layer 0 has no experts to read (parts() refuses it)
    layout = ModelLayout(make_tiny_model(arch="deepseek2", quant="F32", layers=3, experts=8, top_k=3))
    assert layout.experts.moe_layers[0] > 0
    keys = bench.pick_keys(layout, None, 0)
    assert sorted(keys) == [(layer, e) for layer in layout.experts.moe_layers for e in range(8)]
    assert sum(p.nbytes for k in keys for p in layout.experts.parts(*k)) == layout.experts.total_bytes


def test_raw_preadv_reads_the_ranges(tiny_or_split: Path) -> None:
    tiny_model = tiny_or_split
    layout = ModelLayout(tiny_model)
    keys = bench.pick_keys(layout, None, 1)
    ph = bench.raw_cold_reads(layout, keys, depth=4, direct=False)
    assert ph["read_bytes"] == layout.experts.total_bytes and ph["tool"] == "preadv x4"
    direct = bench.raw_cold_reads(layout, keys, depth=4, direct=True)  # whole pages around each part
    assert direct["read_bytes"] == sum(n for _, _, n in bench._aligned(bench.expert_ranges(layout, keys)))


def test_bench_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope" * 100)
    assert bench.main(["--model", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a GGUF file" in err
    assert dispatcher.main(["nosuch"]) == 2
    assert "unknown command 'nosuch'" in capsys.readouterr().err
    out = (dispatcher.main([]), capsys.readouterr().out)
    assert out[0] == 0 and "usage: moestream bench" in out[1] and " io " in out[1] and " decode " in out[1]
