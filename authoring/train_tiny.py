"""Train the tiny qwen3moe that moestream ships, on the Python standard library's own sources.

Reproducible and offline: the corpus and tokenizer come from `tiny_corpus` (the running
interpreter's stdlib sources, a fixed held-out split), and one `--seed` fixes the init and
the batches. The model is transformers' `Qwen3MoeForCausalLM` (an independent implementation of
the architecture, so the exported GGUF can be checked against it) with the Switch-style
load-balancing loss. CPU by default; the code is device-agnostic (`--device cuda`), untested on a GPU.

    OMP_WAIT_POLICY=PASSIVE python -m moestream.authoring.train_tiny --out /tmp/tiny-train

(On a CPU shared with other jobs, spinning OpenMP workers made steps 5-10x slower: hence PASSIVE.)

    python -m moestream.authoring.export_gguf --run /tmp/tiny-train --out src/moestream/data

The run directory gets `tokenizer.json`, `config.json`, `ckpt.pt` (resumable with
`--resume`), `model.pt` (final weights) and `metrics.json` (loss curve, unigram baseline).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .tiny_corpus import (encode_texts, inference_tokenizer, split_texts, stdlib_dir, train_tokenizer,
                          unigram_entropy, unigram_loss)


@dataclass(frozen=True)
class TrainConfig:
    out: Path
    steps: int = 1000
    batch: int = 16
    context: int = 256
    lr: float = 2e-3
    warmup: int = 60
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    aux_coef: float = 0.01
    seed: int = 0
    threads: int = 2
    device: str = "cpu"
    vocab: int = 4096
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    experts: int = 32
    top_k: int = 4
    expert_ff: int = 64
    rope_base: float = 10000.0
    eval_every: int = 100
    eval_windows: int = 32
    ckpt_every: int = 200
    resume: bool = False

    def __post_init__(self) -> None:
        # Every row length must fit a Q8_0 block (32) so the export quantizes every matrix.
        for name in ("hidden", "head_dim", "expert_ff", "vocab", "context"):
            if getattr(self, name) % 32:
                raise ValueError(f"--{name.replace('_', '-')} must be a multiple of 32, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"--top-k {self.top_k} must be in [1, --experts={self.experts}]")
        if min(self.steps, self.batch, self.layers, self.threads, self.eval_every) < 1:
            raise ValueError("--steps, --batch, --layers, --threads and --eval-every must be >= 1")


# -- model ------------------------------------------------------------------------------------
def gguf_hparams(cfg: dict) -> dict:
    """The train config (as saved in config.json) in `HParams` field names: the one place the
    model's fixed choices (RMSNorm eps, renormalized top-k) are made, for HF and for the GGUF."""
    return dict(n_layer=cfg["layers"], n_embd=cfg["hidden"], n_head=cfg["heads"], n_head_kv=cfg["kv_heads"],
                head_dim=cfg["head_dim"], n_expert=cfg["experts"], n_expert_used=cfg["top_k"],
                n_ff_exp=cfg["expert_ff"], n_vocab=cfg["vocab"], context_length=cfg["context"],
                rope_base=float(cfg["rope_base"]), rms_eps=1e-6, norm_topk_prob=True)


def hf_config(cfg: dict):
    """A transformers Qwen3MoeConfig for a TrainConfig (as a dict, as saved in config.json)."""
    from transformers import Qwen3MoeConfig

    hp = gguf_hparams(cfg)
    return Qwen3MoeConfig(
        vocab_size=hp["n_vocab"], hidden_size=hp["n_embd"], num_hidden_layers=hp["n_layer"],
        num_attention_heads=hp["n_head"], num_key_value_heads=hp["n_head_kv"], head_dim=hp["head_dim"],
        num_experts=hp["n_expert"], num_experts_per_tok=hp["n_expert_used"], moe_intermediate_size=hp["n_ff_exp"],
        intermediate_size=hp["n_ff_exp"], max_position_embeddings=hp["context_length"], rope_theta=hp["rope_base"],
        rms_norm_eps=hp["rms_eps"], norm_topk_prob=hp["norm_topk_prob"], tie_word_embeddings=False,
        output_router_logits=True, router_aux_loss_coef=cfg["aux_coef"],
        experts_implementation="grouped_mm",  # ~20x faster than eager on CPU
        attn_implementation="sdpa", bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )


def build_model(cfg: dict, state: dict | None = None):
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(hf_config(cfg))
    if state is not None:
        model.load_state_dict(state)
    return model


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to `min_lr_frac * lr`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def eval_starts(n_ids: int, context: int, windows: int) -> np.ndarray:
    """Evenly spaced window starts: the same held-out tokens at every evaluation."""
    return np.linspace(0, n_ids - context - 1, windows).astype(np.int64)


def windows(ids: torch.Tensor, starts: torch.Tensor, context: int) -> torch.Tensor:
    return ids[starts[:, None] + torch.arange(context + 1)]  # [B, context + 1]


@torch.no_grad()
def heldout_loss(model, ids: torch.Tensor, context: int, n_windows: int, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over `n_windows` fixed held-out windows."""
    model.eval()
    starts = torch.from_numpy(eval_starts(len(ids), context, n_windows))
    total, count = 0.0, 0
    for b in range(0, n_windows, batch):
        x = windows(ids, starts[b:b + batch], context).to(next(model.parameters()).device)
        logits = model(input_ids=x[:, :-1], output_router_logits=False).logits  # [B, T, V]
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(),
                                                   reduction="sum").item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


# -- data preparation -------------------------------------------------------------------------
def prepare_data(cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray, dict]:
    """Train the tokenizer and encode both splits once; cached in the run directory."""
    from tokenizers import Tokenizer

    out = cfg.out
    tok_path, tr_path, ho_path = out / "tokenizer.json", out / "train_ids.npy", out / "heldout_ids.npy"
    train_texts, held_texts = split_texts("train"), split_texts("heldout")
    if not tok_path.is_file():
        tok_path.write_text(train_tokenizer(train_texts, cfg.vocab).to_str())
    if not (tr_path.is_file() and ho_path.is_file()):
        tok = inference_tokenizer(Tokenizer.from_file(str(tok_path)))
        np.save(tr_path, encode_texts(tok, train_texts))
        np.save(ho_path, encode_texts(tok, held_texts))
    train_ids, held_ids = np.load(tr_path), np.load(ho_path)
    info = {
        "python": sys.version.split()[0], "stdlib": str(stdlib_dir()),
        "files": {"train": len(train_texts), "heldout": len(held_texts)},
        "bytes": {"train": sum(len(t.encode()) for t in train_texts), "heldout": sum(len(t.encode()) for t in held_texts)},
        "tokens": {"train": int(len(train_ids)), "heldout": int(len(held_ids))},
        "unigram_heldout_loss": unigram_loss(train_ids, held_ids, cfg.vocab),
        "unigram_heldout_entropy": unigram_entropy(held_ids),
    }
    return train_ids, held_ids, info


# -- training loop ----------------------------------------------------------------------------
def _save(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)  # a kill mid-save never leaves a torn checkpoint


def _restore(cfg: TrainConfig, model, opt, log: dict) -> tuple[int, torch.Generator]:
    gen = torch.Generator().manual_seed(cfg.seed)
    ckpt = cfg.out / "ckpt.pt"
    if not (cfg.resume and ckpt.is_file()):
        return 0, gen
    state = torch.load(ckpt, map_location=cfg.device, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    gen.set_state(state["gen"])
    log.update(state["log"])
    return int(state["step"]), gen


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training; returns the metrics written to metrics.json."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    cfg.out.mkdir(parents=True, exist_ok=True)
    cfg_dict = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()}
    (cfg.out / "config.json").write_text(json.dumps(cfg_dict, indent=1))
    train_np, held_np, info = prepare_data(cfg)
    print(f"corpus: {json.dumps(info)}", flush=True)
    train_ids, held_ids = torch.from_numpy(train_np).long(), torch.from_numpy(held_np).long()
    model = build_model(cfg_dict).to(cfg.device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    log: dict = {"curve": [], "wall_s": 0.0}
    step, gen = _restore(cfg, model, opt, log)
    t0, wall0, ce_sum, aux_sum, n = time.perf_counter(), log["wall_s"], 0.0, 0.0, 0
    while step < cfg.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        starts = torch.randint(0, len(train_ids) - cfg.context - 1, (cfg.batch,), generator=gen)
        x = windows(train_ids, starts, cfg.context).to(cfg.device)  # [B, T+1]
        out = model(input_ids=x[:, :-1], labels=x[:, :-1].clone(), output_router_logits=True)
        # HF shifts labels inside; its loss = CE + aux_coef * aux.
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ce_sum += out.loss.item() - cfg.aux_coef * out.aux_loss.item()
        aux_sum, n, step = aux_sum + out.aux_loss.item(), n + 1, step + 1
        if step % cfg.eval_every == 0 or step == cfg.steps:
            log["wall_s"] = wall0 + time.perf_counter() - t0
            held = heldout_loss(model, held_ids, cfg.context, cfg.eval_windows)
            row = {"step": step, "train_loss": ce_sum / n, "heldout_loss": held, "aux_loss": aux_sum / n,
                   "lr": lr_at(step - 1, cfg), "wall_s": round(log["wall_s"], 1)}
            log["curve"].append(row)
            print(json.dumps(row), flush=True)
            ce_sum, aux_sum, n = 0.0, 0.0, 0
        if step % cfg.ckpt_every == 0 or step == cfg.steps:
            _save(cfg.out / "ckpt.pt", {"model": model.state_dict(), "opt": opt.state_dict(),
                                        "gen": gen.get_state(), "step": step, "log": log})
    torch.save(model.state_dict(), cfg.out / "model.pt")
    final_windows = min(512, (len(held_ids) - 1) // cfg.context)
    metrics = {"config": cfg_dict, "corpus": info, "curve": log["curve"], "train_wall_s": round(log["wall_s"], 1),
               "final_heldout_loss": heldout_loss(model, held_ids, cfg.context, final_windows),
               "final_heldout_windows": final_windows, "torch": torch.__version__}
    (cfg.out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moestream.authoring.train_tiny",
                                description="Train the tiny qwen3moe moestream ships, on the Python stdlib's sources.")
    p.add_argument("--out", type=Path, required=True, help="run directory (tokenizer, checkpoints, metrics)")
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("out", "resume"):
            continue
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                       help=f"(default: {f.default})")
    p.add_argument("--resume", action="store_true", help="continue from RUN/ckpt.pt if it exists")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = TrainConfig(**vars(args))
        metrics = train(cfg)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"train_tiny: error: {e}", file=sys.stderr)
        return 1
    print(f"done: held-out loss {metrics['final_heldout_loss']:.3f} nats/token vs unigram "
          f"{metrics['corpus']['unigram_heldout_loss']:.3f}; wall {metrics['train_wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
