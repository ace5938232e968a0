"""`moestream inspect MODEL.gguf [--json]`: what a GGUF MoE holds, as moestream sees it.

Prints the files (every part of a split model, with its size), the architecture, hyper-parameters, dense bytes, the expert index (experts per layer,
largest blob, arena slot size, total expert bytes), quant types, the file fingerprint, and
sizing: the arena (and `moestream-iod --memory`) that caches a quarter, half or all experts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from ..common.layout import ModelFormatError, ModelLayout
from ..common.units import format_size
from .plan import DAEMON_BASE_BYTES

SIZING_PERCENTS = (25, 50, 100)  # of all experts: the cache sizes an operator usually weighs


def describe(layout: ModelLayout) -> dict[str, Any]:
    """A JSON-ready summary of `layout`."""
    ex = layout.experts
    return {
        "path": str(layout.path),
        "file_bytes": layout.file_size,  # all parts of a split model
        "files": [{"path": str(f.path), "bytes": f.size, "tensors": f.n_tensors} for f in layout.files],
        "architecture": layout.arch_name,
        "hparams": dataclasses.asdict(layout.hparams),
        "dense_bytes": layout.dense_bytes,
        "dense_tensors": len(layout.dense),
        "experts": {**ex.summary(), "slot_bytes": ex.slot_bytes(direct_io=False),
                    "slot_bytes_direct_io": ex.slot_bytes(direct_io=True)},
        "quant_types": layout.quant_types(),
        "fingerprint": layout.fingerprint.as_dict(),
        "sizing": sizing(ex.n_blobs, ex.slot_bytes(direct_io=False)),
    }


def sizing(n_experts: int, slot_bytes: int) -> dict[str, Any]:
    """Arena bytes (one slot per cached expert) and the `--memory` that gives them, per share of experts."""
    rows = []
    for pct in SIZING_PERCENTS:
        slots = max(1, -(-n_experts * pct // 100))  # rounded up: at least that share fits
        rows.append({"percent": pct, "slots": slots, "arena_bytes": slots * slot_bytes,
                     "memory_bytes": slots * slot_bytes + DAEMON_BASE_BYTES})
    return {"slot_bytes": slot_bytes, "daemon_bytes_guess": DAEMON_BASE_BYTES, "budgets": rows}


def _mib(n: int) -> str:
    return f"{n:,} B ({n / 2**20:.2f} MiB)"


def format_text(d: dict[str, Any]) -> str:
    hp, ex = d["hparams"], d["experts"]
    lines = [
        f"{d['path']}  ({_mib(d['file_bytes'])})",
        *_parts_lines(d["files"]),
        f"architecture     {d['architecture']}",
        "hyper-parameters " + ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in hp.items() if k != "arch" and _shown(v)),
        f"dense            {_mib(d['dense_bytes'])} in {d['dense_tensors']} tensors",
        f"experts          {ex['n_layer']} layers x {ex['n_expert']} experts, "
        f"top {hp['n_expert_used']}, parts {'+'.join(ex['parts'])}"
        + (f"; first {hp['n_dense_lead']} layer(s) dense (no experts)" if hp.get("n_dense_lead") else ""),
        f"blob (max)       {_mib(ex['max_blob_bytes'])}",
        f"slot             {_mib(ex['slot_bytes'])} (O_DIRECT: {_mib(ex['slot_bytes_direct_io'])})",
        f"expert total     {_mib(ex['total_bytes'])}",
        "quant types      " + ", ".join(f"{k} x{v}" for k, v in sorted(d["quant_types"].items())),
        *_fingerprint_lines(d["fingerprint"]),
        *_sizing_lines(d["sizing"]),
    ]
    return "\n".join(lines)


def _parts_lines(files: list[dict[str, Any]]) -> list[str]:
    """A split model's parts, one line each (nothing for a single file)."""
    if len(files) < 2:
        return []
    width = max(len(f["path"]) for f in files)
    return [f"split            {len(files)} parts (sizes above are of all of them)"] + [
        f"  {f['path']:<{width}}  {_mib(f['bytes'])}, {f['tensors']} tensors" for f in files]


def _fingerprint_lines(fp: dict[str, Any]) -> list[str]:
    """The model's identity (what a daemon and a decoder compare) and the file's mtime (not compared)."""
    return [f"fingerprint      size {fp['size']}, header sha256 {fp['header_sha256'][:16]}..., data sample sha256 "
            f"{fp['sample_sha256'][:16]}... ({_mib(fp['sample_bytes'])} hashed); mtime_ns {fp['mtime_ns']} (not compared)"]


def _sizing_lines(sz: dict[str, Any]) -> list[str]:
    out = [f"sizing           arena slot {format_size(sz['slot_bytes'])} per cached expert; "
           f"--memory adds ~{format_size(sz['daemon_bytes_guess'])} for the daemon itself"]
    for r in sz["budgets"]:
        out.append(f"  {r['percent']:>3}% of experts  {r['slots']:>7,} slots  arena {format_size(r['arena_bytes']):>10}"
                   f"  --memory {format_size(r['memory_bytes'], up=True)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moestream inspect", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", metavar="MODEL.gguf")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    try:
        info = describe(ModelLayout(args.model))
    except (ModelFormatError, OSError) as e:
        print(f"moestream inspect: {e}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=2) if args.json else format_text(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _shown(v: object) -> bool:
    """Hyper-parameters a family does not use (0, empty) stay out of the one-line summary."""
    return isinstance(v, bool) or v not in (0, (), {}, None)
