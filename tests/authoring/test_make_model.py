"""The tiny-model factory: encoders vs gguf-py's dequantizer, writer, tokenizer, CLI."""

from __future__ import annotations


import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q, GGUFReader
from gguf import quants as gq
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

from moestream.authoring import make_model as mm
from moestream.authoring.gguf_write import RandomTensor, write_moe_gguf
from moestream.authoring.quantize import ENCODABLE, encode, random_blocks
from moestream.authoring.tokenizer_data import SPECIAL_TOKENS, get_tokenizer

import qref

ARCHS = ("qwen3moe", "qwen2moe", "llama", "olmoe")
# relative RMS error of encode -> gguf dequantize on N(0, 1) data, per type (loose upper bounds)
REL_ERR = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 5e-3, Q.Q8_0: 0.01, Q.Q6_K: 0.04, Q.Q5_0: 0.06, Q.Q5_1: 0.06,
           Q.Q4_0: 0.12, Q.Q4_1: 0.12, Q.Q4_K: 0.12, Q.MXFP4: 0.15, Q.IQ4_NL: 0.10, Q.IQ4_XS: 0.10, Q.NVFP4: 0.12,
           Q.Q3_K: 0.20, Q.Q2_K: 0.40, Q.Q1_0: 0.62,  # sign and mean |x| only: sqrt(1 - 2/pi) = 0.60
           Q.TQ1_0: 0.85, Q.TQ2_0: 0.85,  # ternary with d = max |x| (as gguf-py): most of N(0, 1) rounds to 0
           # grid types (quantize_iq: nearest grid entries, no importance matrix)
           Q.IQ1_S: 0.55, Q.IQ1_M: 0.5, Q.IQ2_XXS: 0.4, Q.IQ2_XS: 0.35, Q.IQ2_S: 0.3, Q.IQ3_XXS: 0.22, Q.IQ3_S: 0.17}


@pytest.mark.parametrize("qtype", sorted(ENCODABLE), ids=lambda q: q.name)
def test_encode_roundtrips_through_gguf_dequantize(qtype):
    x = np.random.default_rng(1).standard_normal((6, 512)).astype(np.float32)
    y = qref.dequantize(encode(x, qtype), qtype)  # independent decoder (gguf-py's, checked against ggml's C)
    assert y.shape == x.shape
    rel = np.sqrt(np.mean((y - x) ** 2)) / x.std()
    assert rel <= REL_ERR[qtype] + 1e-7, f"{qtype.name}: relative RMS error {rel:.4f}"
    if qtype == Q.F32:
        assert np.array_equal(y, x)


@pytest.mark.parametrize("qtype", sorted(ENCODABLE), ids=lambda q: q.name)
def test_random_blocks_have_requested_std(qtype):
    blocks = random_blocks(400, qtype, 0.05, np.random.default_rng(2))
    y = qref.dequantize(blocks.reshape(-1), qtype) if qtype in (Q.F32, Q.F16) else qref.dequantize(blocks, qtype)
    y = np.asarray(y, dtype=np.float32).reshape(-1)
    assert np.isfinite(y).all()
    assert 0.04 < y.std() < 0.06 and abs(y.mean()) < 0.01


def test_encode_rejects_bad_row_length():
    with pytest.raises(ValueError, match=r"'blk.0.ffn_up_exps.weight'.*row length 64.*Q4_K block size 256"):
        encode(np.zeros((2, 64), np.float32), Q.Q4_K, name="blk.0.ffn_up_exps.weight")


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_names_are_llama_cpp_names(make_tiny_model, arch):
    """Every tensor written is one llama.cpp's table (gguf.constants) allows for that arch."""
    enum = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
    allowed = {TENSOR_NAMES[t] for t in MODEL_TENSORS[enum]}
    for t in GGUFReader(make_tiny_model(arch=arch)).tensors:
        base = t.name.rsplit(".", 1)[0]
        generic = base.replace(base.split(".")[1], "{bid}", 1) if base.startswith("blk.") else base
        assert generic in allowed, f"{arch}: {t.name} is not a llama.cpp tensor name"


def test_writer_stores_given_values(tmp_path):
    """Given floats come back (via the gguf reader + dequantize) in numpy order, per type."""
    rng = np.random.default_rng(3)
    hp = mm.model_hparams("qwen3moe", layers=1, experts=4, top_k=2, hidden=256, expert_ff=256, heads=4,
                          kv_heads=2, vocab=300)
    tensors = mm.build_tensors("qwen3moe", hp)
    given = {n: rng.standard_normal(t.shape).astype(np.float32) for n, t in tensors.items() if isinstance(t, RandomTensor)}
    path = tmp_path / "given.gguf"
    report = write_moe_gguf(path, "qwen3moe", hp, {**tensors, **given}, "Q8_0", None, expert_quant="Q4_K")
    by_name = {t.name: t for t in GGUFReader(path).tensors}
    for name, x in given.items():
        t = by_name[name]
        assert t.tensor_type == report.qtypes[name]
        y = gq.dequantize(np.asarray(t.data), t.tensor_type).reshape(x.shape)  # independent decoder
        rel = np.sqrt(np.mean((y - x) ** 2)) / x.std()
        assert rel <= REL_ERR[t.tensor_type] + 1e-7, f"{name} ({t.tensor_type.name}): relative RMS error {rel:.4f}"


def test_tokenizer_metadata(make_tiny_model):
    r = GGUFReader(make_tiny_model(vocab=400))
    tokens = r.get_field("tokenizer.ggml.tokens").contents()
    types = r.get_field("tokenizer.ggml.token_type").contents()
    tok = get_tokenizer(400)
    assert len(tokens) == 400 == tok.get_vocab_size()
    assert [tok.id_to_token(i) for i in range(400)] == tokens
    assert {tokens[i] for i, ty in enumerate(types) if ty == 3} >= set(SPECIAL_TOKENS)
    assert r.get_field("tokenizer.ggml.model").contents() == "gpt2"
    assert len(r.get_field("tokenizer.ggml.merges").contents()) == 400 - 256 - len(SPECIAL_TOKENS)
    assert r.get_field("tokenizer.ggml.eos_token_id").contents() == tok.token_to_id("<|im_end|>")
    embd = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert int(embd.shape[1]) == 400


def test_tokenizer_roundtrips_text():
    tok = get_tokenizer(512)
    text = "def f(x):\n    return x * 2  # ünïcode\n<|im_end|>"
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = mm.make_model(tmp_path / "a.gguf", seed=5).read_bytes()
    b = mm.make_model(tmp_path / "b.gguf", seed=5).read_bytes()
    c = mm.make_model(tmp_path / "c.gguf", seed=6).read_bytes()
    assert a == b and len(a) == len(c) and a != c


def test_k_quant_rejects_narrow_experts(tmp_path):
    with pytest.raises(ValueError, match=r"ffn_gate_exps.*row length 64.*Q4_K block size 256"):
        mm.make_model(tmp_path / "x.gguf", quant="Q4_K", hidden=64)


def test_olmoe_needs_kv_heads_equal_heads(tmp_path):
    with pytest.raises(ValueError, match=r"olmoe needs kv_heads == heads.*2 != 4"):
        mm.make_model(tmp_path / "x.gguf", arch="olmoe", kv_heads=2)


def test_target_size_is_approached(tmp_path):
    target = 6 << 20
    path = mm.make_model(tmp_path / "big.gguf", target_size="6MiB")
    size = path.stat().st_size
    assert 0.85 * target < size <= target * 1.01, size


def test_cli_writes_and_reports(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert mm.main([str(out), "--arch", "llama", "--quant", "Q4_0", "--experts", "4", "--top-k", "1"]) == 0
    assert "llama Q4_0" in capsys.readouterr().out and out.is_file()
    assert mm.main([str(out), "--top-k", "9"]) == 1
    assert "top_k=9 > experts=8" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_transformers_reads_config_and_tokenizer(make_tiny_model, arch):
    """An independent GGUF consumer (transformers) agrees on the hyper-parameters and tokenization."""
    transformers = pytest.importorskip("transformers")
    extra = {"head_dim": 32} if arch == "qwen3moe" else {}  # qwen3moe's head dim may differ from hidden/heads
    path = make_tiny_model(arch=arch, quant="Q8_0", experts=6, top_k=3, hidden=64, heads=4, **extra)
    cfg = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if extra:
        assert cfg.head_dim == 32
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.vocab_size) == (6, 3, 512)
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "def f(x):\n    return x + 12345  # héllo\n\n<|im_start|>user\nhi<|im_end|>"
    assert hf.encode(text) == get_tokenizer(512).encode(text).ids
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
