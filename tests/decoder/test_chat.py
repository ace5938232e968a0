"""`moestream chat` as a person uses it: a real process, lines on stdin, replies on stdout."""

from __future__ import annotations
from moestream.decoder.experts.bank import ExpertBank

import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import moestream
from moestream.decoder.serve.chat import repl

MODEL = Path(moestream.__file__).parent / "data" / "tiny-qwen3moe-q8_0.gguf"
CHAT = [sys.executable, "-m", "moestream", "chat", "--model", str(MODEL), "--resident", "--temperature", "0"]


def greedy_reply(message: str, n: int) -> str:
    """The resident decoder's greedy reply to one user message (the independent reference)."""
    from moestream.common.layout import ModelLayout
    from moestream.decoder.generation.loop import generate
    from moestream.decoder.models import load_model
    from moestream.decoder.experts.resident import QuantResidentExperts
    from moestream.decoder.generation.tokenizer import GGUFTokenizer

    layout = ModelLayout(MODEL)
    tok = GGUFTokenizer.from_layout(layout)
    ids = tok.encode(tok.render_chat([{"role": "user", "content": message}]))
    model = load_model(layout, "cpu", torch.float32, keep_quantized=True)
    with QuantResidentExperts(layout) as experts:
        return tok.decode(generate(model.with_bank(ExpertBank(experts)), [ids], n, stop_ids=tok.stop_ids).tokens[0])


def test_chat_replies_with_the_template_and_answers_commands():
    lines = "def parse(\n/stats\n/reset\n/nope\n/quit\n"
    r = subprocess.run(CHAT + ["--max-tokens", "12"], input=lines, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert f"> {greedy_reply('def parse(', 12)}\n> " in r.stdout
    assert "last reply: 12 tokens" in r.stdout and "tok/s" in r.stdout
    assert "[conversation cleared]" in r.stdout and "unknown command /nope" in r.stdout


def test_ctrl_c_stops_the_reply_not_the_program():
    # as from a terminal: a suite started in the background (`.ci/run &`) ignores SIGINT, and its
    # children would inherit that (Python then installs no KeyboardInterrupt handler)
    proc = subprocess.Popen(CHAT + ["--max-tokens", "200"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()

    def wait_for(seen: Callable[[str], bool]) -> None:
        deadline = time.monotonic() + 120
        while not seen("".join(out).split("> ", 1)[-1]):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(out)
            time.sleep(0.02)

    try:
        proc.stdin.write("def parse(\n")
        proc.stdin.flush()
        wait_for(lambda reply: len(reply) >= 8)  # the reply has started streaming
        proc.send_signal(signal.SIGINT)
        wait_for(lambda reply: "\n> " in reply)  # ... and ended: the next prompt
        # a 200-token reply takes ~0.3 s, so on a busy machine it may end before the signal lands;
        # the empty line is for a Ctrl-C that lands at the prompt (it clears the line, as a shell does)
        proc.stdin.write("\n/stats\n/quit\n")
        proc.stdin.close()
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    text = "".join(out)
    assert proc.returncode == 0, proc.stderr.read()
    tokens = int(text.split("last reply: ")[1].split(" tokens")[0])
    assert 0 < tokens <= 200
    assert (" [stopped]" in text) == (tokens < 200), text


class _CtrlCOn:
    """A chat's output that presses Ctrl-C (SIGINT to this process, as a terminal does) on the
    first write after which `when(everything written)` holds: a signal that lands at a known point,
    not by timing."""

    def __init__(self, when: Callable[[str], bool]) -> None:
        self.when, self.text, self.pressed = when, "", False

    def write(self, s: str) -> int:
        self.text += s
        if not self.pressed and self.when(self.text):
            self.pressed = True
            os.kill(os.getpid(), signal.SIGINT)
        return len(s)

    def flush(self) -> None:
        pass


@pytest.fixture
def in_process_chat():
    from moestream.decoder.serve.chat import Chat, build_parser
    from moestream.decoder.serve.config import ServeConfig
    from moestream.decoder.serve.main import open_engine

    args = build_parser().parse_args(["--model", str(MODEL), "--resident", "--temperature", "0", "--max-tokens", "200"])
    _, tok, engine, limit = open_engine(ServeConfig(model=str(MODEL), resident=True), "moestream-chat")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal (see above)
    try:
        chat = Chat(engine, tok, limit, args)
        chat.reset()
        yield chat
    finally:
        signal.signal(signal.SIGINT, previous)
        engine.close()


def test_ctrl_c_during_a_reply_cancels_it_and_keeps_what_was_said(in_process_chat):
    out = _CtrlCOn(lambda text: "> " in text and len(text.split("> ", 1)[1]) >= 8)  # a few pieces into the reply
    repl(in_process_chat, io.StringIO("def parse(\n/quit\n"), out)
    assert " [stopped]" in out.text
    assert 0 < in_process_chat.last.tokens < 200  # the engine dropped it: no more tokens came
    assert in_process_chat.history[-1]["role"] == "assistant" and in_process_chat.history[-1]["content"]


def test_ctrl_c_between_replies_gives_a_fresh_prompt(in_process_chat):
    """Ctrl-C while a command's answer prints (not a reply, not the prompt) leaves the program running."""
    out = _CtrlCOn(lambda text: "last reply:" in text)
    assert repl(in_process_chat, io.StringIO("hello\n/stats\n/help\n/quit\n"), out) == 0
    assert out.pressed and "/reset" in out.text.split("last reply:")[1]  # /help answered after it


def test_a_second_turn_reuses_the_first_and_a_full_context_says_what_it_dropped():
    """Turn 2 prefills only its new tokens (the engine's prefix cache); once the 256-token context
    is full the oldest messages go, with a notice."""
    long = "word " * 60  # ~60 tokens a message: four turns overflow the context
    lines = f"hello there\n/stats\n{long}\n{long}\n{long}\n{long}\n/stats\n/quit\n"
    r = subprocess.run(CHAT + ["--max-tokens", "8"], input=lines, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stderr
    stats = [ln for ln in r.stdout.splitlines() if "last reply" in ln]
    assert "0 reused" in stats[0]  # the first turn has nothing to reuse
    assert "[context full (256 tokens): dropped the oldest" in r.stdout
    assert "Traceback" not in r.stderr


def test_turn_two_prefill_covers_only_new_tokens_in_process():
    from moestream.decoder.serve.chat import Chat, build_parser
    from moestream.decoder.serve.config import ServeConfig
    from moestream.decoder.serve.main import open_engine
    import io

    args = build_parser().parse_args(["--model", str(MODEL), "--resident", "--temperature", "0", "--max-tokens", "6"])
    _, tok, engine, limit = open_engine(ServeConfig(model=str(MODEL), resident=True), "moestream-chat")
    try:
        chat = Chat(engine, tok, limit, args)
        chat.reset()
        out = io.StringIO()
        chat.say("one two three", out)
        first = chat.last
        chat.say("four five", out)
        assert first.cached_tokens == 0
        assert chat.last.cached_tokens >= first.prompt_tokens  # turn 1's prompt came from the cache
        assert chat.last.prompt_tokens - chat.last.cached_tokens < chat.last.prompt_tokens - first.prompt_tokens
    finally:
        engine.close()


def test_a_terminal_gets_line_editing():
    """At a terminal, Left arrow moves the cursor (readline): "/noe", Left, "p" is the line "/nope"."""
    import os
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(CHAT, stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    seen = b""

    def read_until(token: bytes, timeout: float = 120) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while token not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen
            try:
                seen += os.read(leader, 4096)
            except OSError:
                break

    try:
        read_until(b"> ")
        os.write(leader, b"/noe\x1b[Dp\r")
        read_until(b"unknown command")
        read_until(b"> ", 30)
        os.write(leader, b"/quit\r")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    assert b"unknown command /nope" in seen, seen
