"""`moestream chat`: a multi-turn conversation in the terminal, on the serving engine in process.

Each turn renders the whole conversation with the model's chat template and submits it to the
same `Engine` `moestream serve` runs; the engine's prefix cache still holds the last turn's keys
and values, so a turn prefills only its new tokens (/stats shows how many were reused). Replies
stream as they come; Ctrl-C cancels the reply (the engine drops the sequence before its next
step) and keeps what was said so far. Input has line editing and history (readline) at a terminal.

Context policy: when the conversation no longer fits (the prompt plus one reply token), the
oldest turns go first, the system message stays, and a notice says how many were dropped; a
single message longer than the context is refused. A dropped turn changes the prompt's start, so
that turn prefills in full.
"""

from __future__ import annotations

import argparse
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import ConfigError

if TYPE_CHECKING:
    from .engine import Engine
    from ..generation.tokenizer import GGUFTokenizer

HELP = "commands: /reset (forget the conversation), /stats (speed, context, experts), /help, /quit"


def build_parser() -> argparse.ArgumentParser:
    from .config import add_source_args

    ap = argparse.ArgumentParser(
        prog="moestream chat", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Chat with a GGUF MoE model in the terminal: its chat template, replies streamed as\n"
                    "they are generated, experts resident (--resident) or streamed from moestream-iod (--iod).\n"
                    f"{HELP}.\nCtrl-C stops a reply (not the program); Ctrl-D or /quit leaves.")
    add_source_args(ap)
    ap.add_argument("--system", help="a system message opening the conversation")
    ap.add_argument("--max-tokens", type=int, default=256, dest="max_tokens", help="longest reply (default 256)")
    ap.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    ap.add_argument("--top-p", type=float, default=0.9, dest="top_p", help="nucleus mass (default 0.9)")
    ap.add_argument("--top-k", type=int, default=0, dest="top_k", help="0 = off (default)")
    ap.add_argument("--min-p", type=float, default=0.0, dest="min_p", help="0 = off (default)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of the first reply (then +1 per reply)")
    return ap


@dataclass
class Turn:
    """Numbers of the last reply, for /stats."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, reused from the prefix cache
    tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0


@dataclass
class Chat:
    engine: Engine
    tok: GGUFTokenizer
    limit: int  # context length
    args: argparse.Namespace
    history: list[dict[str, str]] = field(default_factory=list)
    last: Turn = field(default_factory=Turn)
    replies: int = 0

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.args.system}] if self.args.system else []

    def prompt_ids(self) -> tuple[list[int], int]:
        """The conversation rendered and encoded, and how many of the oldest messages were dropped
        to leave room for a reply."""
        dropped = 0
        while True:
            ids = self.tok.encode(self.tok.render_chat(self.history, add_generation_prompt=True))
            turns = [i for i, m in enumerate(self.history) if m["role"] != "system"]
            if len(ids) + 1 <= self.limit or len(turns) <= 1:
                return ids, dropped
            del self.history[turns[0]]
            dropped += 1

    def say(self, text: str, out: Any) -> None:
        """One user message; the reply is streamed to `out` and kept in the history."""
        from ..generation.sampling import SamplingParams
        from .engine import DoneEvent, ErrorEvent, GenRequest
        from .text import ReplyText

        self.history.append({"role": "user", "content": text})
        ids, dropped = self.prompt_ids()
        if len(ids) >= self.limit:
            self.history.pop()
            raise ValueError(f"the message is {len(ids)} tokens; the context holds {self.limit}")
        if dropped:
            print(f"[context full ({self.limit} tokens): dropped the oldest {dropped} message"
                  f"{'s' if dropped > 1 else ''}]", file=out, flush=True)
        a = self.args
        sampling = SamplingParams(a.temperature, a.top_k, a.top_p, a.seed + self.replies, a.min_p)
        events: queue.SimpleQueue = queue.SimpleQueue()
        seq = self.engine.submit(GenRequest(ids, min(a.max_tokens, self.limit - len(ids)), sampling), events.put)
        reply, text_out, t0 = [], ReplyText(self.tok.decode, lstrip=self.tok.space_prefix), time.perf_counter()
        self.last, self.replies = Turn(prompt_tokens=len(ids)), self.replies + 1
        stop, ev, unseen = _Stop(seq.cancel), None, 0
        with stop.on_ctrl_c():
            while True:
                ev = events.get()
                if isinstance(ev, DoneEvent):
                    self.last.cached_tokens = ev.cached_tokens
                if isinstance(ev, (DoneEvent, ErrorEvent)):
                    break
                if stop.asked:  # the engine ends the sequence before its next step; show no more
                    unseen += 1
                    continue
                if not reply:
                    self.last.ttft_s = time.perf_counter() - t0
                reply.append(ev.token)
                self._show(text_out.add(ev.token), out)
        self._show(text_out.finish(), out)
        if isinstance(ev, ErrorEvent):
            print(f"\n[error: {ev.message}]", file=out, flush=True)
        elif stop.asked and (unseen or not isinstance(ev, DoneEvent) or ev.finish == "cancelled"):
            # (a Ctrl-C that came after the last token stopped nothing: the reply is whole)
            print(" [stopped]", end="", file=out, flush=True)
        self.last.tokens, self.last.decode_s = len(reply), time.perf_counter() - t0 - self.last.ttft_s
        print(file=out, flush=True)
        self.history.append({"role": "assistant", "content": text_out.text})

    @staticmethod
    def _show(piece: str, out: Any) -> None:
        if piece:
            print(piece, end="", file=out, flush=True)

    def stats(self) -> str:
        t = self.last
        rate = (t.tokens - 1) / t.decode_s if t.tokens > 1 and t.decode_s > 0 else 0.0
        used = len(self.prompt_ids()[0]) if self.history else 0
        st = self.engine.stats()
        fetched = st.get("bytes_fetched")
        experts = (f"experts: {st.get('source', '?')}" +
                   (f", {fetched / 2**20:.1f} MiB fetched so far" if fetched is not None else ""))
        return (f"last reply: {t.tokens} tokens, {rate:.1f} tok/s, first token after {t.ttft_s * 1e3:.0f} ms "
                f"(prompt {t.prompt_tokens} tokens, {t.cached_tokens} reused from earlier turns); context {used}/{self.limit} tokens; {experts}")


class _Stop:
    """Ctrl-C during a reply: the first calls `cancel` (no exception, so nothing is cut short
    half-way: the reply loop goes on until the engine says the sequence is done); a second, if the
    engine is slow to answer, raises KeyboardInterrupt as usual."""

    def __init__(self, cancel: Callable[[], None]) -> None:
        self.cancel, self.asked = cancel, False

    def _on_sigint(self, signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.asked = True
        self.cancel()

    @contextmanager
    def on_ctrl_c(self) -> Iterator[None]:
        # only the main thread may set handlers; a SIGINT that is ignored (a background job), or
        # handled by whoever embeds us, stays so
        install = threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        if install:
            signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield
        except KeyboardInterrupt:  # the second Ctrl-C (or one raised by another handler)
            self.asked = True
            self.cancel()
        finally:
            if install:
                signal.signal(signal.SIGINT, signal.default_int_handler)


def repl(chat: Chat, inp: Any = sys.stdin, out: Any = sys.stdout) -> int:
    chat.reset()
    interactive = inp.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (importing it gives input() line editing and history)
        except ImportError:  # a Python built without it: plain input
            pass
    print(f"moestream chat: {HELP}; Ctrl-C stops a reply, Ctrl-D leaves", file=out, flush=True)
    while True:
        try:
            if interactive:
                line = input("> ")
            else:
                print("> ", end="", file=out, flush=True)
                line = inp.readline()
                if not line:
                    raise EOFError
            if not command(chat, line.strip(), out):
                return 0
        except EOFError:
            print(file=out)
            return 0
        except KeyboardInterrupt:  # at the prompt (or between a reply and it): a fresh line, as a shell does
            print(file=out)


def command(chat: Chat, line: str, out: Any) -> bool:
    """Handle one input line; False to leave."""
    if line in ("/quit", "/exit"):
        return False
    if line == "/reset":
        chat.reset()
        print("[conversation cleared]", file=out, flush=True)
    elif line == "/stats":
        print(chat.stats(), file=out, flush=True)
    elif line == "/help":
        print(HELP, file=out, flush=True)
    elif line.startswith("/"):
        print(f"unknown command {line.split()[0]}; {HELP}", file=out, flush=True)
    elif line:
        try:
            chat.say(line, out)
        except ValueError as e:
            print(f"[{e}]", file=out, flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    from ..cli import run_main

    args = build_parser().parse_args(argv)
    return run_main("moestream chat", lambda: _main(args), say_interrupted=False)


def _main(args: argparse.Namespace) -> int:
    from ..generation.sampling import SamplingParams
    from .config import ServeConfig
    from .main import open_engine

    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    SamplingParams(args.temperature, args.top_k, args.top_p, args.seed, args.min_p)  # validates them
    cfg = ServeConfig(model=args.model, iod=args.iod, resident=args.resident, device=args.device,
                      dtype=args.dtype, kv_dtype=args.kv_dtype, prefetch=args.prefetch,
                      max_model_len=args.max_model_len,
                      threads=args.threads, chat_template=args.chat_template,
                      **({"prefix_cache_mb": args.prefix_cache_mb} if args.prefix_cache_mb is not None else {}))
    _, tok, engine, limit = open_engine(cfg, "moestream-chat")
    try:
        if not tok.chat_template:
            raise ConfigError("this model has no tokenizer.chat_template; use `moestream generate`")
        return repl(Chat(engine, tok, limit, args))
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
