"""`make-model --quant` for every writable type and `--mix` per-part / per-layer expert types:
the file gguf-py reads back has each tensor in its own type, and bad rules are one clear line."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from moestream.authoring import make_model as mm
from moestream.authoring.quant_mix import QuantMix, parse_mix
from moestream.authoring.quantize import ENCODABLE

import qref


def expert_types(path) -> dict[str, Q]:
    return {t.name: Q(t.tensor_type) for t in GGUFReader(path).tensors if "_exps" in t.name}


@pytest.mark.parametrize("qtype", sorted(ENCODABLE, key=lambda q: q.name), ids=lambda q: q.name)
def test_every_writable_type_as_quant(tmp_path, qtype):
    path = mm.make_model(tmp_path / "m.gguf", quant=qtype.name, layers=1, experts=2, top_k=1)
    reader = GGUFReader(path)
    exps = [t for t in reader.tensors if "_exps" in t.name]
    assert exps and all(Q(t.tensor_type) == qtype for t in exps)
    for t in exps:  # random codes decode to small finite weights
        w = qref.dequantize(np.asarray(t.data), Q(t.tensor_type))
        assert np.isfinite(w).all() and 0 < np.abs(w).max() < 1.0


def test_mix_puts_each_tensor_in_its_type(tmp_path):
    path = mm.make_model(tmp_path / "m.gguf", quant="Q8_0", layers=4, experts=2, top_k=1, expert_quant="Q4_0",
                         mix="gate_up=Q2_K,down=Q1_0,layers:1-2=NVFP4,layers:2=TQ2_0")
    want = {0: (Q.Q2_K, Q.Q2_K, Q.Q1_0), 1: (Q.NVFP4,) * 3, 2: (Q.TQ2_0,) * 3, 3: (Q.Q2_K, Q.Q2_K, Q.Q1_0)}
    got = expert_types(path)
    for layer, types in want.items():
        assert tuple(got[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down")) == types


def test_mix_rules_and_defaults():
    mix = parse_mix(" down = Q4_K , layers:3=Q8_0")
    assert mix == QuantMix({"down": Q.Q4_K}, ((3, 3, Q.Q8_0),))
    assert mix.expert_qtype("blk.0.ffn_gate_exps.weight", Q.Q4_0) == Q.Q4_0  # no rule: the default
    assert mix.expert_qtype("blk.0.ffn_down_exps.weight", Q.Q4_0) == Q.Q4_K
    assert mix.expert_qtype("blk.3.ffn_down_exps.weight", Q.Q4_0) == Q.Q8_0
    assert parse_mix("gate=Q2_K").expert_qtype("blk.1.ffn_gate_up_exps.weight", Q.Q4_0) == Q.Q2_K  # fused: gate's


@pytest.mark.parametrize("text, match", [
    ("gate", r"'gate' is not KEY=TYPE"),
    ("gate=", r"'gate=' is not KEY=TYPE"),
    ("ffn=Q4_K", r"'ffn=Q4_K': unknown key 'ffn' \(keys: gate, up, down"),
    ("down=Q9_9", r"'down=Q9_9': unknown quant type 'Q9_9'"),
    ("down=Q8_1", r"'down=Q8_1': cannot write Q8_1"),
    ("layers:3-1=Q4_K", r"empty layer range 3-1"),
    ("layers:x=Q4_K", r"unknown key 'layers:x'"),
])
def test_bad_mix_is_one_clear_error(text, match):
    with pytest.raises(ValueError, match=match):
        parse_mix(text)


def test_cli_mix_errors_and_help(tmp_path, capsys):
    assert mm.main([str(tmp_path / "m.gguf"), "--mix", "layers:2=Q4_K"]) == 1  # 2 layers: 0-1
    err = capsys.readouterr().err.strip()
    assert err == "moestream make-model: --mix: layers:2-2 is past the model's 2 layers (0-1)"
    assert not (tmp_path / "m.gguf").exists()
    with pytest.raises(SystemExit):
        mm.main(["--help"])
    out = capsys.readouterr().out
    assert "--mix" in out and "gate_up=Q2_K" in out and "NVFP4" in out and "Q1_0" in out
