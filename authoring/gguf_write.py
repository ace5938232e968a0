"""Write a GGUF MoE file the way llama.cpp lays one out, streaming tensor data in chunks.

Tensors are given in numpy (torch) order, e.g. an expert tensor is [n_expert, n_out, n_in];
GGUF stores the reversed shape (ne = [n_in, n_out, n_expert]). A tensor is either a float32
array (its values are quantized) or a `RandomTensor` (random codes generated block by block
while writing, so multi-GiB files never sit in memory as floats).

Quant choice per tensor, as llama.cpp does: norms, routers (`ffn_gate_inp*`) and biases stay
F32; `*_exps` get `expert_quant`, or what a `QuantMix` says for that layer and part (each
tensor is written in its own type); other matrices get `dense_quant`. An expert tensor whose
rows do not fit its quant's block raises ValueError; a dense matrix falls back to Q8_0, then
F16, and the fallback is reported in `WriteReport.notes` (llama.cpp falls back likewise).
"""

from __future__ import annotations

import dataclasses
import re
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from ..common.arch import ArchSpec, arch_key, get_arch
from .quant_mix import QuantMix
from .quantize import check_row, encode, qtype_of, random_blocks, row_bytes

CHUNK_BYTES = 64 << 20  # bytes generated/quantized per write call

# GGUF `general.file_type` (llama_ftype) for a file whose big matrices have this type.
FILE_TYPES: dict[Q, gguf.LlamaFileType] = {
    Q.F32: gguf.LlamaFileType.ALL_F32, Q.F16: gguf.LlamaFileType.MOSTLY_F16,
    Q.BF16: gguf.LlamaFileType.MOSTLY_BF16, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    Q.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0, Q.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1,
    Q.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M, Q.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K,
    Q.Q2_K: gguf.LlamaFileType.MOSTLY_Q2_K, Q.Q3_K: gguf.LlamaFileType.MOSTLY_Q3_K_M,
    Q.Q5_K: gguf.LlamaFileType.MOSTLY_Q5_K_M, Q.MXFP4: gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
}  # any other type T: MOSTLY_T (IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, Q1_0, NVFP4, ...)


def file_type(q: Q) -> int:
    return int(FILE_TYPES[q] if q in FILE_TYPES else gguf.LlamaFileType[f"MOSTLY_{q.name}"])

# Metadata keys every architecture gets: key -> hparam field (see `_arch_keys` for the rest).
_COMMON_KEYS = {
    "block_count": "n_layer", "context_length": "context_length", "embedding_length": "n_embd",
    "feed_forward_length": "n_ff", "attention.head_count": "n_head", "attention.head_count_kv": "n_head_kv",
    "rope.dimension_count": "head_dim", "expert_count": "n_expert", "expert_used_count": "n_expert_used",
}
_FLOAT_KEYS = {"rope.freq_base": "rope_base", "attention.layer_norm_rms_epsilon": "rms_eps"}
_HP_DEFAULTS = {"context_length": 4096, "rope_base": 1_000_000.0, "rms_eps": 1e-6, "n_ff_shexp": 0}


def _arch_keys(spec: ArchSpec) -> dict[str, str]:
    """The family's extra integer keys (key -> hparam field), derived from its ArchSpec."""
    keys = {spec.expert_ff_key: "n_ff_exp"} if spec.expert_ff_key else {}  # else feed_forward_length says it
    if spec.head_dim_key:
        keys.update({"attention.key_length": "head_dim", "attention.value_length": "head_dim"})
    if spec.shared_expert and spec.shared_ff_key:
        keys[spec.shared_ff_key] = "n_ff_shexp"
    if spec.linear_attn != "none":  # Gated DeltaNet sizes; rope turns only rope_dim of each head
        keys.update({f"ssm.{k}": f"ssm_{k}" for k in ("conv_kernel", "state_size", "group_count", "time_step_rank",
                                                       "inner_size")})
        keys.update({"full_attention_interval": "full_attention_interval", "rope.dimension_count": "rope_dim"})
    return keys


@dataclass(frozen=True)
class RandomTensor:
    """A tensor generated while writing: random codes decoding to ~uniform values of std `std`."""

    shape: tuple[int, ...]  # numpy order
    std: float
    seed: int = 0


TensorLike = np.ndarray | RandomTensor


@dataclass
class WriteReport:
    path: Path
    nbytes: int
    seconds: float
    qtypes: dict[str, Q] = field(default_factory=dict)  # tensor name -> type written
    parts: list[Path] = field(default_factory=list)  # the files written: [path], or a split's parts
    notes: list[str] = field(default_factory=list)


def normalize_hparams(arch: str, hp: Any) -> dict[str, Any]:
    """hp (dict or dataclass, `HParams` field names) -> dict with derived defaults filled in."""
    d = dict(dataclasses.asdict(hp) if dataclasses.is_dataclass(hp) else hp)
    for key in ("n_layer", "n_embd", "n_head", "n_expert", "n_expert_used", "n_ff_exp"):
        if key not in d:
            raise ValueError(f"hparams for {arch}: missing {key!r}")
    d.setdefault("n_head_kv", d["n_head"])
    d.setdefault("head_dim", d["n_embd"] // d["n_head"])
    for key, value in _HP_DEFAULTS.items():
        d.setdefault(key, value)
    # Mixtral ("llama") and OLMoE read the expert width from feed_forward_length; with a shared
    # expert (Qwen2-MoE) feed_forward_length is the shared expert's width.
    d.setdefault("n_ff", d["n_ff_shexp"] if get_arch(arch).shared_expert else d["n_ff_exp"])
    return d


def tensor_qtype(name: str, shape: tuple[int, ...], expert_q: Q, dense_q: Q, notes: list[str],
                 mix: QuantMix | None = None) -> Q:
    """The type a tensor is stored as (see the module docstring)."""
    if len(shape) == 1 or name.endswith(".bias") or "norm" in name or ".ffn_gate_inp" in name or ".ssm_conv1d" in name:
        return Q.F32  # (llama.cpp keeps the short conv kernels F32 too)
    if "_exps." in name:
        q = mix.expert_qtype(name, expert_q) if mix else expert_q
        check_row(name, shape[-1], q)
        return q
    for q in (dense_q, Q.Q8_0, Q.F16):
        try:
            check_row(name, shape[-1], q)
        except ValueError:
            continue
        if q != dense_q:
            notes.append(f"{name}: row length {shape[-1]} does not fit {dense_q.name}; wrote {q.name}")
        return q
    raise AssertionError("F16 fits every row length")


def _chunks(name: str, t: TensorLike, qtype: Q) -> Iterator[np.ndarray]:
    """Encoded bytes of `t`, a slab of leading-axis slices at a time."""
    rows = int(np.prod(t.shape[:-1]))
    rb = row_bytes(t.shape[-1], qtype)
    step = max(1, CHUNK_BYTES // max(rb, 1))
    if isinstance(t, RandomTensor):
        rng = np.random.default_rng([t.seed, zlib.crc32(name.encode())])  # per-tensor stream: order-independent
        blocks_per_row = rb // gguf.GGML_QUANT_SIZES[qtype][1]
        for r0 in range(0, rows, step):
            yield random_blocks((min(rows, r0 + step) - r0) * blocks_per_row, qtype, t.std, rng)
        return
    flat = np.asarray(t).reshape(rows, t.shape[-1])
    for r0 in range(0, rows, step):
        yield encode(flat[r0:r0 + step], qtype, name=name)


def _validate(name: str, t: TensorLike) -> None:
    if isinstance(t, np.ndarray) and not np.issubdtype(t.dtype, np.floating):
        raise TypeError(f"tensor {name!r}: expected a float array, got {t.dtype}")
    if isinstance(t, np.ndarray) and not np.isfinite(t).all():
        raise ValueError(f"tensor {name!r}: has non-finite values")


def _add_metadata(w: gguf.GGUFWriter, arch: str, hp: dict[str, Any], file_q: Q, name: str) -> None:
    spec = get_arch(arch)
    w.add_name(name)
    w.add_file_type(file_type(file_q))
    extra = hp.get("extra", {})  # family-specific keys (ArchSpec.extra_keys), written as given
    for key, hkey in {**_COMMON_KEYS, **_arch_keys(spec)}.items():
        if key not in extra:
            w.add_uint32(arch_key(arch, key), int(hp[hkey]))
    for key, value in extra.items():
        _add_typed(w, arch_key(arch, key), value)
    for key, hkey in _FLOAT_KEYS.items():
        w.add_float32(arch_key(arch, key), float(hp[hkey]))
    if spec.linear_attn == "split_ba":  # Qwen3.5's loader requires its (interleaved) M-RoPE sections
        half = hp["rope_dim"] // 2
        a = round(half * 11 / 32)  # the real files' [11, 11, 10, 0] out of 32, scaled
        w.add_array(arch_key(arch, "rope.dimension_sections"), [a, a, half - 2 * a, 0])
    if "norm_topk_prob" in hp and bool(hp["norm_topk_prob"]) != spec.norm_topk_prob:
        w.add_bool(arch_key(arch, "expert_weights_norm"), bool(hp["norm_topk_prob"]))


def _add_typed(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    """One metadata value with the GGUF type llama.cpp reads it as (counts uint32, factors float32)."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_string(key, str(value))


def write_moe_gguf(
    path: str | Path,
    arch: str,
    hp: Any,
    tensors: dict[str, TensorLike],
    quant: str | Q,
    tokenizer: Any,
    *,
    expert_quant: str | Q | None = None,
    dense_quant: str | Q | None = None,
    mix: QuantMix | None = None,
    progress: bool = False,
    name: str = "moestream-tiny",
    split_max_size: int = 0,
) -> WriteReport:
    """Write `tensors` (numpy order, float32 or RandomTensor) as a llama.cpp-style GGUF MoE.

    `tokenizer` is a byte-level BPE `tokenizers.Tokenizer` or a SentencePiece `SpmVocab` (see
    tokenizer_data), or None to omit the vocab. With `split_max_size` > 0, a split model as
    `convert_hf_to_gguf.py --split-max-size` writes one (gguf-py's own split logic): parts
    `STEM-0000k-of-0000n.gguf` beside `path`, each at most that many tensor bytes (a tensor
    larger than that gets a part of its own); `report.path` is then the first part,
    `report.parts` all of them. A model that fits in one part is written as one file."""
    t0, path = time.perf_counter(), Path(path)
    get_arch(arch)  # clear error for an unsupported family
    hpd = normalize_hparams(arch, hp)
    eq, dq = qtype_of(expert_quant or quant), qtype_of(dense_quant or quant)
    report = WriteReport(path, 0, 0.0)
    for tname, t in tensors.items():
        _validate(tname, t)
        report.qtypes[tname] = tensor_qtype(tname, tuple(t.shape), eq, dq, report.notes, mix)
    w = gguf.GGUFWriter(path, arch, split_max_size=split_max_size)
    try:
        _add_metadata(w, arch, hpd, qtype_of(quant), name)
        if tokenizer is not None:
            from .tokenizer_data import add_tokenizer_metadata

            add_tokenizer_metadata(w, tokenizer)
        for tname, t in tensors.items():
            q = report.qtypes[tname]
            w.add_tensor_info(tname, tuple(t.shape), np.dtype(np.float32), tensor_nbytes(tuple(t.shape), q), raw_dtype=q)
        w.write_header_to_file(path)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        _write_data(w, tensors, report.qtypes, progress)
    finally:
        w.close()
    report.parts = w.format_shard_names(path)
    report.path = report.parts[0]
    report.nbytes, report.seconds = sum(p.stat().st_size for p in report.parts), time.perf_counter() - t0
    return report


def tensor_nbytes(shape: tuple[int, ...], q: Q) -> int:
    """Bytes of a tensor of numpy-order `shape` stored as `q` (rows of the last axis)."""
    return int(np.prod(shape[:-1])) * row_bytes(shape[-1], q)


def _write_data(w: gguf.GGUFWriter, tensors: dict[str, TensorLike], qtypes: dict[str, Q], progress: bool) -> None:
    """Tensor data in table order, each into the part the writer's table put it in, padded to
    the writer's alignment (as its offsets assume)."""
    part_of = {tname: w.fout[i] for i, shard in enumerate(w.tensors) for tname in shard}
    total = sum(tensor_nbytes(tuple(t.shape), qtypes[n]) for n, t in tensors.items())
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="writing")
    try:
        for tname, t in tensors.items():
            fout = part_of[tname]
            w.write_padding(fout, fout.tell())
            for chunk in _chunks(tname, t, qtypes[tname]):
                chunk.tofile(fout)
                if bar is not None:
                    bar.update(chunk.nbytes)
        for fout in w.fout:
            w.write_padding(fout, fout.tell())
    finally:
        if bar is not None:
            bar.close()
