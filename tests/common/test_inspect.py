"""`moestream inspect` against the gguf reader and the numbers the model was made with."""

from __future__ import annotations

import json

import numpy as np
from gguf import GGUFReader

from moestream.tools.inspect import main


def test_inspect_json_numbers(make_tiny_model, capsys):
    path = make_tiny_model(arch="qwen2moe", quant="Q4_0", experts=6, hidden=64, expert_ff=160)
    assert main([str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    reader = GGUFReader(path)
    exps = [t for t in reader.tensors if "_exps." in t.name]
    dense = [t for t in reader.tensors if "_exps." not in t.name]
    assert d["architecture"] == "qwen2moe"
    assert d["hparams"]["n_expert"] == d["experts"]["n_expert"] == 6
    assert d["experts"]["n_layer"] == 2 and d["experts"]["parts"] == ["gate", "up", "down"]
    assert d["experts"]["total_bytes"] == sum(int(t.n_bytes) for t in exps)
    assert d["dense_bytes"] == sum(int(t.n_bytes) for t in dense)
    gate = up = 160 * (64 // 32) * 18  # one expert's [160, 64] slice, Q4_0: 18 B per 32 values
    down = 64 * (160 // 32) * 18  # [64, 160]
    assert d["experts"]["max_blob_bytes"] == gate + up + down
    # each part starts on a page of the slot; O_DIRECT gives every part one more page of slack
    assert d["experts"]["slot_bytes"] == sum(-(-n // 4096) * 4096 for n in (gate, up, down)) == 3 * 8192
    assert d["experts"]["slot_bytes_direct_io"] == 3 * 8192 + 3 * 4096
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    assert d["quant_types"] == counts
    assert d["fingerprint"]["size"] == path.stat().st_size == d["file_bytes"]
    assert len(d["fingerprint"]["header_sha256"]) == 64


def test_inspect_text(tiny_model, capsys):
    assert main([str(tiny_model)]) == 0
    out = capsys.readouterr().out
    assert "qwen3moe" in out and "2 layers x 8 experts" in out and "Q8_0 x" in out


def test_inspect_bad_file_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(np.arange(64, dtype=np.uint8).tobytes())
    assert main([str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a GGUF file" in err[0]
