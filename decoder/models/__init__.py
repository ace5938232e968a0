"""One module per architecture; `get_model_module(arch)` finds it by GGUF `general.architecture`.

Every module exposes the same names: `ARCH`, `Model(hparams, dense)` (the generic
`moe_transformer.MoETransformer`, or a subclass where the family has something really new; it
satisfies `moe_transformer.MoEModel`), `TENSOR_NAMES` (GGUF -> Hugging Face names) and
`HF_FUSED`. Adding a family = its `common.arch` entry + one module + one line in `_REGISTRY`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ...common.layout import ModelLayout
from ..experts.bank import ExpertBank
from .moe_transformer import MoEModel

# GGUF architecture name -> module under decoder.models.arch (imported on first use)
_REGISTRY: dict[str, str] = {
    "qwen3moe": "qwen3moe",
    "qwen2moe": "qwen2moe",
    "llama": "mixtral",  # Mixtral: llama.cpp stores it as "llama" with experts
    "olmoe": "olmoe",
    "gpt-oss": "gpt_oss",
    "deepseek2": "deepseek2",
    "qwen3next": "qwen3next",
    "qwen35moe": "qwen35moe",
    "glm4moe": "glm4moe",
    "minimax-m2": "minimax_m2",
    "llama4": "llama4",
}


def architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_module(arch: str) -> ModuleType:
    if arch not in _REGISTRY:
        raise ValueError(f"no decoder model for architecture {arch!r} (have: {', '.join(architectures())})")
    return importlib.import_module(f"{__name__}.arch.{_REGISTRY[arch]}")


def load_model(layout: ModelLayout, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               progress: bool = False, keep_quantized: bool = False, bank: ExpertBank | None = None,
               kv_dtype: torch.dtype | None = None) -> MoEModel:
    """The architecture's `Model` with every dense weight of `layout` materialized on `device`
    (2-D quantized ones kept as their blocks with `keep_quantized`, on a CPU), computing its
    experts with `bank` (without one: weights only, until `model.with_bank(bank)`); its KV caches
    in `kv_dtype` (default: `dtype`)."""
    from .weights import load_dense

    dense = load_dense(layout, device, dtype or torch.float32, progress, keep_quantized)
    model = get_model_module(layout.hparams.arch).Model(layout.hparams, dense)
    if kv_dtype is not None:
        model.kv_dtype = kv_dtype
    return model if bank is None else model.with_bank(bank)
