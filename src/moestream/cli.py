"""The `moestream` command: a thin dispatcher from subcommand to the owning package's main.

Each subcommand's module is imported only when it runs, so `moestream status` never imports
torch and the daemon and decoder packages never import each other.
"""

from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("moestream.decoder.demo", "the shipped tiny model, a private daemon, streamed text"),
    "generate": ("moestream.decoder.cli", "generate text from a GGUF MoE (resident or streamed from moestream-iod)"),
    "make-model": ("moestream.authoring.make_model", "write a tiny GGUF MoE with random weights"),
    "inspect": ("moestream.tools.inspect", "print a GGUF MoE's architecture and expert index"),
    "plan": ("moestream.tools.plan", "forecast tok/s per memory size, cold-fill time and the least memory that runs"),
    "status": ("moestream.tools.status", "show a running moestream-iod's status"),
    "warm": ("moestream.tools.warm", "fill a daemon's arena with the experts a trace or its history says are hot"),
    "iod": ("moestream.iod.main", "run the I/O daemon (same as moestream-iod)"),
    "bench": ("moestream.bench", "benchmarks: `bench io`, `decode`, `kernels`, `serve`, `capped`"),
    "serve": ("moestream.decoder.serve.main", "serve a model over HTTP with OpenAI's API (continuous batching)"),
    "chat": ("moestream.decoder.serve.chat", "chat with a model in the terminal (its chat template, streamed replies)"),
    "simulate": ("moestream.authoring.policy_sim", "replay a routing trace through LFU, LRU and Belady caches"),
}


def usage(prog: str, table: dict[str, tuple[str, str]], footer: str) -> str:
    width = max(map(len, table)) + 2
    lines = [f"usage: {prog} COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}{help_}" for name, (_, help_) in table.items()]
    return "\n".join(lines + ["", footer])


def dispatch(prog: str, table: dict[str, tuple[str, str]], argv: list[str]) -> int:
    """Run `table[argv[0]]`'s module `main(argv[1:])`, importing it only now."""
    text = usage(prog, table, f"`{prog} COMMAND --help` explains each command's options.")
    if not argv or argv[0] in ("-h", "--help"):
        print(text)
        return 0
    if argv[0] not in table:
        print(f"{prog}: unknown command {argv[0]!r}\n\n{text}", file=sys.stderr)
        return 2
    module = importlib.import_module(table[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-V"], ["--version"]):
        from moestream import __version__

        print(f"moestream {__version__}")
        return 0
    return dispatch("moestream", COMMANDS, argv)


def main_entry() -> None:
    sys.exit(run_quietly_in_pipes(main))


def run_quietly_in_pipes(main_fn) -> int:
    """`main_fn()`, but a reader that went away (`moestream status --watch 1 | head`) ends the
    program quietly, as it does a C tool, instead of with a BrokenPipeError traceback."""
    try:
        code = main_fn()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush is silent too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the broken pipe
