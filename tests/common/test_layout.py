"""ModelLayout vs the gguf reader and gguf-py's dequantizer, for every arch x quant; bad files."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, GGUFReader
from gguf import quants as gq

from moestream.authoring import make_model as mm
from moestream.authoring.gguf_write import write_moe_gguf
from moestream.common.layout import PAGE, SUPPORTED_QTYPES, ExpertPart, ModelFormatError, ModelLayout, slot_offsets

ARCHS = ("qwen3moe", "qwen2moe", "llama", "olmoe")
QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K")


def read_range(path: Path, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_expert_ranges_match_reader(make_tiny_model, arch, quant):
    path = make_tiny_model(arch=arch, quant=quant, experts=4)
    layout = ModelLayout(path)
    reader = {t.name: t for t in GGUFReader(path).tensors}
    for layer in range(layout.hparams.n_layer):
        for part_name, t in layout.experts.tensors[layer]:
            ref = reader[t.name]
            whole = gq.dequantize(np.asarray(ref.data), ref.tensor_type)  # [n_expert, n_out, n_in]
            for e in range(layout.hparams.n_expert):
                part = layout.experts.parts(layer, e)[[n for n, _ in layout.experts.tensors[layer]].index(part_name)]
                raw = read_range(path, part.offset, part.nbytes)
                assert raw == np.asarray(ref.data[e]).tobytes(), (t.name, e)
                n_in, n_out = part.shape
                mine = gq.dequantize(np.frombuffer(raw, np.uint8).reshape(n_out, -1), part.qtype)
                assert np.array_equal(mine.reshape(n_out, n_in), whole[e]), (t.name, e)


@pytest.mark.parametrize("arch", ARCHS)
def test_hparams_match_request(make_tiny_model, arch):
    kw = dict(arch=arch, quant="Q8_0", layers=3, experts=6, top_k=3, hidden=128, expert_ff=96, heads=8, vocab=300)
    hp = ModelLayout(make_tiny_model(**kw)).hparams
    kv = 8 if arch == "olmoe" else 2
    assert (hp.arch, hp.n_layer, hp.n_expert, hp.n_expert_used, hp.n_embd, hp.n_ff_exp) == (arch, 3, 6, 3, 128, 96)
    assert (hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_vocab) == (8, kv, 16, 300)
    assert hp.n_ff_shexp == (192 if arch == "qwen2moe" else 0)
    assert hp.norm_topk_prob == (arch in ("qwen3moe", "llama"))


def test_qwen3moe_head_dim_may_differ(make_tiny_model):
    hp = ModelLayout(make_tiny_model(hidden=64, heads=4, head_dim=32)).hparams
    assert (hp.n_embd, hp.n_head, hp.head_dim) == (64, 4, 32)


def test_blob_and_slot_sizes(make_tiny_model):
    layout = ModelLayout(make_tiny_model(quant="Q8_0", hidden=64, expert_ff=96, experts=4))
    part = 34 * (64 // 32) * 96  # gate/up: 96 rows of 64 values; down: 64 rows of 96 (same bytes)
    assert layout.experts.max_blob_bytes == 3 * part
    assert layout.experts.slot_bytes() == 3 * -(-part // PAGE) * PAGE
    assert layout.experts.total_bytes == 3 * part * 4 * 2


def test_slot_offsets_rule():
    """Each part on its own page-aligned run of the slot; O_DIRECT: + the part's offset in its page."""
    parts = [ExpertPart("gate", Q.Q8_0, (64, 96), 10 * PAGE + 100, 5000),
             ExpertPart("up", Q.Q8_0, (64, 96), 20 * PAGE, 4096),
             ExpertPart("down", Q.Q8_0, (96, 64), 30 * PAGE + 4000, 1)]
    assert slot_offsets(parts, direct=False) == ({"gate": 0, "up": 2 * PAGE, "down": 3 * PAGE}, 4 * PAGE)
    where, size = slot_offsets(parts, direct=True)
    assert (where, size) == ({"gate": 100, "up": 3 * PAGE, "down": 5 * PAGE + 4000}, 7 * PAGE)
    for p in parts:  # the aligned read [first byte - lead, round_up(lead + n)) stays inside the part's room
        lead = p.offset % PAGE
        assert where[p.name] - lead + -(-(lead + p.nbytes) // PAGE) * PAGE <= size


def test_fingerprint_hashes_header(tiny_model):
    layout = ModelLayout(tiny_model)
    header = tiny_model.read_bytes()[: GGUFReader(tiny_model).data_offset]  # independent of our reader
    fp = layout.fingerprint
    assert fp.header_sha256 == hashlib.sha256(header).hexdigest()
    assert (fp.size, fp.mtime_ns) == (tiny_model.stat().st_size, tiny_model.stat().st_mtime_ns)


# -- bad files ----------------------------------------------------------------------------
def copy(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    return dst


def patch_tensor_type(path: Path, name: str, qtype: int) -> None:
    """Overwrite the ggml type field of `name` in the tensor table, in place."""
    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    type_at = t.field.offset + sum(p.nbytes for p in t.field.parts[:4])  # name len, name, n_dims, dims
    with open(path, "r+b") as f:
        f.seek(type_at)
        f.write(int(qtype).to_bytes(4, "little"))


def write_variant(path: Path, arch="qwen3moe", drop=(), replace=None, **hp_overrides) -> Path:
    """A tiny model written through our writer with tensors dropped/replaced or metadata overridden."""
    hp = mm.model_hparams(arch, layers=2, experts=4, top_k=2, hidden=64, expert_ff=64, heads=4, kv_heads=2, vocab=300)
    tensors = {n: t for n, t in mm.build_tensors(arch, hp).items() if n not in drop}
    tensors.update(replace or {})
    write_moe_gguf(path, arch, {**hp, **hp_overrides}, tensors, "Q8_0", None)
    return path


def expect_error(path: Path, *fragments: str) -> None:
    with pytest.raises(ModelFormatError) as info:
        ModelLayout(path)
    for frag in fragments:
        assert frag in str(info.value), f"{frag!r} not in {info.value}"


def test_wrong_magic(tiny_model, tmp_path):
    bad = copy(tiny_model, tmp_path / "m.gguf")
    with open(bad, "r+b") as f:
        f.write(b"GGML")
    expect_error(bad, "not a GGUF file", "GGML")


def test_truncated_data(tiny_model, tmp_path):
    data = tiny_model.read_bytes()
    bad = tmp_path / "t.gguf"
    bad.write_bytes(data[: len(data) - 1000])
    expect_error(bad, "truncated", str(len(data) - 1000))


def test_unsupported_architecture(tmp_path):
    path = write_variant(tmp_path / "a.gguf")
    data = path.read_bytes().replace(b"qwen3moe", b"qwen9moe")  # same length: offsets stay valid
    path.write_bytes(data)
    expect_error(path, "unsupported architecture", "qwen9moe")


def test_unknown_quant_type(tiny_model, tmp_path):
    bad = copy(tiny_model, tmp_path / "u.gguf")
    patch_tensor_type(bad, "blk.0.ffn_up_exps.weight", 250)
    expect_error(bad, "250")


def test_known_but_unsupported_quant_type(tiny_model, tmp_path):
    assert Q.Q8_1 not in SUPPORTED_QTYPES
    bad = copy(tiny_model, tmp_path / "k.gguf")
    patch_tensor_type(bad, "output_norm.weight", Q.Q8_1)  # 64 floats (256 B) -> 72 B of Q8_1: still in the file
    expect_error(bad, "output_norm.weight", "Q8_1")


def test_missing_expert_tensor(tmp_path):
    expect_error(write_variant(tmp_path / "m.gguf", drop=("blk.1.ffn_down_exps.weight",)),
                 "missing expert tensor", "blk.1.ffn_down_exps.weight")


def test_misshaped_expert_tensor(tmp_path):
    bad = np.zeros((4, 96, 64), np.float32)  # [n_expert, n_out, n_in]: 96 rows where expert_ff = 64
    expect_error(write_variant(tmp_path / "s.gguf", replace={"blk.0.ffn_gate_exps.weight": bad}),
                 "mis-shaped expert tensor", "blk.0.ffn_gate_exps.weight", "[64, 96, 4]", "[64, 64, 4]")


@pytest.mark.parametrize("arch, name, bad, want", [
    ("qwen3moe", "blk.1.ffn_gate_inp.weight", (4, 32), "[64, 4]"),  # router over half the width
    ("qwen3moe", "blk.0.attn_k.weight", (64, 64), "[64, 32]"),  # k as wide as q: kv_heads ignored
    ("qwen3moe", "blk.1.attn_q_norm.weight", (64,), "[16]"),  # a full-width norm where per-head is due
    ("olmoe", "blk.0.attn_k_norm.weight", (16,), "[64]"),  # per-head where full-width is due
    ("qwen2moe", "blk.0.attn_v.bias", (64,), "[32]"),
    ("qwen2moe", "blk.1.ffn_gate_inp_shexp.weight", (2, 64), "[64] or [64, 1]"),
    ("llama", "output_norm.weight", (32,), "[64]"),
])
def test_misshaped_dense_tensor_is_named_with_expected_shape(tmp_path, arch, name, bad, want):
    kv = 4 if arch == "olmoe" else 2
    hp = mm.model_hparams(arch, layers=2, experts=4, top_k=2, hidden=64, expert_ff=64, heads=4, kv_heads=kv, vocab=300)
    tensors = mm.build_tensors(arch, hp)
    tensors[name] = np.zeros(bad, np.float32)
    write_moe_gguf(tmp_path / "x.gguf", arch, hp, tensors, "F32", None)
    found = str(list(reversed(bad)))  # ggml order
    expect_error(tmp_path / "x.gguf", "mis-shaped tensor", repr(name), f"shape {found}", f"expected {want}")


def test_shared_expert_gate_as_the_converter_writes_it_is_accepted(tmp_path):
    """convert_hf_to_gguf.py keeps HF's Linear(d, 1) as ggml [d, 1]; our writer squeezes it to [d]."""
    hp = mm.model_hparams("qwen2moe", layers=2, experts=4, top_k=2, hidden=64, expert_ff=64, heads=4, kv_heads=2, vocab=300)
    tensors = mm.build_tensors("qwen2moe", hp)
    tensors["blk.0.ffn_gate_inp_shexp.weight"] = np.ones((1, 64), np.float32)  # torch order [1, d]
    write_moe_gguf(tmp_path / "x.gguf", "qwen2moe", hp, tensors, "F32", None)
    assert ModelLayout(tmp_path / "x.gguf").dense["blk.0.ffn_gate_inp_shexp.weight"].shape == (64, 1)


def test_inconsistent_expert_count(tmp_path):
    expect_error(write_variant(tmp_path / "c.gguf", n_expert=3, n_expert_used=2),
                 "inconsistent expert count", "4 experts", "expert_count=3")


def test_missing_dense_tensor(tmp_path):
    expect_error(write_variant(tmp_path / "d.gguf", arch="qwen2moe", drop=("blk.0.attn_k.bias",)),
                 "missing tensor", "blk.0.attn_k.bias", "qwen2moe")


def test_not_a_file(tmp_path):
    expect_error(tmp_path / "nope.gguf", "no such file")
