"""`moestream make-model`: write a GGUF MoE with random weights, tiny or multi-GiB.

Weights are random codes with std ~1/sqrt(fan_in) (forward passes stay tame); norms are ~1;
routers get a larger std so routing is spread over experts, not degenerate. `--target-size`
grows the expert count (up to `MAX_TARGET_EXPERTS`) and then the expert width until the file
approaches the target; expert tensors are generated block by block while writing.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from .arch import get_arch
from .gguf_write import RandomTensor, TensorLike, normalize_hparams, tensor_qtype, write_moe_gguf, tensor_nbytes
from .quantize import qtype_of
from .tokenizer_data import get_tokenizer

K_QUANTS = frozenset((Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K))
MAX_TARGET_EXPERTS = 128  # --target-size adds experts up to this, then widens them
ROUTER_STD = 1.0  # logits ~N(0, |h|): clearly different experts win for different tokens


def default_width(quant: str) -> int:
    """Smallest hidden / expert width every tensor of `quant` accepts: K-quants need 256."""
    return 256 if qtype_of(quant) in K_QUANTS else 64


def model_hparams(arch: str, *, layers: int, experts: int, top_k: int, hidden: int, expert_ff: int,
                  heads: int, kv_heads: int, vocab: int, head_dim: int | None = None,
                  shared_ff: int | None = None) -> dict:
    """Validated HParams-style dict for `make_model`."""
    spec = get_arch(arch)
    if min(layers, experts, top_k, hidden, expert_ff, heads, kv_heads) <= 0:
        raise ValueError("layers, experts, top_k, hidden, expert_ff, heads and kv_heads must be positive")
    if top_k > experts:
        raise ValueError(f"top_k={top_k} > experts={experts}")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    if arch == "olmoe" and kv_heads != heads:
        raise ValueError(f"olmoe needs kv_heads == heads (llama.cpp's loader), got {kv_heads} != {heads}")
    if head_dim is not None and head_dim != hidden // heads and not spec.head_dim_key:
        raise ValueError(f"{arch} has no head-dim key: head_dim must be hidden/heads = {hidden // heads}")
    if head_dim is None and hidden % heads:
        raise ValueError(f"hidden={hidden} is not a multiple of heads={heads}")
    hp = dict(n_layer=layers, n_embd=hidden, n_head=heads, n_head_kv=kv_heads,
              head_dim=head_dim or hidden // heads, n_expert=experts, n_expert_used=top_k, n_ff_exp=expert_ff,
              n_vocab=vocab, n_ff_shexp=(shared_ff or 2 * expert_ff) if spec.shared_expert else 0)
    return normalize_hparams(arch, hp)


def _rand(shape: tuple[int, ...], seed: int, std: float | None = None) -> RandomTensor:
    return RandomTensor(shape, std if std is not None else 1.0 / math.sqrt(shape[-1]), seed)


def _norm(n: int, rng: np.random.Generator) -> np.ndarray:
    return (1.0 + 0.02 * rng.standard_normal(n)).astype(np.float32)  # [n]


def build_tensors(arch: str, hp: dict, seed: int = 0) -> dict[str, TensorLike]:
    """Every tensor of a random `arch` model, in numpy order, in llama.cpp's file order."""
    spec, rng = get_arch(arch), np.random.default_rng(seed)
    e, v, ne = hp["n_embd"], hp["n_vocab"], hp["n_expert"]
    q_dim, kv_dim = hp["n_head"] * hp["head_dim"], hp["n_head_kv"] * hp["head_dim"]
    out: dict[str, TensorLike] = {"token_embd.weight": _rand((v, e), seed, 0.02)}
    for i in range(hp["n_layer"]):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = _norm(e, rng)
        out[p + "attn_q.weight"] = _rand((q_dim, e), seed)
        out[p + "attn_k.weight"] = _rand((kv_dim, e), seed)
        out[p + "attn_v.weight"] = _rand((kv_dim, e), seed)
        for t in spec.layer_biases:  # qwen2moe: q/k/v biases
            out[p + t + ".bias"] = (0.02 * rng.standard_normal(q_dim if t == "attn_q" else kv_dim)).astype(np.float32)
        out[p + "attn_output.weight"] = _rand((e, q_dim), seed)
        if spec.qk_norm == "head":
            out[p + "attn_q_norm.weight"], out[p + "attn_k_norm.weight"] = _norm(hp["head_dim"], rng), _norm(hp["head_dim"], rng)
        elif spec.qk_norm == "full":
            out[p + "attn_q_norm.weight"], out[p + "attn_k_norm.weight"] = _norm(q_dim, rng), _norm(kv_dim, rng)
        out[p + "ffn_norm.weight"] = _norm(e, rng)
        out[p + "ffn_gate_inp.weight"] = (ROUTER_STD / math.sqrt(e) * rng.standard_normal((ne, e))).astype(np.float32)
        out.update(_expert_tensors(p, hp, seed))
        if spec.shared_expert:
            out.update(_shared_expert(p, hp, seed, rng))
    out["output_norm.weight"] = _norm(e, rng)
    out["output.weight"] = _rand((v, e), seed)
    return out


def _expert_tensors(p: str, hp: dict, seed: int) -> dict[str, TensorLike]:
    e, ff, ne = hp["n_embd"], hp["n_ff_exp"], hp["n_expert"]
    return {p + "ffn_gate_exps.weight": _rand((ne, ff, e), seed),  # separate gate and up, as llama.cpp
            p + "ffn_up_exps.weight": _rand((ne, ff, e), seed),
            p + "ffn_down_exps.weight": _rand((ne, e, ff), seed)}


def _shared_expert(p: str, hp: dict, seed: int, rng: np.random.Generator) -> dict[str, TensorLike]:
    e, ff = hp["n_embd"], hp["n_ff_shexp"]
    return {p + "ffn_gate_inp_shexp.weight": (rng.standard_normal(e) / math.sqrt(e)).astype(np.float32),  # [n_embd]
            p + "ffn_gate_shexp.weight": _rand((ff, e), seed),
            p + "ffn_up_shexp.weight": _rand((ff, e), seed),
            p + "ffn_down_shexp.weight": _rand((e, ff), seed)}


def estimate_bytes(arch: str, hp: dict, quant: str) -> int:
    """Tensor data bytes a `make_model` file would hold (the header adds a few KiB + the vocab)."""
    q, notes = qtype_of(quant), []
    return sum(tensor_nbytes(t, tensor_qtype(n, tuple(t.shape), q, q, notes)) for n, t in build_tensors(arch, hp).items())


def fit_target(arch: str, hp: dict, quant: str, target: int) -> dict:
    """Grow experts (to ~MAX_TARGET_EXPERTS), then expert width, so the file approaches `target` bytes."""
    base = estimate_bytes(arch, hp, quant)
    if target < base:
        raise ValueError(f"target size {target} B is smaller than the requested model ({base} B)")
    dense, per_expert = _split_bytes(arch, hp, quant)
    n_exp = int(min(MAX_TARGET_EXPERTS, max(hp["n_expert"], (target - dense) // per_expert)))
    step = 256 if qtype_of(quant) in K_QUANTS else 32  # expert width must stay a whole number of blocks
    per_ff = per_expert * n_exp / hp["n_ff_exp"]  # bytes per unit of expert width, all experts and layers
    ff = max(hp["n_ff_exp"], int((target - dense) // per_ff) // step * step)
    hp = normalize_hparams(arch, {**hp, "n_ff_exp": ff, "n_ff": ff if arch != "qwen2moe" else hp["n_ff"]})
    dense, per_expert = _split_bytes(arch, hp, quant)  # width was rounded down: top up with experts
    return {**hp, "n_expert": max(n_exp, int((target - dense) // per_expert))}


def _split_bytes(arch: str, hp: dict, quant: str) -> tuple[int, int]:
    """(bytes that do not scale with the expert count, bytes per expert across all layers)."""
    one, two = (estimate_bytes(arch, {**hp, "n_expert": n}, quant) for n in (1, 2))
    return one - (two - one), two - one


def make_model(path: str | Path, *, arch: str = "qwen3moe", quant: str = "Q8_0", layers: int = 2, experts: int = 8,
               top_k: int = 2, hidden: int | None = None, expert_ff: int | None = None, heads: int = 4,
               kv_heads: int | None = None, vocab: int = 512, seed: int = 0, target_size: int | str | None = None,
               head_dim: int | None = None, shared_ff: int | None = None, progress: bool = False,
               verbose: bool = False) -> Path:
    """Write a random `arch` MoE to `path` and return the path.

    hidden / expert_ff default to 64 (256 for K-quants, whose blocks are 256 wide);
    kv_heads defaults to 2 (heads for olmoe, whose llama.cpp loader wants n_head_kv == n_head)."""
    width = default_width(quant)
    kv_heads = kv_heads if kv_heads is not None else (heads if arch == "olmoe" else min(2, heads))
    hp = model_hparams(arch, layers=layers, experts=experts, top_k=top_k, hidden=hidden or width,
                       expert_ff=expert_ff or width, heads=heads, kv_heads=kv_heads, vocab=vocab,
                       head_dim=head_dim, shared_ff=shared_ff)
    if target_size is not None:
        hp = fit_target(arch, hp, quant, parse_size(target_size))
    report = write_moe_gguf(path, arch, hp, build_tensors(arch, hp, seed), quant, get_tokenizer(vocab),
                            progress=progress)
    if verbose:
        print(f"wrote {report.path} ({report.nbytes / 2**20:.1f} MiB, {report.seconds:.1f} s): {arch} {quant}, "
              f"{hp['n_layer']} layers x {hp['n_expert']} experts (top {hp['n_expert_used']}), "
              f"hidden {hp['n_embd']}, expert width {hp['n_ff_exp']}")
        for note in report.notes:
            print(f"note: {note}")
    return Path(path)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "tb": 10**12}


def parse_size(text: int | str) -> int:
    """"2GiB" -> 2147483648, "500MB" -> 500000000, "1234" -> 1234."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"bad size {text!r} (examples: 2GiB, 500MB, 1048576)") from None
    if unit not in _UNITS or value < 0:
        raise ValueError(f"bad size {text!r} (units: {', '.join(k for k in _UNITS if k)})")
    return int(value * _UNITS[unit])


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moestream make-model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", metavar="OUT.gguf", help="file to write")
    ap.add_argument("--arch", default="qwen3moe", help="qwen3moe | qwen2moe | llama (Mixtral) | olmoe")
    ap.add_argument("--quant", default="Q8_0", help="F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q6_K")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=None, help="default 64 (256 for K-quants)")
    ap.add_argument("--expert-ff", type=int, default=None, help="expert width; default 64 (256 for K-quants)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None, help="default 2 (= heads for olmoe)")
    ap.add_argument("--head-dim", type=int, default=None, help="qwen3moe only; default hidden/heads")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-size", default=None, help="grow experts to approach this file size, e.g. 2GiB")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        make_model(args.out, arch=args.arch, quant=args.quant, layers=args.layers, experts=args.experts,
                   top_k=args.top_k, hidden=args.hidden, expert_ff=args.expert_ff, heads=args.heads,
                   kv_heads=args.kv_heads, vocab=args.vocab, seed=args.seed, target_size=args.target_size,
                   head_dim=args.head_dim, progress=sys.stderr.isatty(), verbose=True)
    except (ValueError, OSError) as e:
        print(f"moestream make-model: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
