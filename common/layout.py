"""GGUF model layout: hyper-parameters, dense tensors and the expert index.

Parsed with the `gguf` package's reader. An expert of tensor `blk.L.ffn_<part>_exps.weight`
(ggml ne = [n_in, n_out, n_expert]) is `ne1` rows of `row_bytes = ne0 // block * type_size`
bytes each, so expert e lives at `[off + e*stride, off + (e+1)*stride)` with
`stride = row_bytes * ne1`. A blob is the list of an expert's parts, in `EXPERT_PARTS` order.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from .arch import EXPERT_PARTS, ArchSpec, arch_key, dense_shapes, get_arch, layer_tensors, mla_dims
from .gguf_fields import CompactReader
from .protocol import MODEL_IDENTITY
from .split import ModelFile, SplitError, open_parts

PAGE = 4096

# Quant types the decoder can dequantize (checked here so both processes agree up front).
SUPPORTED_QTYPES: frozenset[GGMLQuantizationType] = frozenset(
    GGMLQuantizationType[n]
    for n in ("F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS MXFP4 "
              "TQ1_0 TQ2_0 Q1_0 NVFP4 IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S").split()
)

_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(\w+?)_exps\.(weight|bias|scale)$")


class ModelFormatError(ValueError):
    """The file is not a GGUF MoE model moestream can serve; the message says why."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as stored: ggml shape order (ne0 first), absolute offset in its file."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    file: int = 0  # which of `ModelLayout.files` holds it (the part of a split model)


@dataclass(frozen=True)
class ExpertPart:
    """One expert's slice of a `*_exps` tensor: `shape` is (n_in, n_out) in ggml order."""

    name: str  # "gate" | "up" | "down" | "gate_up" | e.g. "down.bias"
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # absolute offset in its file
    nbytes: int
    file: int = 0  # which of `ModelLayout.files` holds it: gate, up and down may lie in different parts


def slot_offsets(parts: Sequence[ExpertPart], direct: bool) -> tuple[dict[str, int], int]:
    """Where each part's first byte sits in an arena slot, and the bytes the slot needs.

    The one rule for a slot's layout: parts go in order, each at a PAGE-aligned slot offset,
    each given `round_up(nbytes, PAGE)` bytes. With `direct` (O_DIRECT) a part is read from the
    page holding its first byte, so it gets one more PAGE of room and its first byte sits
    `offset % PAGE` into it (the read then starts at `slot offset - offset % PAGE`).
    Returns ({part name: slot offset of its first byte}, slot bytes used, a PAGE multiple)."""
    where: dict[str, int] = {}
    pos = 0
    for p in parts:
        where[p.name] = pos + (p.offset % PAGE if direct else 0)
        pos += round_up(p.nbytes, PAGE) + (PAGE if direct else 0)
    return where, pos


@dataclass(frozen=True)
class HParams:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    n_vocab: int
    rope_base: float
    rms_eps: float
    context_length: int
    norm_topk_prob: bool
    n_dense_lead: int = 0  # leading layers with a dense FFN instead of experts (leading_dense_block_count)
    n_ff: int = 0  # those layers' FFN width (feed_forward_length)
    moe_step: int = 1  # interleave_moe_layer_step (Llama 4): only every moe_step-th layer is MoE, the others dense
    # family-specific metadata (`ArchSpec.extra_keys`), keyed by the name without "<arch>."
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    # Hybrid linear-attention families (ArchSpec.linear_attn != "none"); zero / empty elsewhere.
    rope_dim: int = 0  # rope.dimension_count where it is a part of head_dim (partial rotary); 0 = head_dim
    recurrent: tuple[bool, ...] = ()  # per layer: Gated DeltaNet (True) or full attention (False)
    ssm_conv_kernel: int = 0  # ssm.conv_kernel: causal conv width
    ssm_state_size: int = 0  # ssm.state_size: key (= value) head dim of the delta rule
    ssm_group_count: int = 0  # ssm.group_count: key heads
    ssm_time_step_rank: int = 0  # ssm.time_step_rank: value heads
    ssm_inner_size: int = 0  # ssm.inner_size: value heads x value head dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s FFN is routed experts (else a dense FFN: no expert to fetch)."""
        return layer >= self.n_dense_lead and (layer + 1) % self.moe_step == 0


SAMPLE_CHUNKS = 64  # data chunks hashed into a fingerprint, spread evenly over the tensor data
SAMPLE_CHUNK_BYTES = 64 << 10  # 64 x 64 KiB = 4 MiB read per open, whatever the file's size


@dataclass(frozen=True)
class Fingerprint:
    """The model's identity by content: `size`, `header_sha256` (metadata and tensor table) and
    `sample_sha256` (`SAMPLE_CHUNKS` chunks spread over the tensor data; all of it when smaller).
    Two files with the same three are the same model whatever their path and mtime (a copy, a
    `touch`); a same-shaped model with other weights differs in the sample. `path`, `mtime_ns`
    and `sample_bytes` are for people (and say which file), not compared."""

    path: str
    size: int
    mtime_ns: int
    header_sha256: str
    sample_sha256: str
    sample_bytes: int

    IDENTITY: ClassVar[tuple[str, ...]] = MODEL_IDENTITY  # the compared fields

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "mtime_ns": self.mtime_ns, "header_sha256": self.header_sha256,
                "sample_sha256": self.sample_sha256, "sample_bytes": self.sample_bytes}

    def identity(self) -> dict[str, Any]:
        """What says "the same model": the fields two files must share (see the class docstring)."""
        return {k: getattr(self, k) for k in self.IDENTITY}


def sample_ranges(start: int, end: int, chunks: int = SAMPLE_CHUNKS,
                  chunk: int = SAMPLE_CHUNK_BYTES) -> list[tuple[int, int]]:
    """The byte ranges of [start, end) a fingerprint hashes: all of it when it fits in `chunks`
    chunks, else `chunks` chunks evenly spread, the first at `start` and the last ending at `end`."""
    n = end - start
    if n <= chunks * chunk:
        return [(start, end)] if n > 0 else []
    step = (n - chunk) / (chunks - 1)
    return [(start + int(i * step), start + int(i * step) + chunk) for i in range(chunks)]


@dataclass
class ExpertIndex:
    """Byte ranges of every (layer, expert) blob. Layers with a dense FFN (DeepSeek's leading
    layers) have no experts: `moe_layers` lists the others, and sizes are over those only."""

    n_layer: int
    n_expert: int
    # parts[layer] = list of (part name, tensor) for that layer's expert tensors, in blob order
    # (empty for a dense layer)
    tensors: list[list[tuple[str, TensorInfo]]] = field(default_factory=list)
    _parts: dict[tuple[int, int], tuple[ExpertPart, ...]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def moe_layers(self) -> list[int]:
        return [layer for layer, parts in enumerate(self.tensors) if parts]

    def is_moe_layer(self, layer: int) -> bool:
        return 0 <= layer < len(self.tensors) and bool(self.tensors[layer])

    @property
    def n_blobs(self) -> int:
        """(layer, expert) keys that exist: experts of the MoE layers."""
        return len(self.moe_layers) * self.n_expert

    def parts(self, layer: int, expert: int) -> list[ExpertPart]:
        known = self._parts.get((layer, expert))  # (the daemon asks once per miss: built once per key)
        if known is not None:
            return list(known)
        if not (0 <= layer < self.n_layer and 0 <= expert < self.n_expert):
            raise IndexError(f"expert ({layer}, {expert}) out of range [0,{self.n_layer}) x [0,{self.n_expert})")
        if not self.tensors[layer]:
            raise IndexError(f"expert ({layer}, {expert}): layer {layer} has a dense FFN, no experts")
        out = []
        for name, t in self.tensors[layer]:
            stride = t.nbytes // self.n_expert
            out.append(ExpertPart(name, t.qtype, t.shape[:-1], t.offset + expert * stride, stride, t.file))
        self._parts[layer, expert] = tuple(out)
        return out

    def blob_bytes(self, layer: int) -> int:
        return sum(t.nbytes // self.n_expert for _, t in self.tensors[layer])

    @cached_property
    def max_blob_bytes(self) -> int:
        return max(self.blob_bytes(layer) for layer in self.moe_layers)

    def slot_bytes(self, direct_io: bool = False) -> int:
        """Arena slot size: what `slot_offsets` needs for the largest blob (every expert of a
        layer has the same part sizes, so expert 0 stands for all of them)."""
        return max((slot_offsets(self.parts(layer, 0), direct_io)[1] for layer in self.moe_layers), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(self.blob_bytes(layer) * self.n_expert for layer in range(self.n_layer))

    def summary(self) -> dict[str, Any]:
        return {
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "moe_layers": len(self.moe_layers),
            "max_blob_bytes": self.max_blob_bytes,
            "total_bytes": self.total_bytes,
            "parts": [name for name, _ in self.tensors[self.moe_layers[0]]] if self.moe_layers else [],
        }


class ModelLayout:
    """Everything both processes need to know about a GGUF MoE file, parsed once.

    A split model (`NAME-0000k-of-0000n.gguf`, see `split`) is opened from any of its parts:
    `files` lists every part (one entry for a single file), `path` is the first part's,
    `reader` the first part's (all metadata), `readers[i]` part i's (its tensors' bytes)."""

    def __init__(self, path: str | os.PathLike[str]):
        try:
            self.files, self.readers = open_parts(Path(os.path.abspath(path)), _open_reader)
        except SplitError as e:
            raise ModelFormatError(str(e)) from None
        self.path = self.files[0].path
        self.reader = self.readers[0]
        self.file_size = sum(f.size for f in self.files)  # all parts
        self.arch_name = str(self._kv("general.architecture"))
        try:
            self.spec: ArchSpec = get_arch(self.arch_name)
        except ValueError as e:
            raise ModelFormatError(f"{self.path.name}: {e}") from None
        self.tensors = self._tensor_table()
        self.hparams = self._hparams()
        self.experts = self._expert_index()
        self.dense = {n: t for n, t in self.tensors.items() if not _EXPERT_RE.match(n)}
        self._check_dense()

    # -- metadata -------------------------------------------------------------------------
    def _kv(self, key: str, default: Any = ...) -> Any:
        f = self.reader.get_field(key)
        if f is None:
            if default is ...:
                raise ModelFormatError(f"{self.path.name}: missing metadata key {key!r}")
            return default
        return f.contents()

    def kv(self, key: str, default: Any = None) -> Any:
        """A metadata value as a Python object (strings, numbers, lists), or `default`."""
        return self._kv(key, default)

    def _akv(self, key: str, default: Any = ...) -> Any:
        return self._kv(arch_key(self.arch_name, key), default)

    def _hparams(self) -> HParams:
        n_embd, n_head = int(self._akv("embedding_length")), int(self._akv("attention.head_count"))
        spec = self.spec
        ff_key = spec.expert_ff_key or "feed_forward_length"
        head_dim = int(self._akv("attention.key_length", n_embd // n_head)) if spec.head_dim_key else n_embd // n_head
        vocab = self.tensors.get("token_embd.weight")
        if vocab is None:
            raise ModelFormatError(f"{self.path.name}: missing tensor 'token_embd.weight'")
        hybrid = self._hybrid_hparams() if spec.linear_attn != "none" else {}
        return HParams(
            arch=self.arch_name,
            # MTP (nextn_predict_layers) blocks after the stack are not part of the forward pass
            n_layer=hybrid.pop("n_layer", int(self._akv("block_count")) - int(self._akv("nextn_predict_layers", 0))),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(self._akv("attention.head_count_kv", n_head)),
            head_dim=head_dim,
            n_expert=int(self._akv("expert_count", 0)),
            n_expert_used=int(self._akv("expert_used_count", 0)),
            n_ff_exp=int(self._akv(ff_key)),
            n_ff_shexp=self._shared_ff(ff_key),
            n_vocab=int(vocab.shape[1]),
            rope_base=float(self._akv("rope.freq_base", 10000.0)),
            rms_eps=float(self._akv("attention.layer_norm_rms_epsilon", 1e-6)),
            context_length=int(self._akv("context_length", 4096)),
            norm_topk_prob=bool(self._akv("expert_weights_norm", spec.norm_topk_prob)),
            rope_dim=int(self._akv("rope.dimension_count", 0)) if spec.linear_attn != "none" else 0,
            n_dense_lead=int(self._akv("leading_dense_block_count", 0)),
            n_ff=int(self._akv("feed_forward_length", 0)),
            moe_step=max(1, int(self._akv("interleave_moe_layer_step", 1))),
            extra=self._extra(),
            **hybrid,
        )

    def _shared_ff(self, ff_key: str) -> int:
        """Shared-expert width: its own key, or (DeepSeek) expert width x expert_shared_count."""
        if self.spec.shared_ff_key:
            return int(self._akv(self.spec.shared_ff_key, 0))
        return int(self._akv(ff_key)) * int(self._akv("expert_shared_count", 0))

    def _extra(self) -> dict[str, Any]:
        """The family's `ArchSpec.extra_keys`, typed; a required one missing is a format error."""
        out: dict[str, Any] = {}
        for key, typ, default in self.spec.extra_keys:
            value = self._akv(key, default)
            try:
                out[key] = typ(value) if typ is not str else str(value)
            except (TypeError, ValueError):
                raise ModelFormatError(f"{self.path.name}: metadata {arch_key(self.arch_name, key)!r} = {value!r} "
                                       f"is not a {typ.__name__}") from None
        return out

    def _hybrid_hparams(self) -> dict[str, Any]:
        """Gated-DeltaNet sizes, and which layers are recurrent: every `full_attention_interval`-th
        is full attention (llama.cpp's rule, default 4). MTP (`nextn_predict_layers`) blocks at the
        end of the stack are not part of the forward pass: n_layer excludes them."""
        keys = ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size")
        out: dict[str, Any] = {f"ssm_{k}": int(self._akv(f"ssm.{k}")) for k in keys}
        if out["ssm_group_count"] <= 0 or out["ssm_time_step_rank"] % out["ssm_group_count"]:
            raise ModelFormatError(f"{self.path.name}: ssm.time_step_rank={out['ssm_time_step_rank']} is not a "
                                   f"multiple of ssm.group_count={out['ssm_group_count']}")
        if out["ssm_inner_size"] != out["ssm_time_step_rank"] * out["ssm_state_size"]:
            raise ModelFormatError(f"{self.path.name}: ssm.inner_size={out['ssm_inner_size']} != time_step_rank x "
                                   f"state_size (value head dim must equal key head dim, as llama.cpp assumes)")
        n_layer = int(self._akv("block_count")) - int(self._akv("nextn_predict_layers", 0))
        interval = int(self._akv("full_attention_interval", 4))
        out["n_layer"] = n_layer
        out["recurrent"] = tuple((i + 1) % interval != 0 for i in range(n_layer))
        return out

    # -- tensors --------------------------------------------------------------------------
    def _tensor_table(self) -> dict[str, TensorInfo]:
        out: dict[str, TensorInfo] = {}
        for file, reader in enumerate(self.readers):
            for t in reader.tensors:
                qtype = GGMLQuantizationType(t.tensor_type)
                info = TensorInfo(t.name, qtype, tuple(int(x) for x in t.shape), int(t.data_offset), int(t.n_bytes), file)
                # (a table pointing past the end of the file was rejected by _CheckedReader already)
                if qtype not in SUPPORTED_QTYPES:
                    raise ModelFormatError(f"{self.files[file].path.name}: tensor {t.name!r} has unsupported quant "
                                           f"type {qtype.name}")
                if t.name in out:
                    raise ModelFormatError(f"{self.files[file].path.name}: tensor {t.name!r} is also in "
                                           f"{self.files[out[t.name].file].path.name} (a part of another split?)")
                out[t.name] = info
        return out

    def where(self, t: TensorInfo) -> str:
        """The name of the file holding `t` (the part of a split model), for error messages."""
        return self.files[t.file].path.name

    def _expert_index(self) -> ExpertIndex:
        hp = self.hparams
        if hp.n_expert <= 0 or hp.n_expert_used <= 0:
            raise ModelFormatError(f"{self.path.name}: not a MoE model (expert_count={hp.n_expert}, "
                                   f"expert_used_count={hp.n_expert_used})")
        if hp.n_expert_used > hp.n_expert:
            raise ModelFormatError(f"{self.path.name}: expert_used_count={hp.n_expert_used} > expert_count={hp.n_expert}")
        by_layer: list[dict[str, TensorInfo]] = [{} for _ in range(hp.n_layer)]
        for name, t in self.tensors.items():
            m = _EXPERT_RE.match(name)
            if not m:
                continue
            layer, part, kind = int(m.group(1)), m.group(2), m.group(3)
            if hp.n_layer <= layer < int(self._akv("block_count")):
                continue  # an MTP (nextn) block after the stack: not run, its experts never served
            if layer >= hp.n_layer:
                raise ModelFormatError(f"{self.path.name}: tensor {name!r} names layer {layer} but block_count={hp.n_layer}")
            by_layer[layer][part if kind == "weight" else f"{part}.{kind}"] = t
        if not 0 <= hp.n_dense_lead < hp.n_layer:
            raise ModelFormatError(f"{self.path.name}: leading_dense_block_count={hp.n_dense_lead} leaves no MoE layer "
                                   f"of block_count={hp.n_layer}")
        index = ExpertIndex(hp.n_layer, hp.n_expert)
        for layer, parts in enumerate(by_layer):
            if hp.is_moe_layer(layer):
                index.tensors.append(self._layer_parts(layer, parts))
            elif parts:
                raise ModelFormatError(f"{self.path.name}: layer {layer} is a dense layer (leading_dense_block_count="
                                       f"{hp.n_dense_lead}, interleave_moe_layer_step={hp.moe_step}) but has expert "
                                       f"tensors ({', '.join(parts)})")
            else:
                index.tensors.append([])  # a dense FFN: no experts
        return index

    def _layer_parts(self, layer: int, parts: dict[str, TensorInfo]) -> list[tuple[str, TensorInfo]]:
        hp, name = self.hparams, self.path.name
        fused = "gate_up" in parts
        needed = ("gate_up", "down") if fused else ("gate", "up", "down")
        for part in needed:
            if part not in parts:
                raise ModelFormatError(f"{name}: missing expert tensor 'blk.{layer}.ffn_{part}_exps.weight'")
        n_ff = hp.n_ff_exp * (2 if fused else 1)
        want = {"gate": (hp.n_embd, n_ff), "up": (hp.n_embd, n_ff), "gate_up": (hp.n_embd, n_ff), "down": (hp.n_ff_exp, hp.n_embd),
                "gate.bias": (n_ff,), "up.bias": (n_ff,), "gate_up.bias": (n_ff,), "down.bias": (hp.n_embd,)}  # gpt-oss
        for part, t in parts.items():
            name = self.where(t)  # the part of a split model that holds it
            if t.shape[-1] != hp.n_expert:
                raise ModelFormatError(f"{name}: inconsistent expert count: tensor {t.name!r} has {t.shape[-1]} experts "
                                       f"but expert_count={hp.n_expert}")
            if part in want and t.shape != (*want[part], hp.n_expert):
                raise ModelFormatError(f"{name}: mis-shaped expert tensor {t.name!r}: shape {list(t.shape)}, "
                                       f"expected {[*want[part], hp.n_expert]}")
            block = GGML_QUANT_SIZES[t.qtype][0]
            if t.shape[0] % block:
                raise ModelFormatError(f"{name}: tensor {t.name!r}: row length {t.shape[0]} is not a multiple "
                                       f"of the {t.qtype.name} block size {block}")
        order = [p for p in EXPERT_PARTS if p in parts] + sorted(p for p in parts if p not in EXPERT_PARTS)
        return [(p, parts[p]) for p in order]

    def _check_dense(self) -> None:
        hp, spec, name = self.hparams, self.spec, self.path.name
        if "output_norm.weight" not in self.dense:  # (token_embd.weight: checked by _hparams)
            raise ModelFormatError(f"{name}: missing tensor 'output_norm.weight'")
        if spec.attention == "mla":
            try:
                mla_dims(hp)
            except ValueError as e:
                raise ModelFormatError(f"{name}: {e}") from None
        for layer in range(hp.n_layer):
            for t in layer_tensors(spec, hp, layer, self.dense.__contains__):
                self._require(t)
            if spec.linear_attn != "none" and hp.recurrent[layer]:
                legacy = f"blk.{layer}.ssm_in.weight" in self.dense  # older Qwen3-Next files: fused q,k,v,z
                for t in spec.recurrent_tensors:
                    if not (legacy and t in ("attn_qkv.weight", "attn_gate.weight")):
                        self._require(f"blk.{layer}.{t}")
            else:
                for t in spec.attn_layer_tensors:
                    self._require(f"blk.{layer}.{t}.weight")
        self._check_dense_shapes()

    def _check_dense_shapes(self) -> None:
        """Every dense tensor the family knows has one of the shapes it may have (ggml order)."""
        for name, shapes in dense_shapes(self.spec, self.hparams).items():
            t = self.dense.get(name)
            if t is not None and t.shape not in shapes:
                want = " or ".join(str(list(s)) for s in shapes)
                raise ModelFormatError(f"{self.where(t)}: mis-shaped tensor {name!r}: shape {list(t.shape)}, "
                                       f"expected {want} (ggml order)")

    def _require(self, tensor: str) -> TensorInfo:
        if tensor not in self.dense:
            raise ModelFormatError(f"{self.path.name}: missing tensor {tensor!r} required by {self.arch_name}")
        return self.dense[tensor]

    # -- views ----------------------------------------------------------------------------
    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor (a read-only view of its file's memory map)."""
        return self.bytes_of(self.tensors[name])

    def bytes_of(self, t: TensorInfo | ExpertPart) -> np.ndarray:
        """The raw bytes of a tensor or an expert's part (a read-only view of its file's memory map)."""
        return self.readers[t.file].data[t.offset : t.offset + t.nbytes]

    def data(self, file: int = 0) -> np.ndarray:
        """The memory map of `files[file]`, uint8, read-only."""
        return self.readers[file].data

    @property
    def dense_bytes(self) -> int:
        return sum(t.nbytes for t in self.dense.values())

    @cached_property
    def fingerprint(self) -> Fingerprint:
        """Every part counts: sizes summed, headers hashed in part order, the sample spread over
        the parts' data sections as if they were one (a single file: exactly its own)."""
        header = hashlib.sha256()
        for r in self.readers:
            header.update(r.data[: r.data_offset])  # metadata + tensor table (mapped already: parsed)
        sample, nbytes = hashlib.sha256(), 0
        # The sample by pread, not through the map: touching it there maps whole page-cache folios
        # (measured: 126 MB of RSS for 4 MiB hashed), which a memory cap would charge to the process.
        for f, ranges in _sample_by_file(self.files):
            with open(f.path, "rb", buffering=0) as fh:
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # no readahead around the chunks
                for lo, hi in ranges:
                    sample.update(os.pread(fh.fileno(), hi - lo, lo))
                    nbytes += hi - lo
        return Fingerprint(str(self.path), self.file_size, max(f.mtime_ns for f in self.files),
                           header.hexdigest(), sample.hexdigest(), nbytes)

    def quant_types(self) -> dict[str, int]:
        """Quant type name -> number of tensors of that type."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.qtype.name] = out.get(t.qtype.name, 0) + 1
        return out


def _sample_by_file(files: Sequence[ModelFile]) -> list[tuple[ModelFile, list[tuple[int, int]]]]:
    """`sample_ranges` over the files' data sections laid end to end, cut back into per-file ranges."""
    spans, pos = [], 0  # (file, start in the joined data, its data start)
    for f in files:
        spans.append((f, pos, f.data_offset))
        pos += f.size - f.data_offset
    out = []
    joined = sample_ranges(0, pos)
    for f, start, data_offset in spans:
        end = start + f.size - data_offset
        mine = [(max(lo, start) - start + data_offset, min(hi, end) - start + data_offset)
                for lo, hi in joined if lo < end and hi > start]
        out.append((f, mine))
    return out


class _CheckedReader(CompactReader):
    """GGUFReader that names the tensor when the table points past the end of the file or
    holds an unknown type (the stock reader fails later with a bare numpy reshape error), and
    keeps metadata arrays compact (`gguf_fields`: a vocabulary is not 300,000 numpy views)."""

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for tensor_field in fields:
            _, name_data, _, dims, raw_type, offset = tensor_field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                qtype = GGMLQuantizationType(int(raw_type[0]))
            except ValueError:
                raise ModelFormatError(f"tensor {name!r} has unknown quant type {int(raw_type[0])}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            end = int(start_offs) + int(offset[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise ModelFormatError(f"truncated: tensor {name!r} ends at byte {end} but the file has {size} bytes")
        super()._build_tensors(start_offs, fields)


def _open_reader(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFormatError(f"{path.name}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return _CheckedReader(path, "r")
    except ModelFormatError as e:
        raise ModelFormatError(f"{path.name}: {e}") from None
    except (ValueError, KeyError, IndexError, OSError) as e:
        # The reader fails deep inside on truncated headers or unknown enum values.
        raise ModelFormatError(f"{path.name}: unreadable GGUF header or tensor table: {e}") from None

