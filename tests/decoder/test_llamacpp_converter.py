"""Files written by llama.cpp's own converter (`convert_hf_to_gguf.py`), not by our writer.

For every supported architecture: a tiny random Hugging Face checkpoint (transformers' own model
class and config, a byte-level BPE or SentencePiece tokenizer trained here), converted by the
converter shipped in the llama-cpp-python source distribution (fetched from the package index,
or a llama.cpp checkout named by MOESTREAM_LLAMA_CPP), then decoded by us: logits against the
same checkpoint in transformers, and streamed through a real daemon (a quarter of the experts
in its arena) equal to resident. Skipped, saying why, where the converter cannot be had.

The converter recognises a BPE tokenizer by the hash of its output on a fixed text; ours are
trained here, so the wrapper tells it which `tokenizer.ggml.pre` to declare and changes nothing
else (the tensors and metadata are the converter's own).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from hf_reference import max_logit_diff
from moestream.decoder.experts.bank import ExpertBank
from moestream.common.layout import ModelLayout
from moestream.decoder.experts.arena import open_arena
from moestream.decoder.generation.loop import generate
from moestream.decoder.models import load_model
from moestream.decoder.experts.resident import QuantResidentExperts

transformers = pytest.importorskip("transformers")
T = transformers
SDIST = "llama-cpp-python==0.3.36"
TOL = 1e-4

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
MOE = dict(num_experts=8, num_experts_per_tok=2)
DELTANET = dict(num_hidden_layers=4, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                moe_intermediate_size=48, shared_expert_intermediate_size=48, **MOE)
# GGUF architecture -> (HF config class, HF model class, config, tokenizer.ggml.pre to declare, converter flags)
CASES = {
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        intermediate_size=96, moe_intermediate_size=48, head_dim=16, norm_topk_prob=True, **MOE), "qwen2", ()),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=64, **MOE), "qwen2", ()),
    "llama": ("MixtralConfig", "MixtralForCausalLM", dict(
        intermediate_size=96, num_local_experts=8, num_experts_per_tok=2), None, ()),  # SentencePiece
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_key_value_heads=4, intermediate_size=48, **MOE), "olmo", ()),
    "deepseek2": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5,
        rope_interleave=True, scoring_func="sigmoid", topk_method="noaux_tc"), "deepseek-v3", ()),
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=64, num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"]), "gpt-4o", ()),
    "qwen3next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        intermediate_size=96, full_attention_interval=4, **DELTANET), "qwen2", ("--no-mtp",)),
    "qwen35moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        layer_types=["linear_attention"] * 3 + ["full_attention"], **DELTANET), "qwen35", ("--no-mtp",)),
    # GLM-4.5 with its NextN/MTP block (written by `_add_mtp_block`, kept by the converter, not run by us)
    "glm4moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, intermediate_size=96, moe_intermediate_size=48, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
        num_nextn_predict_layers=1), "glm4", ()),
    "minimax-m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        head_dim=16, intermediate_size=48, rotary_dim=8, bos_token_id=None, eos_token_id=None, **MOE), "minimax-m2", ()),
    # Llama 4 Maverick-like: MoE on every 2nd layer, top-1; NoPE on layer 3 (HF's attention_chunk_size
    # is llama.cpp's fixed 8192, longer than these prompts); llama3 rope scaling as the real configs
    # (the converter writes it as rope_freqs.weight), its original context short enough that every
    # branch of the ramp is taken at head dim 16
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, intermediate_size=48, intermediate_size_mlp=96, num_local_experts=8,
        num_experts_per_tok=1, interleave_moe_layer_step=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), "llama4", ()),
}

# Runs the converter for every job given as JSON [(tokenizer.ggml.pre or "-", its argv), ...] in one
# process: its imports (torch, transformers: ~10 s) are paid once, not once per architecture.
WRAPPER = '''import json, runpy, sys, traceback
root, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
get_pre = base.TextModel.get_vocab_base_pre
failed = 0
for pre, argv in jobs:
    base.TextModel.get_vocab_base_pre = get_pre if pre == "-" else (lambda self, tokenizer, pre=pre: pre)
    sys.argv = [root + "/convert_hf_to_gguf.py", *argv]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        failed += e.code not in (None, 0)
    except Exception:
        traceback.print_exc()
        failed += 1
sys.exit(1 if failed else 0)
'''


@pytest.fixture(scope="session")
def converter(tmp_path_factory) -> Path:
    """A directory holding llama.cpp's convert_hf_to_gguf.py, conversion/ and gguf-py/."""
    given = os.environ.get("MOESTREAM_LLAMA_CPP")
    if given:
        return Path(given)
    where = tmp_path_factory.mktemp("llama-cpp")
    why = _fetch_sdist(where)
    archives = list(where.glob("*.tar.gz"))
    if why or not archives:
        pytest.skip(f"llama.cpp's converter not available ({SDIST} not downloadable: {why})")
    with tarfile.open(archives[0]) as tar:
        keep = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and
                any(part in m.name for part in ("convert_hf_to_gguf.py", "/conversion/", "/gguf-py/"))]
        tar.extractall(where, members=keep, filter="data")
    archives[0].unlink()
    return next(where.glob("*/vendor/llama.cpp"))


def _fetch_sdist(where: Path) -> str:
    """Download the sdist into `where`; "" or why not. The index's JSON page first (PEP 691: the
    file's URL and sha256), since `pip download` of an sdist builds the package's metadata in an
    isolated environment first (~50 s); pip itself where that page cannot be had."""
    import hashlib
    import urllib.request

    name, version = SDIST.split("==")
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    want = f"{name.replace('-', '_')}-{version}.tar.gz"
    try:
        req = urllib.request.Request(f"{index}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            f = next(f for f in json.load(r)["files"] if f["filename"] == want)
        with urllib.request.urlopen(f["url"], timeout=120) as r:
            data = r.read()
        if hashlib.sha256(data).hexdigest() == f["hashes"]["sha256"]:
            (where / want).write_bytes(data)
            return ""
    except Exception:  # an index without the JSON page, no network: pip decides
        pass
    try:  # well inside the test timeout: a slow index skips this, it does not fail the run
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                              "-d", str(where), SDIST], capture_output=True, text=True, timeout=180)
        return got.stderr.strip()[-200:] if got.returncode else ""
    except subprocess.TimeoutExpired:
        return "download took over 180 s"


def _corpus() -> str:
    import textwrap

    return Path(textwrap.__file__).read_text() + Path(os.__file__).read_text()


# the special tokens a family's converter looks up by name (GLM's `_set_vocab_glm`)
SPECIALS = {"glm4moe": ["[gMASK]", "<sop>", "<|user|>", "<|observation|>"]}


def _bpe_tokenizer(out: Path, specials: tuple[str, ...] = ()) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([_corpus()], trainers.BpeTrainer(
        vocab_size=480, special_tokens=["<|endoftext|>", *specials], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(out)
    return tok.get_vocab_size()


def _spm_tokenizer(out: Path) -> int:
    spm = pytest.importorskip("sentencepiece")
    (out / "corpus.txt").write_text(_corpus())
    spm.SentencePieceTrainer.train(  # Llama/Mistral's options: identity normalization, spaces kept
        input=str(out / "corpus.txt"), model_prefix=str(out / "tokenizer"), vocab_size=512, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        minloglevel=2)
    (out / "corpus.txt").unlink()
    T.LlamaTokenizer(vocab_file=str(out / "tokenizer.model"), legacy=False).save_pretrained(out)
    return 512


def _checkpoint(arch: str, out: Path) -> None:
    cfg_cls, model_cls, kw, pre, _ = CASES[arch]
    out.mkdir(parents=True)
    vocab = _spm_tokenizer(out) if pre is None else _bpe_tokenizer(out, tuple(SPECIALS.get(arch, ())))
    torch.manual_seed(0)
    model = getattr(T, model_cls)(getattr(T, cfg_cls)(**{**COMMON, "vocab_size": vocab, **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)  # big enough that routing and attention matter
    model.save_pretrained(out, safe_serialization=True)
    if kw.get("num_nextn_predict_layers"):
        _add_mtp_block(out, getattr(T, cfg_cls), model_cls, {**COMMON, "vocab_size": vocab, **kw})


def _add_mtp_block(out: Path, cfg_cls, model_cls: str, kw: dict) -> None:
    """GLM-4.5's NextN block as its checkpoints ship it: one more decoder layer after the stack, plus
    eh_proj / enorm / hnorm / shared_head.norm, in a second weights file (HF's model never loads it)."""
    from safetensors.torch import load_file, save_file

    n = kw["num_hidden_layers"]
    longer = getattr(T, model_cls)(cfg_cls(**{**kw, "num_hidden_layers": n + 1}))
    longer.save_pretrained(out / "longer", safe_serialization=True)  # the checkpoint's own per-expert names
    block = {k: v for k, v in load_file(out / "longer" / "model.safetensors").items()
             if k.startswith(f"model.layers.{n}.")}
    d = kw["hidden_size"]
    block.update({f"model.layers.{n}.eh_proj.weight": torch.randn(d, 2 * d) * 0.08,
                  **{f"model.layers.{n}.{t}.weight": torch.ones(d) for t in ("enorm", "hnorm", "shared_head.norm")}})
    save_file(block, out / "model-mtp.safetensors")
    import shutil

    shutil.rmtree(out / "longer")


@pytest.fixture(scope="session")
def converted(converter, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """arch -> (HF checkpoint dir, the F32 GGUF llama.cpp's converter wrote from it)."""
    root = tmp_path_factory.mktemp("converted")
    (root / "convert.py").write_text(WRAPPER)
    out = {}
    for arch in CASES:
        out[arch] = (root / arch, root / f"{arch}.gguf")
        _checkpoint(arch, out[arch][0])

    jobs = [(CASES[arch][3] or "-", [str(hf), "--outfile", str(gguf), "--outtype", "f32", *CASES[arch][4]])
            for arch, (hf, gguf) in out.items()]
    run = subprocess.run([sys.executable, str(root / "convert.py"), str(converter), json.dumps(jobs)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"the converter failed:\n{run.stderr[-3000:]}"
    missing = [arch for arch, (_, gguf) in out.items() if not gguf.is_file()]
    assert not missing, f"the converter wrote no file for {missing}:\n{run.stderr[-3000:]}"
    return out


@pytest.mark.parametrize("arch", list(CASES))
def test_converter_written_file_matches_transformers(converted, arch):
    hf_dir, gguf = converted[arch]
    layout = ModelLayout(gguf)
    assert layout.hparams.arch == arch
    if arch == "glm4moe":  # the converter kept the NextN block: in the file, not in the stack
        assert layout.kv("glm4moe.block_count") == 4 and layout.hparams.n_layer == 3
        assert "blk.3.nextn.eh_proj.weight" in layout.dense and "blk.3.ffn_gate_exps.weight" in layout.tensors
    if arch == "llama4":  # llama3 rope scaling: per-frequency factors, some of them not 1
        factors = layout.tensor_bytes("rope_freqs.weight").view("float32")
        assert layout.experts.moe_layers == [1, 3] and factors.min() == 1.0 and factors.max() == 8.0

    def build_hf(_path):
        return getattr(T, CASES[arch][1]).from_pretrained(hf_dir, dtype=torch.float32).eval()

    diff = max_logit_diff(gguf, build_hf, prompt_len=12, decode_steps=4)
    print(f"{arch} (llama.cpp's converter, F32): max abs logit diff vs transformers {diff:.3g}")
    assert diff <= TOL


@pytest.mark.parametrize("arch", list(CASES))
def test_converter_written_file_streams_as_it_decodes_resident(converted, start_daemon, arch):
    _, gguf = converted[arch]
    layout = ModelLayout(gguf)
    model = load_model(layout, keep_quantized=True)
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79]]
    with QuantResidentExperts(layout) as resident:
        want = generate(model.with_bank(ExpertBank(resident)), prompts, 6).tokens
    slots = max(layout.hparams.n_expert_used, layout.experts.n_blobs // 4)  # a quarter of the experts
    d = start_daemon(gguf, arena_slots=slots)
    with open_arena(layout, d.endpoint) as streamed:
        assert generate(model.with_bank(ExpertBank(streamed)), prompts, 6).tokens == want
