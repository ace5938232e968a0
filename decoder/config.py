"""`DecoderConfig`: everything one decoder process is told, validated once on construction.

Built from the command line (`moestream generate`), optionally over a TOML file whose keys are
the field names; command-line values win.
"""

from __future__ import annotations

import sys
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .generation.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SLOT_FORMATS = ("auto", "quant", "raw")
GPU_EXPERTS = ("slots", "arena")
# Prompt positions per prefill pass. A pass's buffers grow with its positions (the MoE layer's
# rows per (token, expert) pair, attention's scores): a 2,000-token prompt in one pass peaked at
# 573-624 MiB of anonymous memory on a 16-layer 1024-wide model, in passes of 256 at 367 MiB
# (512: 400-424), prefilling as fast within this VM's noise (7.0-7.1 s against 6.7-8.3).
PREFILL_CHUNK = 256


class ConfigError(ValueError):
    """A decoder setting is invalid; the message names it."""


@dataclass
class DecoderConfig:
    model: str = ""  # GGUF file (required; a default so a TOML file may supply it)
    prompts: list[str] = field(default_factory=list)
    prompt_ids: list[list[int]] = field(default_factory=list)  # prompts given as token ids
    iod: str | None = None  # moestream-iod endpoint (streamed experts)
    resident: bool = False  # every expert in process, no daemon
    device: str = "auto"  # auto -> cuda if available, else cpu
    dtype: str = "auto"  # auto -> bfloat16 on cuda, float32 on cpu
    kv_dtype: str = "auto"  # the KV cache's: auto -> dtype; float16 halves it (the CPU attention reads it as it is)
    slots: int | None = None  # device slot cache size, in experts (streamed, raw slots)
    cache_bytes: int | None = None  # ... or in bytes
    slot_format: str = "auto"  # auto -> raw on cuda, quant on cpu
    gpu_experts: str = "slots"  # streamed on a GPU: a device slot cache, or the arena read in place (zero copy)
    prefetch: int = 1  # layers of router look-ahead (0 = off)
    prefetch_at: str | None = None  # predict after a layer or after its attention (default: see below)
    prefetch_top: int | None = None  # experts per token and layer to prefetch (None: the expert source's width)
    max_new_tokens: int = 32
    prefill_chunk: int = PREFILL_CHUNK  # prompt positions per prefill pass (its buffers grow with them)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    chat: bool = False
    stats: bool = False
    json: bool = False  # one JSON object on stdout instead of text
    trace_out: str | None = None  # write the routing trace here (JSON, `moestream simulate` reads it)
    force_routing: str | None = None  # replay this trace's expert ids (.npy [tokens, layers, k]) instead of routing
    progress: bool = field(default_factory=lambda: sys.stderr.isatty())  # bars only for a person watching
    fetch_timeout_s: float = 60.0
    threads: int | None = None  # compute threads (numba kernels, torch); None: every core
    reconnect_s: float = 30.0  # how long to wait for a restarted daemon before giving up (0: at once)

    def __post_init__(self) -> None:
        self._check_source()
        self._check_numbers()
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_dtype != "auto" and self.kv_dtype not in DTYPES:
            raise ConfigError(f"kv_dtype must be auto or one of {', '.join(DTYPES)}, got {self.kv_dtype!r}")
        if self.torch_device.type == "cpu" and self.torch_kv_dtype == torch.bfloat16:
            raise ConfigError("a bfloat16 KV cache is for CUDA; on a CPU use float16 (half the memory of "
                              "float32) or float32")
        if self.prefetch_at not in (None, "layer", "attention"):
            raise ConfigError(f"prefetch_at must be layer or attention, got {self.prefetch_at!r}")
        if self.slot_format not in SLOT_FORMATS:
            raise ConfigError(f"slot_format must be one of {', '.join(SLOT_FORMATS)}, got {self.slot_format!r}")
        _ = self.torch_device  # validates the device name (and that CUDA exists when asked for)
        self._check_slot_format()
        try:
            _ = self.sampling  # validates the sampling parameters
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _check_source(self) -> None:
        if not self.model:
            raise ConfigError("no model given (--model PATH)")
        if bool(self.iod) == bool(self.resident):
            raise ConfigError("choose exactly one expert source: --iod ENDPOINT (streamed) or --resident")
        if self.slots is not None and self.cache_bytes is not None:
            raise ConfigError("give --slots or --cache-bytes, not both")
        if not self.prompts and not self.prompt_ids:
            raise ConfigError("no prompt given (--prompt TEXT or --prompt-ids IDS, repeatable)")
        if self.prompts and self.prompt_ids:
            raise ConfigError("give prompts as text (--prompt) or as token ids (--prompt-ids), not both")
        if any(not ids for ids in self.prompt_ids):
            raise ConfigError("an empty --prompt-ids list")

    def _check_numbers(self) -> None:
        for name, low in (("slots", 1), ("cache_bytes", 1), ("prefetch", 0), ("prefetch_top", 1),
                          ("max_new_tokens", 1), ("prefill_chunk", 1), ("threads", 1)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.fetch_timeout_s <= 0:
            raise ConfigError(f"fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")
        if isinstance(self.reconnect_s, bool) or not isinstance(self.reconnect_s, (int, float)) or self.reconnect_s < 0:
            raise ConfigError(f"reconnect_s (--reconnect-wait) must be a number of seconds >= 0, got {self.reconnect_s!r}")

    def _check_slot_format(self) -> None:
        if self.gpu_experts not in GPU_EXPERTS:
            raise ConfigError(f"gpu_experts must be one of {', '.join(GPU_EXPERTS)}, got {self.gpu_experts!r}")
        if self.gpu_experts == "arena":
            if self.torch_device.type == "cpu":
                raise ConfigError("--gpu-experts arena is the GPU's zero-copy mode; on a CPU the arena is always read "
                                  "in place (slot format quant)")
            if self.slots is not None or self.cache_bytes is not None:
                raise ConfigError("--gpu-experts arena keeps no device slot cache: size the arena with "
                                  "`moestream-iod --memory`, not --slots/--cache-bytes")
        fmt = self.resolved_slot_format
        if fmt == "quant" and self.torch_device.type != "cpu":
            raise ConfigError("slot format 'quant' (experts computed on their quantized blocks where they lie) "
                              "is the CPU path; on CUDA use raw")
        if fmt == "quant" and self.iod and (self.slots is not None or self.cache_bytes is not None):
            raise ConfigError("with slot format 'quant' the daemon's arena is the only expert cache: size it with "
                              "`moestream-iod --memory`, not --slots/--cache-bytes (those size a raw slot cache)")

    @property
    def torch_device(self) -> torch.device:
        return resolve_device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.kv_dtype == "auto" else DTYPES[self.kv_dtype]

    @property
    def resolved_slot_format(self) -> str:
        """raw on CUDA (a device slot cache of raw blocks, dequantized on use); quant on CPU
        (computed on the quantized blocks where they lie: the file's map or the daemon's arena)."""
        if self.slot_format != "auto":
            return self.slot_format
        return "raw" if self.torch_device.type == "cuda" else "quant"

    @property
    def resolved_prefetch_at(self) -> str:
        """After layer L's attention with the quant format: the guess for L+1 then has all of L's
        experts to arrive (peer model, 32 tokens: 11.9 vs 11.3 tok/s at a 25 % cap, 17.7 vs 16.3 at
        50 %); after layer L otherwise (the slot cache path's measured default)."""
        if self.prefetch_at is not None:
            return self.prefetch_at
        return "attention" if self.resolved_slot_format == "quant" else "layer"

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)

    @classmethod
    def build(cls, toml_path: str | Path | None = None, **overrides: Any) -> "DecoderConfig":
        """Fields from a TOML file (if given), then `overrides` that are not None."""
        values: dict[str, Any] = {}
        if toml_path is not None:
            values.update(load_toml(toml_path))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def resolve_device(name: str) -> torch.device:
    """auto -> cuda if available, else cpu; a clear ConfigError for a bad or absent device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r} (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for but CUDA is not available here")
    return dev


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path}: {e}") from None
    known = {f.name for f in fields(DecoderConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"config file {path}: unknown keys {unknown} (known: {', '.join(sorted(known))})")
    return data
