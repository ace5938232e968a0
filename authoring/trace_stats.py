"""Statistics of a routing trace: expert popularity skew and layer-to-layer predictability.

numpy only. `real` is [tokens, layers, k] of routed expert ids; `pred` is
[tokens, depth, layers, k] of the ids that layer l's router picks from the hidden state after
layer l-d (-1 where l < d), as `decoder.traces` records them.
"""

from __future__ import annotations

import numpy as np


def skew(real: np.ndarray, n_expert: int) -> list[dict]:
    """Per layer: entropy of expert popularity (bits, and / log2 E), top-1 and top-25% shares."""
    out = []
    N, L, k = real.shape
    quarter = max(1, n_expert // 4)
    for layer in range(L):
        counts = np.bincount(real[:, layer].ravel().astype(np.int64), minlength=n_expert)  # [E]
        share = np.sort(counts / max(1, counts.sum()))[::-1]  # [E] most popular first
        nz = share[share > 0]
        ent = float(-(nz * np.log2(nz)).sum())
        out.append({"layer": layer, "entropy_bits": ent, "entropy_frac": ent / np.log2(n_expert),
                    "top1_share": float(share[0]), "top_quarter_share": float(share[:quarter].sum()),
                    "least_share": float(share[-1]), "unused": int((counts == 0).sum())})
    return out


def _overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, |set(a) & set(b)| for a, b [n, k] -> [n]."""
    return (a[:, :, None] == b[:, None, :]).any(axis=2).sum(axis=1)


def predictability(real: np.ndarray, pred: np.ndarray) -> dict:
    """Precision (= recall: k predicted vs k real) of next-layer router guesses, per depth and layer.

    Baselines: `prev_token` = the same layer's experts of the previous token, `popular` = the
    layer's k most used experts over the whole trace."""
    N, L, k = real.shape
    out: dict = {"by_depth": []}
    for d in range(pred.shape[1]):
        per_layer = {}
        for layer in range(d + 1, L):
            hit = _overlap(pred[:, d, layer], real[:, layer])  # [N]
            per_layer[layer] = float(hit.mean() / k)
        out["by_depth"].append({"depth": d + 1, "per_layer": per_layer,
                                "mean": float(np.mean(list(per_layer.values()))) if per_layer else float("nan")})
    prev = [float(_overlap(real[:-1, layer], real[1:, layer]).mean() / k) for layer in range(L)] if N > 1 else []
    out["prev_token"] = float(np.mean(prev)) if prev else float("nan")
    pop = []
    for layer in range(L):
        top = np.argsort(-np.bincount(real[:, layer].ravel().astype(np.int64)))[:k]
        pop.append(float(np.isin(real[:, layer], top).sum(axis=1).mean() / k))
    out["popular"] = float(np.mean(pop))
    return out


def cache_hit_rates(real: np.ndarray, n_expert: int, fractions=(0.25, 0.5)) -> list[dict]:
    """Hit rates of decayed LFU, LRU and Belady on the trace, at caches of a fraction of all experts."""
    from .policy_sim import simulate

    N, L, k = real.shape
    steps = [[(layer, int(e)) for layer, ids in enumerate(tok) for e in ids] for tok in real]
    rows = []
    for frac in fractions:
        cap = max(L * k, int(frac * L * n_expert))
        rows.append({"fraction": frac, "capacity": cap,
                     **{p: simulate(steps, cap, p).hit_rate for p in ("lfu", "lru", "belady")}})
    return rows


def report_markdown(meta: dict, stats: dict) -> str:
    """The human-readable report written next to the traces."""
    lines = [f"# Routing traces of `{meta['model']}`", "",
             f"{meta['tokens']} tokens ({meta['decode_tokens']} generated), {meta['n_layer']} layers, "
             f"{meta['n_expert']} experts, top-{meta['top_k']}; {len(meta['segments'])} prompts from held-out "
             "stdlib files, recorded with moestream's resident decoder.", "",
             "## Skew: expert popularity per layer", "",
             "| layer | entropy (bits) | entropy / log2 E | top-1 share | top-25% share | least share | unused |",
             "|---|---|---|---|---|---|---|"]
    for s in stats["skew"]:
        lines.append(f"| {s['layer']} | {s['entropy_bits']:.2f} | {s['entropy_frac']:.3f} | {s['top1_share']:.3f} | "
                     f"{s['top_quarter_share']:.3f} | {s['least_share']:.4f} | {s['unused']} |")
    p = stats["predictability"]
    lines += ["", "A uniform router would give entropy / log2 E = 1 and top-25% share = 0.25.", "",
              "## Predictability: router of layer l on the hidden state after layer l-d", "",
              "Precision = recall (k guesses vs k real experts), mean over tokens.", "",
              "| depth d | " + " | ".join(f"layer {l}" for l in range(1, meta["n_layer"])) + " | mean |",
              "|---|" + "---|" * meta["n_layer"]]
    for row in p["by_depth"]:
        cells = [f"{row['per_layer'][l]:.3f}" if l in row["per_layer"] else "-" for l in range(1, meta["n_layer"])]
        lines.append(f"| {row['depth']} | " + " | ".join(cells) + f" | {row['mean']:.3f} |")
    lines += ["", f"Baselines: same layer's experts of the previous token {p['prev_token']:.3f}; "
              f"the layer's k most popular experts {p['popular']:.3f}; random guess "
              f"{meta['top_k'] / meta['n_expert']:.3f}."]
    if stats.get("cache"):
        lines += ["", "## Cache hit rates on `routing.npy` (authoring.policy_sim, one step per token)", "",
                  "| cache (share of all experts) | slots | decayed LFU | LRU | Belady |", "|---|---|---|---|---|"]
        for c in stats["cache"]:
            lines.append(f"| {c['fraction']:.0%} | {c['capacity']} | {c['lfu']:.3f} | {c['lru']:.3f} | {c['belady']:.3f} |")
    return "\n".join(lines) + "\n"
