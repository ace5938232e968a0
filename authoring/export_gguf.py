"""Export a `train_tiny` run to GGUF: llama.cpp's qwen3moe tensor names plus the tokenizer.

The Hugging Face state dict is mapped back through the decoder's own name table
(`decoder.models.arch.qwen3moe.TENSOR_NAMES` / `HF_FUSED`), so export and load cannot drift apart;
HF's fused `gate_up_proj` [E, 2*ff, d] is split into `ffn_gate_exps` (first ff rows) and
`ffn_up_exps`. `--check` runs the trained HF model and our resident decoder on the exported
file over held-out text and prints the largest logit difference.

    python -m moestream.authoring.export_gguf --run /tmp/tiny-train --out src/moestream/data --quant F16 Q8_0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

MODEL_STEM = "tiny-qwen3moe"


def model_path(out_dir: Path, quant: str) -> Path:
    return out_dir / f"{MODEL_STEM}-{quant.lower()}.gguf"


def load_run(run: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, trained state dict) of a finished run."""
    cfg_path, weights = run / "config.json", run / "model.pt"
    for p in (cfg_path, weights, run / "tokenizer.json"):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: missing (is {run} a finished train_tiny run?)")
    return json.loads(cfg_path.read_text()), torch.load(weights, map_location="cpu", weights_only=True)


def gguf_tensors(state: dict[str, torch.Tensor], n_layer: int) -> dict[str, np.ndarray]:
    """HF state dict -> GGUF name -> float32 array in numpy order, in llama.cpp's file order."""
    from ..decoder.models.arch.qwen3moe import HF_FUSED, TENSOR_NAMES

    def arr(t: torch.Tensor) -> np.ndarray:
        return t.detach().to(torch.float32).cpu().numpy()

    out: dict[str, np.ndarray] = {}
    globals_ = {g: h for g, h in TENSOR_NAMES.items() if "{i}" not in g}
    per_layer = {g: h for g, h in TENSOR_NAMES.items() if "{i}" in g}
    out["token_embd.weight"] = arr(state[globals_["token_embd.weight"]])  # [V, d]
    for i in range(n_layer):
        for g, h in per_layer.items():
            out[g.format(i=i)] = arr(state[h.format(i=i)])
        for h, parts in HF_FUSED.items():
            fused = arr(state[h.format(i=i)])  # [E, len(parts)*ff, d]
            for part, chunk in zip(parts, np.split(fused, len(parts), axis=1)):
                out[part.format(i=i)] = np.ascontiguousarray(chunk)  # [E, ff, d]
    for g in ("output_norm.weight", "output.weight"):
        out[g] = arr(state[globals_[g]])
    used = set(TENSOR_NAMES.values()) | set(HF_FUSED)
    stray = sorted(k for k in state if not any(_matches(k, h, n_layer) for h in used))
    if stray:
        raise ValueError(f"trained weights have tensors the GGUF mapping does not cover: {stray[:5]}")
    return out


def _matches(key: str, pattern: str, n_layer: int) -> bool:
    return any(key == pattern.format(i=i) for i in range(n_layer)) if "{i}" in pattern else key == pattern


def export(run: Path, out_dir: Path, quants: list[str]) -> list[Path]:
    """Write one GGUF per quant type; returns their paths."""
    from tokenizers import Tokenizer

    from .gguf_write import write_moe_gguf
    from .train_tiny import gguf_hparams

    cfg, state = load_run(run)
    tensors = gguf_tensors(state, cfg["layers"])
    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for q in quants:
        report = write_moe_gguf(model_path(out_dir, q), "qwen3moe", gguf_hparams(cfg), tensors, q, tok,
                                name=f"moestream {MODEL_STEM} (trained on the Python stdlib)")
        for note in report.notes:
            print(f"note: {note}")
        print(f"wrote {report.path} ({report.nbytes / 2**20:.2f} MiB, {report.seconds:.1f} s)")
        paths.append(report.path)
    return paths


@torch.no_grad()
def max_logit_diff(run: Path, gguf: Path, tokens: int = 128) -> tuple[float, float]:
    """(max |HF - ours| logit difference, |loss_HF - loss_ours|) on one held-out window."""
    from ..common.layout import ModelLayout
    from ..decoder.experts.bank import ExpertBank
    from ..decoder.experts.source import ResidentExperts
    from ..decoder.generation.loop import forward_step
    from ..decoder.models import load_model
    from .train_tiny import build_model

    cfg, state = load_run(run)
    hf = build_model(cfg, state).eval()
    ids = torch.from_numpy(np.load(run / "heldout_ids.npy")[: tokens + 1].astype(np.int64))[None]  # [1, T+1]
    ref = hf(input_ids=ids[:, :-1], output_router_logits=False).logits  # [1, T, V]
    layout = ModelLayout(gguf)
    with ExpertBank(ResidentExperts(layout)) as bank:
        ours = load_model(layout, bank=bank)
        mine = forward_step(ours, ids[:, :-1], ours.new_cache(1, tokens))  # [1, T, V]
    ce = torch.nn.functional.cross_entropy
    dl = abs(ce(ref[0], ids[0, 1:]).item() - ce(mine[0], ids[0, 1:]).item())
    return (ref - mine).abs().max().item(), dl


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moestream.authoring.export_gguf",
                                description="Export a train_tiny run to qwen3moe GGUF files (llama.cpp names).")
    p.add_argument("--run", type=Path, required=True, help="train_tiny run directory (config.json, model.pt)")
    p.add_argument("--out", type=Path, required=True, help=f"output directory ({MODEL_STEM}-<quant>.gguf)")
    p.add_argument("--quant", nargs="+", default=["F16", "Q8_0"], help="quant types to write (default: F16 Q8_0)")
    p.add_argument("--check", action="store_true", help="compare HF vs our decoder's logits on each exported file")
    args = p.parse_args(argv)
    try:
        paths = export(args.run, args.out, args.quant)
        for path in paths if args.check else []:
            diff, dl = max_logit_diff(args.run, path)
            print(f"check {path.name}: max |logit HF - ours| = {diff:.3g}, |loss diff| = {dl:.3g}")
    except (ValueError, OSError, KeyError) as e:
        print(f"export_gguf: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
