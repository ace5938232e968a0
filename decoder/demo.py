"""`moestream demo`: generate text with experts streamed from a daemon, from a fresh machine.

With no arguments: take the default model (`default_model()`: the model shipped in
`src/moestream/data` when there is one, else a tiny random qwen3moe made once and cached under
~/.cache/moestream), start a private moestream-iod for it, generate a few tokens with a device
expert cache holding a quarter of the experts (on CPU the daemon's arena, computed from in
place; on CUDA a device slot cache), print the text and the streaming counters, and stop the daemon — also on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DEMO_MODEL = dict(arch="qwen3moe", quant="Q8_0", layers=4, experts=16, top_k=2, seed=0)
DEMO_FILE = "demo-qwen3moe-q8_0-v1.gguf"  # bump the suffix when DEMO_MODEL changes
DEFAULT_PROMPT = "import os\nimport sys\n\n\ndef main("

DESCRIPTION = """\
Take the tiny MoE model shipped with moestream (or, with none shipped, make one once), start a
private moestream-iod for it, and generate text with the experts streamed through a cache smaller than the expert set: on CPU the daemon's arena (experts
computed on their quantized blocks in place), on CUDA a device slot cache. Prints the text, then
tok/s, the cache hit rate, bytes fetched and how much of the misses' I/O prefetching hid.
The daemon it starts is stopped on exit, Ctrl-C included; with --iod it uses yours instead.
"""


def cache_dir() -> Path:
    """Where made models are kept: $MOESTREAM_CACHE, else $XDG_CACHE_HOME/moestream, else ~/.cache/moestream."""
    if os.environ.get("MOESTREAM_CACHE"):
        return Path(os.environ["MOESTREAM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "moestream"


def shipped_model() -> Path | None:
    """A model shipped inside the package (src/moestream/data/*.gguf), if any."""
    from importlib.resources import files

    data = Path(str(files("moestream") / "data"))
    found = sorted(data.glob("*.gguf")) if data.is_dir() else []
    return found[0] if found else None


def default_model(cache: Path | None = None) -> Path:
    """The demo's model: the shipped one, else a tiny random qwen3moe made once under `cache`."""
    shipped = shipped_model()
    if shipped is not None:
        return shipped
    from ..authoring.make_model import make_model

    folder = Path(cache) if cache is not None else cache_dir()
    path = folder / DEMO_FILE
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{DEMO_FILE}.{os.getpid()}.tmp"  # written aside, renamed: never a half file
    try:
        make_model(tmp, **DEMO_MODEL)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moestream demo", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF MoE file (default: the shipped tiny model)")
    ap.add_argument("--iod", metavar="ENDPOINT", help="use this running moestream-iod instead of starting one")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"prompt text (default {DEFAULT_PROMPT!r})")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=64, dest="max_new_tokens",
                    help="tokens to generate (default 64)")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7; 0 = greedy)")
    ap.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--slots", type=int, help="expert cache size in experts: the private daemon's arena on CPU, the "
                    "device slot cache on CUDA (default: a quarter of them)")
    ap.add_argument("--prefetch", type=int, default=1, help="layers of router look-ahead (default 1, 0 = off)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    ap.add_argument("--cache-dir", type=Path, help="where a demo model is made when none is shipped "
                    "(default ~/.cache/moestream)")
    return ap


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit in the main thread, so `finally` blocks stop the daemon."""
    def handler(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def main(argv: list[str] | None = None) -> int:
    from .cli import run_main

    args = build_parser().parse_args(argv)

    def body() -> int:
        with sigterm_as_exit():
            return run(args)

    return run_main("moestream demo", body)


def run(args: argparse.Namespace) -> int:
    if args.model:
        model_path = Path(args.model)
    else:
        print("moestream demo: preparing the demo model ...", flush=True)
        model_path = default_model(args.cache_dir)
    if args.iod:
        return generate_streamed(args, model_path, args.iod)
    from ..tools.spawn import spawn_daemon

    slots = cache_slots(args, model_path)
    daemon = spawn_daemon(model_path, arena_slots=None if device_slots(args) else slots)
    print(f"moestream demo: started moestream-iod (pid {daemon.pid}) at {daemon.endpoint}", flush=True)
    try:
        return generate_streamed(args, model_path, daemon.endpoint)
    finally:
        code = daemon.stop()
        print(f"moestream demo: stopped moestream-iod (exit code {code})", flush=True)


def cache_slots(args: argparse.Namespace, model_path: Path) -> int:
    from ..common.layout import ModelLayout

    hp = ModelLayout(model_path).hparams
    return args.slots or max(2 * hp.n_expert_used, (hp.n_layer - hp.n_dense_lead) * hp.n_expert // 4)


def device_slots(args: argparse.Namespace) -> bool:
    """Whether the decoder keeps its own slot cache (CUDA) rather than computing from the arena (CPU)."""
    from .config import resolve_device

    return resolve_device(args.device).type == "cuda"


def generate_streamed(args: argparse.Namespace, model_path: Path, endpoint: str) -> int:
    from .cli import run as generate_run
    from .config import DecoderConfig

    slots = cache_slots(args, model_path) if device_slots(args) else None
    cfg = DecoderConfig(model=str(model_path), prompts=[args.prompt], iod=endpoint, slots=slots,
                        prefetch=args.prefetch, max_new_tokens=args.max_new_tokens, device=args.device,
                        temperature=args.temperature, top_p=args.top_p, seed=args.seed, progress=False, stats=True)
    return generate_run(cfg, echo_prompt=True, header=print_header)


def print_header(cfg: Any, layout: Any) -> None:
    """What the demo runs: the model, and the expert cache against the expert set."""
    hp = layout.hparams
    cache = f"device slot cache {cfg.slots}" if cfg.slots else "the daemon's arena as the expert cache"
    print(f"model: {Path(cfg.model).name}: {hp.arch}, {hp.n_layer} layers x {hp.n_expert} experts "
          f"(top {hp.n_expert_used}); {cache} of {(hp.n_layer - hp.n_dense_lead) * hp.n_expert} experts "
          f"({cfg.resolved_slot_format}, {cfg.torch_device}), prefetch {cfg.prefetch}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
