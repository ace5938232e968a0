"""What every comparison with Hugging Face `transformers` shares: the GGUF's tensors as gguf-py
alone reads them, and the logits of our model and HF's side by side, prompt then greedy steps."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import re

import numpy as np
import torch
from gguf import GGUFReader
from qref import dequantize as gguf_dequantize  # gguf-py's numpy code (Q1_0: a reference from ggml's layout)

from moestream.decoder.experts.bank import ExpertBank
from moestream.decoder.generation.loop import forward_step
from moestream.common.layout import ModelLayout
from moestream.decoder.experts.source import ResidentExperts
from moestream.decoder.models import load_model


def gguf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor as float32 in numpy (= HF) shape order, via gguf-py alone (every part of a
    split file, found by llama.cpp's naming, NAME-0000k-of-0000n.gguf)."""
    out = {}
    for part in _parts(Path(path)):
        for t in GGUFReader(part).tensors:
            arr = gguf_dequantize(np.asarray(t.data), t.tensor_type)
            out[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist()))))
    return out


def _parts(path: Path) -> list[Path]:
    m = re.fullmatch(r"(.*)-(\d{5})-of-(\d{5})\.gguf", path.name)
    if not m:
        return [path]
    return [path.with_name(f"{m[1]}-{k:05d}-of-{m[3]}.gguf") for k in range(1, int(m[3]) + 1)]


def max_logit_diff(path: str | Path, build_hf: Callable[[str | Path], torch.nn.Module], prompt_len: int,
                   decode_steps: int, check_greedy: bool = False, source: Callable = ResidentExperts) -> float:
    """Max |ours - HF| over the prompt's logits and each greedy decode step: ours through its
    cache one token at a time, HF on the whole sequence each step (its own cache not involved).
    HF's greedy choice drives both; with `check_greedy` ours must choose the same. `source` makes
    our expert source from the layout (default: the dequantized-weight ResidentExperts)."""
    layout = ModelLayout(path)
    ours, experts, hf = load_model(layout), source(layout), build_hf(path)
    seq = torch.randint(0, layout.hparams.n_vocab, (1, prompt_len), generator=torch.Generator().manual_seed(7))
    cache = ours.new_cache(1, prompt_len + decode_steps)
    worst = 0.0
    with torch.inference_mode():
        logits = forward_step(ours.with_bank(ExpertBank(experts)), seq, cache)  # [1, T, V]
        for step in range(decode_steps + 1):
            ref = hf(input_ids=seq, use_cache=False).logits  # [1, T, V]
            mine = logits if step == 0 else logits[:, -1:]
            worst = max(worst, (mine - ref[:, -mine.shape[1]:]).abs().max().item())
            if step == decode_steps:
                break
            nxt = ref[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            if check_greedy:
                assert nxt.item() == mine[:, -1].argmax(-1).item(), f"greedy token differs at step {step}"
            seq = torch.cat([seq, nxt], dim=1)
            logits = forward_step(ours.with_bank(ExpertBank(experts)), nxt, cache)  # [1, 1, V]
    return worst
