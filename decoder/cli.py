"""`moestream generate`: text from a GGUF MoE, experts resident or streamed from moestream-iod."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..common.units import format_size
from .config import ConfigError, DecoderConfig

if TYPE_CHECKING:  # (imported lazily at run time: `--help` must not load torch models)
    from ..common.layout import HParams, ModelLayout
    from .experts.bank import BankStats
    from .experts.source import ExpertBackend
    from .experts.stats import PrefetcherStats
    from .generation.loop import GenerationResult
    from .models.moe_transformer import MoEModel
    from .experts.prefetch import Prefetcher
    from .generation.tokenizer import GGUFTokenizer

DESCRIPTION = """\
Generate text from a GGUF Mixture-of-Experts model. Dense weights are loaded onto the device
at start; experts are either all resident in this process (--resident, the reference) or
streamed from a moestream-iod daemon (--iod ENDPOINT).

Expert format (--slot-format):
  quant    (CPU default) experts are computed on their quantized GGUF blocks where they lie:
           resident, straight from the file's memory map (memory = the file's expert bytes);
           streamed, straight from the daemon's shared-memory arena, which is then the only
           expert cache (size it with `moestream-iod --memory`; no --slots here).
  raw      (CUDA default) a device slot cache of quantized blocks, read by fused kernels
           (dequantized on every use where none runs).

GPU experts (--gpu-experts, streamed on CUDA):
  slots    (default) the device slot cache above, filled from the daemon's arena.
  arena    zero copy: the fused kernels read leased arena slots in place through the arena's
           CUDA-registered mapping; no device cache, one memory budget (`moestream-iod --memory`).
           The fast path on unified memory (GB10, GH200); on a discrete GPU the low-VRAM one
           (every read crosses PCIe).
"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moestream generate", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF MoE file")
    ap.add_argument("--config", help="TOML file with DecoderConfig fields; options given here win")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--iod", metavar="ENDPOINT", help="stream experts from this moestream-iod (e.g. ipc:///run/moestream/iod.sock)")
    src.add_argument("--resident", action="store_true", default=None, help="load every expert in process (no daemon)")
    ap.add_argument("--prompt", action="append", dest="prompts", metavar="TEXT",
                    help="prompt text; repeat for several prompts decoded together as a batch")
    ap.add_argument("--prompt-file", action="append", dest="prompt_files", metavar="FILE",
                    help="read a prompt from FILE (`-` = standard input); repeatable, adds to --prompt")
    ap.add_argument("--prompt-ids", action="append", dest="prompt_ids", metavar="IDS", type=_ids,
                    help="a prompt as comma-separated token ids (e.g. 1,15,27); repeatable; instead of --prompt")
    ap.add_argument("-n", "--max-new-tokens", type=int, dest="max_new_tokens", help="tokens to generate per prompt (default 32)")
    ap.add_argument("--prefill-chunk", type=int, dest="prefill_chunk", metavar="N",
                    help="prefill the prompts N positions per forward pass (default 256): a pass holds buffers "
                         "that grow with its positions (each token's expert rows, attention scores), so a long "
                         "prompt in one pass would hold hundreds of MB; larger N prefills a little faster")
    ap.add_argument("--chat", action="store_true", default=None, help="wrap each prompt in the model's chat template")
    ap.add_argument("--temperature", type=float, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, dest="top_k", help="sample from the k most likely tokens (0 = off)")
    ap.add_argument("--top-p", type=float, dest="top_p", help="nucleus sampling mass (1 = off)")
    ap.add_argument("--seed", type=int, help="sampling seed (default 0)")
    ap.add_argument("--device", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    ap.add_argument("--dtype", help="auto (bfloat16 on cuda, float32 on cpu), float32, bfloat16, float16")
    ap.add_argument("--kv-dtype", dest="kv_dtype",
                    help="the KV cache's: auto (= --dtype), float16 (half the memory and the reads of a long "
                         "context, llama.cpp's default; rounds keys and values to 11 bits), float32, bfloat16 (cuda)")
    cache = ap.add_mutually_exclusive_group()
    cache.add_argument("--slots", type=int, help="device slot cache size in experts (streamed, raw format)")
    cache.add_argument("--cache-bytes", dest="cache_bytes",
                       help="device slot cache size in bytes, e.g. 512M (streamed, raw format)")
    ap.add_argument("--slot-format", dest="slot_format", choices=["auto", "quant", "raw"],
                    help="see above (default auto: quant on cpu, raw on cuda)")
    ap.add_argument("--gpu-experts", dest="gpu_experts", choices=["slots", "arena"],
                    help="streamed on CUDA: a device slot cache (default) or the arena read in place (see above)")
    ap.add_argument("--prefetch", type=int,
                    help="layers of router look-ahead for prefetching (default 1, 0 = off): after layer L the "
                         "routers of layers L+1..L+N guess their experts, fetched `ahead` so disk reads overlap "
                         "compute; deeper keeps more reads in flight when experts come from disk")
    ap.add_argument("--prefetch-at", dest="prefetch_at", choices=["layer", "attention"],
                    help="predict layer L+1's experts after layer L (more accurate) or after layer L's "
                         "attention (the fetch then overlaps all of layer L's experts; default with the quant format)")
    ap.add_argument("--prefetch-top", type=int, dest="prefetch_top", metavar="N",
                    help="prefetch each token's N most likely experts per predicted layer (default with the "
                         "quant format: all but the least likely, k - 1, while at least half of the experts wanted "
                         "over the last steps were not in the daemon's arena when asked for, else 1, since a wrong "
                         "guess costs a disk read and an eviction in the shared arena; else the model's top-k)")
    ap.add_argument("--reconnect-wait", type=float, dest="reconnect_s", metavar="SECONDS",
                    help="when the daemon restarts, wait this long for it to come back (default 30; 0 = give up "
                         "at once); the decoder then re-requests what was in flight and finishes with the same tokens")
    ap.add_argument("--stats", action="store_true", default=None,
                    help="print tok/s and the expert source's counters (on stderr)")
    ap.add_argument("--json", action="store_true", default=None,
                    help="print one JSON object (tokens, text, timings, counters) instead of streaming text")
    ap.add_argument("--trace-out", dest="trace_out", metavar="FILE.json",
                    help="write the routing trace (one step per forward pass: its (layer, expert) keys); "
                         "`moestream simulate` replays it")
    ap.add_argument("--force-routing", dest="force_routing", metavar="FILE.npy",
                    help="replay this routing trace, ids [tokens, layers, k], instead of the router's picks (one "
                         "prompt; the router's weights are kept): a benchmark's workload for I/O and caching")
    ap.add_argument("--no-progress", action="store_false", dest="progress", default=None, help="no loading progress bars")
    add_threads_arg(ap)
    return ap


THREADS_HELP = ("compute threads (default: up to the CPUs this process may keep busy, its affinity capped by a "
                "container's CPU quota, with the CPU kernels' count adapted between decode steps: all, half or "
                "one, whichever decodes fastest while other processes come and go). A number fixes it")


def add_threads_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--threads", type=int, metavar="N", help=THREADS_HELP)


def use_threads(n: int | None) -> None:
    """Run this thread's compute on `n` threads (numba's count is per calling thread; torch's is
    global). By default, as many as the CPUs this process may keep busy: numba and torch size
    their pools by the CPU affinity, which ignores a container's CPU quota."""
    import os

    import torch

    from ..common.procfs import available_cpus

    try:
        import numba
    except ImportError:  # a GPU-only install without the CPU kernels (e.g. .ci/gpu_check.sh)
        numba = None
    most = numba.config.NUMBA_NUM_THREADS if numba is not None else available_cpus()
    adapt = n is None
    if n is None:
        if "NUMBA_NUM_THREADS" in os.environ:  # the user's word
            return
        n = min(available_cpus(), most)
    if n > most:
        raise ConfigError(f"--threads {n}: at most {most} here (the CPUs this process may use)")
    if numba is not None:
        from .kernels.cpu import threads

        numba.set_num_threads(n)
        threads.adapt(n if adapt else None)  # by default, the kernels' count follows the host's load
    torch.set_num_threads(n)


def _ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids must be comma-separated integers, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"token ids must be non-empty and >= 0, got {text!r}")
    return ids


def read_prompt_files(paths: list[str]) -> list[str]:
    """Each file's whole text (one prompt per file; `-` is standard input), without its final newline."""
    out = []
    for path in paths:
        try:
            text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompt-file {path}: {e}") from None
        out.append(text[:-1] if text.endswith("\n") else text)
    return out


def config_from_args(args: argparse.Namespace) -> DecoderConfig:
    values = {k: v for k, v in vars(args).items() if k not in ("config", "prompt_files")}
    if args.prompt_files:
        values["prompts"] = (args.prompts or []) + read_prompt_files(args.prompt_files)
    if values.get("cache_bytes") is not None:
        from ..common.units import parse_size

        values["cache_bytes"] = parse_size(values["cache_bytes"])
    return DecoderConfig.build(args.config, **values)


def warm_cpu_kernels(cfg: DecoderConfig) -> None:
    """With CPU kernels, compile them (or load numba's cache) now, not in the first prefill."""
    if cfg.resolved_slot_format == "quant":
        from .numba_setup import warm_kernels

        warm_kernels()


def open_resident(cfg: DecoderConfig, layout: ModelLayout) -> ExpertBackend:
    """Every expert in process: `cpu-mmap` (the quant format) or `gpu-resident`."""
    warm_cpu_kernels(cfg)
    if cfg.resolved_slot_format == "quant":
        from .experts.resident import QuantResidentExperts

        return QuantResidentExperts(layout)
    from .experts.source import ResidentExperts

    return ResidentExperts(layout, cfg.torch_device, cfg.torch_dtype, progress=cfg.progress)


def default_slots(hp: HParams) -> int:
    """Without --slots/--cache-bytes: room for 4 steps' worth of routed experts, at most all of them."""
    moe_layers = hp.n_layer - hp.n_dense_lead
    return min(moe_layers * hp.n_expert, 4 * moe_layers * hp.n_expert_used)


def checked_slots(slots: int, hp: HParams) -> int:
    """--slots as given, capped at the model's expert count (with a notice); a warning when it is
    below the top-k, where every token of every layer misses."""
    total = (hp.n_layer - hp.n_dense_lead) * hp.n_expert
    if slots > total:
        print(f"moestream generate: --slots {slots} is more than the model's {total} experts; using {total}",
              file=sys.stderr)
        slots = total
    if slots < hp.n_expert_used:
        print(f"moestream generate: warning: --slots {slots} is below the model's top-k ({hp.n_expert_used} experts "
              f"per token and layer): every layer will wait on fetches", file=sys.stderr)
    return slots


def open_streamed(cfg: DecoderConfig, layout: ModelLayout, name: str = "moestream-generate") -> ExpertBackend:
    """The daemon's experts for `cfg` (`cpu-arena`, `gpu-slots` or `gpu-arena`); `name` is how the daemon's
    status lists this client."""
    try:
        from .experts.arena import open_arena
        from .experts.gpu.streamed import open_streamed as connect
    except ImportError as e:
        raise ConfigError(f"streamed mode not available ({e}); use --resident") from None
    warm_cpu_kernels(cfg)
    if cfg.resolved_slot_format == "quant":
        source = open_arena(layout, cfg.iod, fetch_timeout_s=cfg.fetch_timeout_s, name=name,
                            reconnect_s=cfg.reconnect_s)
    elif cfg.gpu_experts == "arena":
        from .experts.gpu.zero_copy import open_arena_gpu

        source = open_arena_gpu(layout, cfg.iod, cfg.torch_device, fetch_timeout_s=cfg.fetch_timeout_s, name=name,
                                reconnect_s=cfg.reconnect_s)
    else:
        sized = {"cache_bytes": cfg.cache_bytes} if cfg.cache_bytes else \
            {"slots": checked_slots(cfg.slots, layout.hparams) if cfg.slots else default_slots(layout.hparams)}
        source = connect(layout, cfg.iod, device=cfg.torch_device, dtype=cfg.torch_dtype,
                         fetch_timeout_s=cfg.fetch_timeout_s,
                         name=name, reconnect_s=cfg.reconnect_s, **sized)
    return source


def prefetcher(cfg: DecoderConfig, model: MoEModel) -> Prefetcher | None:
    """The observer that plans the prefetches of `model`'s bank between layers (streamed only)."""
    if cfg.resident or cfg.prefetch <= 0:
        return None
    from .experts.prefetch import Prefetcher

    return Prefetcher(model, model.bank, cfg.prefetch, top_k=cfg.prefetch_top, at=cfg.resolved_prefetch_at)


def prompt_ids(cfg: DecoderConfig, tok: GGUFTokenizer, n_vocab: int) -> list[list[int]]:
    if cfg.prompt_ids:
        bad = sorted({t for ids in cfg.prompt_ids for t in ids if t >= n_vocab})
        if bad:
            raise ValueError(f"--prompt-ids: token ids {bad[:5]} are not in the model's vocabulary of {n_vocab}")
        return [list(ids) for ids in cfg.prompt_ids]
    texts = [tok.render_chat([{"role": "user", "content": p}]) if cfg.chat else p for p in cfg.prompts]
    return [tok.encode(t) for t in texts]


def check_context(ids: list[list[int]], max_new: int, limit: int) -> None:
    """A prompt + max new tokens over the model's context is refused, as `serve` and `chat` refuse it."""
    longest = max(len(p) for p in ids)
    if longest + max_new > limit:
        raise ValueError(f"the prompt is {longest} tokens and -n asks for {max_new} more: {longest + max_new} is over "
                         f"the model's context length of {limit} tokens; shorten the prompt or lower -n")


def forced_ids(cfg: DecoderConfig, backend: ExpertBackend, layout: ModelLayout, n_prompts: int) -> Any:
    """--force-routing's trace [tokens, layers, k] (the bank's `forced` option), or None."""
    if not cfg.force_routing:
        return None
    from .experts.forced import load_forced

    if n_prompts != 1:
        backend.close()
        raise ConfigError(f"--force-routing replays one sequence; got {n_prompts} prompts")
    try:
        return load_forced(cfg.force_routing, layout.hparams)
    except BaseException:
        backend.close()
        raise


def run(cfg: DecoderConfig, *, echo_prompt: bool = False,
        header: Callable[[DecoderConfig, ModelLayout], None] | None = None) -> int:
    """Generate for `cfg` and print the text (streamed as it comes for a single prompt), or
    one JSON object with `cfg.json`.

    `echo_prompt` prints a single prompt's text before its continuation; `header(cfg, layout)`
    runs once the model is loaded, before generating (the demo's description of the setup)."""
    from ..common.layout import ModelLayout
    from .experts.bank import ExpertBank
    from .generation.loop import TextStream, generate
    from .models import load_model
    from .generation.tokenizer import GGUFTokenizer
    from .generation.traces import RoutingRecorder

    use_threads(cfg.threads)
    layout = ModelLayout(cfg.model)
    tok = GGUFTokenizer.from_layout(layout)
    ids = prompt_ids(cfg, tok, layout.hparams.n_vocab)
    check_context(ids, cfg.max_new_tokens, layout.hparams.context_length)
    t0 = time.perf_counter()
    model = load_model(layout, cfg.torch_device, cfg.torch_dtype, progress=cfg.progress,
                       keep_quantized=cfg.resolved_slot_format == "quant", kv_dtype=cfg.torch_kv_dtype)
    backend = open_resident(cfg, layout) if cfg.resident else open_streamed(cfg, layout)
    if cfg.resolved_slot_format == "quant":  # CPU kernels: what they no longer need goes before the cap feels it
        from .footprint import trim

        trim()
    recorder = backend = RoutingRecorder(backend) if cfg.trace_out else backend
    # forced ids replace the router's before the backend (and the recorder) sees them
    model = model.with_bank(ExpertBank(backend, forced=forced_ids(cfg, backend, layout, len(ids))))
    hook = prefetcher(cfg, model)
    load_s = time.perf_counter() - t0
    single = len(ids) == 1 and not cfg.json
    if header is not None:
        header(cfg, layout)
    if single and echo_prompt and cfg.prompts:
        print(cfg.prompts[0], end="", flush=True)
    stream = TextStream(tok.decode, lambda _i, text: print(text, end="", flush=True)) if single else None
    with model.bank:
        result = generate(model, ids, cfg.max_new_tokens, cfg.sampling, tok.stop_ids, tok.pad_id,
                          on_token=stream, observer=hook, prefill_chunk=cfg.prefill_chunk)
        stats = model.bank.stats()
    if cfg.trace_out:
        recorder.write(cfg.trace_out, layout.hparams.n_layer, layout.hparams.n_expert)
    if stream is not None:
        stream.flush()
    prefetch = hook.stats() if hook is not None else None
    if cfg.json:
        print(json.dumps(result_json(result, tok, ids, load_s, stats, prefetch)))
    else:
        print_results(result, tok, single)
    if cfg.stats:
        print_stats(result, load_s, stats, prefetch)
    return 0


def result_json(result: GenerationResult, tok: GGUFTokenizer, ids: list[list[int]], load_s: float,
                stats: BankStats, prefetch: PrefetcherStats | None) -> dict[str, Any]:
    return {"prompt_tokens": [len(p) for p in ids], "tokens": result.tokens,
            "text": [tok.decode(t) for t in result.tokens], "finish": result.finish,
            "new_tokens": result.new_tokens, "steps": result.steps, "load_s": load_s,
            "prefill_s": result.prefill_s, "decode_s": result.decode_s, "decode_tok_s": result.decode_tok_s(),
            "stats": stats.as_dict(), "prefetch": prefetch.as_dict() if prefetch is not None else None,
            "memory": _own_memory()}


def _own_memory() -> dict[str, int]:
    """This process's resident memory now, bytes: anonymous (what a memory cap must leave it) and
    file pages (libraries, and the model's map with --resident)."""
    from .footprint import own_memory

    m = own_memory()
    return {"anon": m.anon, "file": m.file}


def print_results(result: GenerationResult, tok: GGUFTokenizer, streamed: bool) -> None:
    if streamed:
        print()
        return
    for i, ids in enumerate(result.tokens):
        print(f"--- [{i}] ({result.finish[i]}, {len(ids)} tokens)")
        print(tok.decode(ids))


def print_stats(result: GenerationResult, load_s: float, bank_stats: BankStats,
                prefetch: PrefetcherStats | None = None) -> None:
    """Counters for people, on stderr (stdout carries the text)."""
    out = sys.stderr
    print(f"stats: decode {result.decode_tok_s():.1f} tok/s ({result.new_tokens} tokens, {result.steps} decode steps), "
          f"prefill {result.prefill_s * 1e3:.1f} ms, load {load_s:.2f} s", file=out)
    print(bank_stats.describe(), file=out)
    if prefetch is not None:
        print(prefetch.describe(), file=out)
    m = _own_memory()
    print(f"stats: memory: this process {format_size(m['anon'])} anonymous, {format_size(m['file'])} of file pages "
          "(libraries; with --resident the model's map too); the arena is the daemon's", file=out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main("moestream generate", lambda: run(config_from_args(args)))


def run_main(prog: str, body: Callable[[], int], *, say_interrupted: bool = True) -> int:
    """`body()` as a command's exit code: a failure the user can fix (`expected_error`) is one line
    on stderr and 1, Ctrl-C 130; anything else is a bug and keeps its traceback."""
    try:
        return body()
    except KeyboardInterrupt:
        if say_interrupted:
            print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not expected_error(e):
            raise
        print(f"{prog}: {e}", file=sys.stderr)
        return 1


def expected_error(e: BaseException) -> bool:
    """Errors of the input or the environment (bad file, bad option, daemon gone or not
    starting): worth one clear line. Anything else is a bug and keeps its traceback."""
    if isinstance(e, (ValueError, OSError, KeyError)):
        return True
    try:
        from ..common.client import IodError
        from ..tools.spawn import DaemonStartError
    except ImportError:  # streamed extras not installed: nothing of theirs can have raised
        return False
    return isinstance(e, (IodError, DaemonStartError))


if __name__ == "__main__":
    sys.exit(main())
