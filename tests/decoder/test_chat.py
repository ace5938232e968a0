"""`moestream chat` as a person uses it: a real process, lines on stdin, replies on stdout."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import moestream

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
        return tok.decode(generate(model, experts, [ids], n, stop_ids=tok.stop_ids).tokens[0])


def test_chat_replies_with_the_template_and_answers_commands():
    lines = "def parse(\n/stats\n/reset\n/nope\n/quit\n"
    r = subprocess.run(CHAT + ["--max-tokens", "12"], input=lines, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert f"> {greedy_reply('def parse(', 12)}\n> " in r.stdout
    assert "last reply: 12 tokens" in r.stdout and "tok/s" in r.stdout
    assert "[conversation cleared]" in r.stdout and "unknown command /nope" in r.stdout


def test_ctrl_c_stops_the_reply_not_the_program():
    proc = subprocess.Popen(CHAT + ["--max-tokens", "200"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()
    try:
        proc.stdin.write("def parse(\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 120
        while len("".join(out).split("> ", 1)[-1]) < 8:  # the reply has started streaming
            assert time.monotonic() < deadline and proc.poll() is None, "".join(out)
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("/stats\n/quit\n")
        proc.stdin.close()
        proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    text = "".join(out)
    assert proc.returncode == 0, proc.stderr.read()
    assert " [stopped]" in text
    tokens = int(text.split("last reply: ")[1].split(" tokens")[0])
    assert 0 < tokens < 200
