"""`moestream bench`: `io` (daemon delivery vs raw disk/memcpy) or `decode` (tok/s); each imported only when run."""

from __future__ import annotations

import importlib
import sys

BENCHES: dict[str, tuple[str, str]] = {
    "io": ("moestream.iod.bench", "expert delivery from moestream-iod vs the raw read/memcpy limit"),
    "decode": ("moestream.decoder.bench", "tokens/s streamed vs resident"),
}


def usage() -> str:
    lines = ["usage: moestream bench {io,decode} [ARGS...]", ""]
    lines += [f"  {name:<7} {help_}" for name, (_, help_) in BENCHES.items()]
    lines += ["", "`moestream bench io --help` explains its options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in BENCHES:
        print(f"moestream bench: unknown benchmark {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHES[argv[0]][0]).main(argv[1:]) or 0)
