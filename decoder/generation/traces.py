"""Record routing traces with our decoder (resident experts) and report how they behave.

Prompts are slices of held-out stdlib files (the start of a file: docstrings and imports, or
its middle: code), each continued by seeded sampling, one prompt at a time so tokens are in
the order a cache sees them. Per processed token we record each layer's real top-k (from the
MoE block's own routing) and, after each layer, the top-k that the routers of
the next layers pick from the hidden state after this layer (what a prefetcher can know).

Files written to `--out`:
- `routing.npy`  int16 [tokens, layers, k]: real expert ids, prompt and generated tokens
  (`authoring.policy_sim` reads it); `decode.npy` the same for generated tokens only.
- `predicted.npy` int16 [tokens, depth, layers, k]: `[t, d-1, l]` = top-k of layer l's router
  applied to the hidden state after layer l-d (-1 where l < d).
- `meta.json` (model, prompts, segments, sampling) and `REPORT.md` (skew, predictability).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ...common.traces import write_trace
from ..experts.source import ExpertBackend, Predictions
from ..models.moe_transformer import LayerObserver, MoEModel
from ...authoring.trace_stats import cache_hit_rates, predictability, report_markdown, skew


@dataclass(frozen=True)
class TraceConfig:
    model: Path
    out: Path
    prompts: int = 12
    prompt_tokens: int = 64
    new_tokens: int = 192
    temperature: float = 0.8
    top_p: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.prompts, self.prompt_tokens, self.new_tokens) < 1:
            raise ValueError("--prompts, --prompt-tokens and --new-tokens must be >= 1")


class Recorder(LayerObserver):
    """Collects real and predicted routing of every real token a forward pass processes."""

    def __init__(self, model: MoEModel):
        hp = model.hparams
        dense = [i for i in range(hp.n_layer) if not hp.is_moe_layer(i)]
        if dense:  # (DeepSeek's and GLM's leading layers, Llama 4's interleaved ones)
            raise ValueError(f"routing traces need experts in every layer; this {hp.arch} model's layers "
                             f"{', '.join(map(str, dense))} are dense")
        self.model = model
        self.real: list[list[torch.Tensor]] = []  # per forward: per layer [n, k]
        self.pred: list[list[list[torch.Tensor | None]]] = []  # per forward: [depth][layer]

    def routed(self, layer: int, ids: torch.Tensor) -> None:
        L = self.model.hparams.n_layer
        if layer == 0:  # a new forward pass starts
            self.real.append([])
            self.pred.append([[None] * L for _ in range(L - 1)])
        self.real[-1].append(ids.cpu())  # [n, k]

    def after_layer(self, layer: int, h: torch.Tensor) -> None:
        hp = self.model.hparams
        for d in range(1, hp.n_layer - layer):
            logits = self.model.router_logits(layer + d, h)  # [n, E]
            self.pred[-1][d - 1][layer + d] = torch.topk(logits, hp.n_expert_used, dim=-1).indices.cpu()  # [n, k]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(real [N, L, k], predicted [N, L-1, L, k] with -1 where undefined)."""
        real = torch.cat([torch.stack(f, dim=1) for f in self.real])  # [N, L, k]
        N, L, k = real.shape
        pred = torch.full((N, max(L - 1, 0), L, k), -1, dtype=torch.int64)
        row = 0
        for f_real, f_pred in zip(self.real, self.pred):
            n = f_real[0].shape[0]
            for d, per_layer in enumerate(f_pred):
                for layer, ids in enumerate(per_layer):
                    if ids is not None:
                        pred[row:row + n, d, layer] = ids
            row += n
        return real.numpy().astype(np.int16), pred.numpy().astype(np.int16)


def pick_prompts(tok, n: int, length: int, seed: int) -> list[dict]:
    """`n` prompts of `length` tokens: slices of held-out stdlib files, starts or middles."""
    from ...authoring.tiny_corpus import corpus_files, is_held_out, stdlib_dir

    rels = [r for r in corpus_files() if is_held_out(r)]
    rng = np.random.default_rng(seed)
    out = []
    for i, j in enumerate(np.linspace(0, len(rels) - 1, n).astype(int)):
        ids = tok.encode((stdlib_dir() / rels[j]).read_text(encoding="utf-8", errors="replace"))
        top = max(0, len(ids) - length)
        start = 0 if i % 2 == 0 else int(rng.integers(top // 4, max(top // 4 + 1, 3 * top // 4)))
        out.append({"file": rels[j], "start_token": start, "ids": ids[start:start + length]})
    return out


def record(cfg: TraceConfig) -> dict:
    """Generate over every prompt while recording; write the trace files; returns meta."""
    from ...common.layout import ModelLayout
    from ..experts.bank import ExpertBank
    from ..experts.source import ResidentExperts
    from .loop import generate
    from ..models import load_model
    from .sampling import SamplingParams
    from .tokenizer import GGUFTokenizer

    layout = ModelLayout(cfg.model)
    tok, model = GGUFTokenizer.from_layout(layout), load_model(layout)
    rec = Recorder(model)
    prompts, segments, texts = pick_prompts(tok, cfg.prompts, cfg.prompt_tokens, cfg.seed), [], []
    with ExpertBank(ResidentExperts(layout)) as bank, torch.inference_mode():
        model = model.with_bank(bank)
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed + i)
            res = generate(model, [p["ids"]], cfg.new_tokens, params, observer=rec)
            # The last sampled token is never fed back, so it has no routing.
            segments.append({"file": p["file"], "start_token": p["start_token"], "prompt": len(p["ids"]),
                             "generated": max(0, len(res.tokens[0]) - 1)})
            texts.append(tok.decode(res.tokens[0]))
    real, pred = rec.arrays()
    return write(cfg, layout, real, pred, segments, texts)


def _sha256(paths) -> str:
    """Of the files' bytes one after another (a split model's parts in order; one file: its own)."""
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def write(cfg: TraceConfig, layout, real: np.ndarray, pred: np.ndarray, segments: list[dict],
          texts: list[str]) -> dict:
    cfg.out.mkdir(parents=True, exist_ok=True)
    decode_rows = np.concatenate(_decode_mask(segments)) if segments else np.zeros(0, bool)
    np.save(cfg.out / "routing.npy", real)
    np.save(cfg.out / "decode.npy", real[decode_rows])
    np.save(cfg.out / "predicted.npy", pred)
    hp = layout.hparams
    meta = {"model": layout.path.name, "model_sha256": _sha256(f.path for f in layout.files),
            "n_layer": hp.n_layer, "n_expert": hp.n_expert, "top_k": hp.n_expert_used, "tokens": int(len(real)),
            "decode_tokens": int(decode_rows.sum()), "config": {k: str(v) for k, v in asdict(cfg).items()},
            "segments": segments, "samples": texts[:3]}
    (cfg.out / "meta.json").write_text(json.dumps(meta, indent=1))
    stats = {"skew": skew(real, hp.n_expert), "predictability": predictability(real, pred),
             "cache": cache_hit_rates(real, hp.n_expert)}
    (cfg.out / "REPORT.md").write_text(report_markdown(meta, stats))
    return {**meta, "stats": stats}


def _decode_mask(segments: list[dict]) -> list[np.ndarray]:
    return [np.r_[np.zeros(s["prompt"], bool), np.ones(s["generated"], bool)] for s in segments]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moestream.decoder.generation.traces",
                                description="Record routing traces (resident decoder) and report skew/predictability.")
    p.add_argument("--model", type=Path, required=True, help="GGUF qwen3moe model")
    p.add_argument("--out", type=Path, required=True, help="directory for routing.npy, predicted.npy, REPORT.md")
    for name in ("prompts", "prompt_tokens", "new_tokens", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=TraceConfig.__dataclass_fields__[name].default)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    args = p.parse_args(argv)
    try:
        meta = record(TraceConfig(**vars(args)))
    except (ValueError, OSError) as e:
        print(f"traces: error: {e}", file=sys.stderr)
        return 1
    print((args.out / "REPORT.md").read_text())
    print(f"wrote {meta['tokens']} tokens of routing to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


class RoutingRecorder(ExpertBackend):
    """An expert backend that records, per forward pass, the (layer, expert) keys it routed to,
    each once per row (token) that chose it (`generate --trace-out`), then hands everything to
    the backend it wraps."""

    def __init__(self, inner: ExpertBackend):
        self.inner = inner
        self.kind = inner.kind
        self.steps: list[list[tuple[int, int]]] = []

    def begin_step(self) -> None:
        self.steps.append([])
        self.inner.begin_step()

    def prefetch_ahead(self, predictions: Predictions, defer: bool = False,
                       if_cached: Predictions | None = None) -> None:
        self.inner.prefetch_ahead(predictions, defer, if_cached)

    def prefetch_top(self, k: int) -> int:
        return self.inner.prefetch_top(k)

    def mix(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.steps[-1].extend((layer, e) for e in sorted(ids.flatten().tolist()))  # a key per row; one sync
        return self.inner.mix(layer, x, weights, ids)

    def stats(self) -> dict:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()

    def write(self, path: str | Path, n_layer: int, n_expert: int) -> None:
        write_trace(path, self.steps, n_layer, n_expert)
