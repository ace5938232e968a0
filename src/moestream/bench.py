"""`moestream bench`: `io` (daemon delivery vs raw disk/memcpy) or `decode` (tok/s); each imported only when run."""

from __future__ import annotations

import sys

from moestream.cli import dispatch

BENCHES: dict[str, tuple[str, str]] = {
    "io": ("moestream.iod.bench", "expert delivery from moestream-iod vs the raw read/memcpy limit"),
    "decode": ("moestream.decoder.bench.decode", "tokens/s streamed vs resident"),
    "kernels": ("moestream.decoder.bench.kernels", "per-expert time: quantized kernels vs dequantize-then-matmul"),
    "serve": ("moestream.decoder.bench.serve", "a real server at concurrency 1/2/4: tok/s, TTFT, expert bytes per token"),
    "capped": ("moestream.decoder.bench.capped.main", "daemon + decoder under one memory cap, optionally beside llama.cpp"),
}


def main(argv: list[str] | None = None) -> int:
    return dispatch("moestream bench", BENCHES, sys.argv[1:] if argv is None else argv)
