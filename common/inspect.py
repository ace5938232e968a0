"""`moestream inspect MODEL.gguf [--json]`: what a GGUF MoE holds, as moestream sees it.

Prints the architecture, hyper-parameters, dense bytes, the expert index (experts per layer,
largest blob, arena slot size, total expert bytes), quant types and the file fingerprint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from .layout import ModelFormatError, ModelLayout


def describe(layout: ModelLayout) -> dict[str, Any]:
    """A JSON-ready summary of `layout`."""
    ex = layout.experts
    return {
        "path": str(layout.path),
        "file_bytes": layout.file_size,
        "architecture": layout.arch_name,
        "hparams": dataclasses.asdict(layout.hparams),
        "dense_bytes": layout.dense_bytes,
        "dense_tensors": len(layout.dense),
        "experts": {**ex.summary(), "slot_bytes": ex.slot_bytes(direct_io=False),
                    "slot_bytes_direct_io": ex.slot_bytes(direct_io=True)},
        "quant_types": layout.quant_types(),
        "fingerprint": layout.fingerprint.as_dict(),
    }


def _mib(n: int) -> str:
    return f"{n:,} B ({n / 2**20:.2f} MiB)"


def format_text(d: dict[str, Any]) -> str:
    hp, ex = d["hparams"], d["experts"]
    lines = [
        f"{d['path']}  ({_mib(d['file_bytes'])})",
        f"architecture     {d['architecture']}",
        "hyper-parameters " + ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in hp.items() if k != "arch"),
        f"dense            {_mib(d['dense_bytes'])} in {d['dense_tensors']} tensors",
        f"experts          {ex['n_layer']} layers x {ex['n_expert']} experts, "
        f"top {hp['n_expert_used']}, parts {'+'.join(ex['parts'])}",
        f"blob (max)       {_mib(ex['max_blob_bytes'])}",
        f"slot             {_mib(ex['slot_bytes'])} (O_DIRECT: {_mib(ex['slot_bytes_direct_io'])})",
        f"expert total     {_mib(ex['total_bytes'])}",
        "quant types      " + ", ".join(f"{k} x{v}" for k, v in sorted(d["quant_types"].items())),
        f"fingerprint      sha256 {d['fingerprint']['header_sha256'][:16]}... "
        f"size {d['fingerprint']['size']} mtime_ns {d['fingerprint']['mtime_ns']}",
    ]
    return "\n".join(lines)


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
