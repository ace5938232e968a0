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
from gguf import GGML_QUANT_SIZES

from ..common.arch import get_arch
from .gguf_write import RandomTensor, TensorLike, normalize_hparams, tensor_nbytes, tensor_qtype, write_moe_gguf
from .quantize import qtype_of
from .tokenizer_data import get_tokenizer
from ..common.units import parse_size

MAX_TARGET_EXPERTS = 128  # --target-size adds experts up to this, then widens them
ROUTER_STD = 1.0  # logits ~N(0, |h|): clearly different experts win for different tokens


def _block(quant: str) -> int:
    """Values per quant block (256 for K-quants, 32 for the rest, 1 for floats)."""
    return GGML_QUANT_SIZES[qtype_of(quant)][0]


def default_width(quant: str) -> int:
    """Smallest hidden / expert width every tensor of `quant` accepts: K-quants need 256."""
    return max(64, _block(quant))


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
    if spec.kv_heads_equal_heads and kv_heads != heads:
        raise ValueError(f"{arch} needs kv_heads == heads (llama.cpp's loader), got {kv_heads} != {heads}")
    if head_dim is not None and head_dim != hidden // heads and not spec.head_dim_key:
        raise ValueError(f"{arch} has no head-dim key: head_dim must be hidden/heads = {hidden // heads}")
    if head_dim is None and hidden % heads:
        raise ValueError(f"hidden={hidden} is not a multiple of heads={heads}")
    hp = dict(n_layer=layers, n_embd=hidden, n_head=heads, n_head_kv=kv_heads,
              head_dim=head_dim or hidden // heads, n_expert=experts, n_expert_used=top_k, n_ff_exp=expert_ff,
              n_vocab=vocab, n_ff_shexp=(shared_ff or 2 * expert_ff) if spec.shared_expert else 0)
    return normalize_hparams(arch, hp)


def tensor_shapes(arch: str, hp: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor's numpy-order shape, in llama.cpp's file order."""
    spec = get_arch(arch)
    e, v, ne, ff, hd = hp["n_embd"], hp["n_vocab"], hp["n_expert"], hp["n_ff_exp"], hp["head_dim"]
    q_dim, kv_dim = hp["n_head"] * hd, hp["n_head_kv"] * hd
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, e)}
    for i in range(hp["n_layer"]):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (e,), p + "attn_q.weight": (q_dim, e),
                    p + "attn_k.weight": (kv_dim, e), p + "attn_v.weight": (kv_dim, e)})
        for t in spec.layer_biases:  # qwen2moe: q/k/v biases
            out[p + t + ".bias"] = (q_dim if t == "attn_q" else kv_dim,)
        out[p + "attn_output.weight"] = (e, q_dim)
        if spec.qk_norm == "head":
            out.update({p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
        elif spec.qk_norm == "full":  # over all heads
            out.update({p + "attn_q_norm.weight": (q_dim,), p + "attn_k_norm.weight": (kv_dim,)})
        out.update({p + "ffn_norm.weight": (e,), p + "ffn_gate_inp.weight": (ne, e),
                    p + "ffn_gate_exps.weight": (ne, ff, e),  # separate gate and up, as llama.cpp
                    p + "ffn_up_exps.weight": (ne, ff, e), p + "ffn_down_exps.weight": (ne, e, ff)})
        if spec.shared_expert:
            sff = hp["n_ff_shexp"]
            out.update({p + "ffn_gate_inp_shexp.weight": (e,), p + "ffn_gate_shexp.weight": (sff, e),
                        p + "ffn_up_shexp.weight": (sff, e), p + "ffn_down_shexp.weight": (e, sff)})
    out.update({"output_norm.weight": (e,), "output.weight": (v, e)})
    return out


def build_tensors(arch: str, hp: dict, seed: int = 0) -> dict[str, TensorLike]:
    """Every tensor of a random `arch` model, in numpy order, in llama.cpp's file order."""
    rng = np.random.default_rng(seed)  # drawn in file order: small F32 tensors only
    return {name: _init(name, shape, seed, rng) for name, shape in tensor_shapes(arch, hp).items()}


def _init(name: str, shape: tuple[int, ...], seed: int, rng: np.random.Generator) -> TensorLike:
    """A tensor's random values; big matrices as RandomTensor, generated while writing."""
    if name.endswith(".bias"):
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    if "norm" in name:
        return (1.0 + 0.02 * rng.standard_normal(shape)).astype(np.float32)  # [n]
    if name.endswith(".ffn_gate_inp.weight"):  # the router: [n_expert, n_embd]
        return (ROUTER_STD / math.sqrt(shape[-1]) * rng.standard_normal(shape)).astype(np.float32)
    if name.endswith(".ffn_gate_inp_shexp.weight"):
        return (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32)  # [n_embd]
    std = 0.02 if name == "token_embd.weight" else 1.0 / math.sqrt(shape[-1])  # ~1/sqrt(fan_in)
    return RandomTensor(shape, std, seed)


def estimate_bytes(arch: str, hp: dict, quant: str) -> int:
    """Tensor data bytes a `make_model` file would hold (the header adds a few KiB + the vocab)."""
    q, notes = qtype_of(quant), []
    shapes = tensor_shapes(arch, hp)
    return sum(tensor_nbytes(shape, tensor_qtype(n, shape, q, q, notes)) for n, shape in shapes.items())


def fit_target(arch: str, hp: dict, quant: str, target: int) -> dict:
    """Grow experts (to ~MAX_TARGET_EXPERTS), then expert width, so the file approaches `target` bytes."""
    base = estimate_bytes(arch, hp, quant)
    if target < base:
        raise ValueError(f"target size {target} B is smaller than the requested model ({base} B)")
    dense, per_expert = _split_bytes(arch, hp, quant)
    n_exp = int(min(MAX_TARGET_EXPERTS, max(hp["n_expert"], (target - dense) // per_expert)))
    step = max(32, _block(quant))  # expert width must stay a whole number of blocks
    per_ff = per_expert * n_exp / hp["n_ff_exp"]  # bytes per unit of expert width, all experts and layers
    ff = max(hp["n_ff_exp"], int((target - dense) // per_ff) // step * step)
    # n_ff is derived again: it follows the expert width unless a shared expert sets it
    hp = normalize_hparams(arch, {**{k: v for k, v in hp.items() if k != "n_ff"}, "n_ff_exp": ff})
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
    kv_heads = kv_heads if kv_heads is not None else (heads if get_arch(arch).kv_heads_equal_heads else min(2, heads))
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
