"""What a user of the command line in pipes and scripts expects: no BrokenPipe tracebacks, no
screen codes or progress bars in files, prompts from files and stdin, --slots sanity notices."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

MOESTREAM = [sys.executable, "-m", "moestream"]


def _moestream(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*MOESTREAM, *args], capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.skipif(shutil.which("head") is None, reason="needs head(1)")
def test_status_watch_into_head_ends_quietly_without_screen_codes(tiny_model, start_daemon):
    d = start_daemon(tiny_model)
    cmd = f"{sys.executable} -m moestream status --endpoint {d.status_endpoint} --watch 0.02 | head -n 40"
    p = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
    assert p.returncode == 141  # as a C tool killed by SIGPIPE
    assert "\x1b" not in p.stdout and p.stdout.count("--- ") >= 1  # snapshots one after another


def test_prompt_from_a_file_and_stdin_equals_the_prompt_given_inline(tiny_model, tmp_path):
    (tmp_path / "p.txt").write_text("def main():\n")
    base = ["generate", "--model", str(tiny_model), "--resident", "-n", "5", "--json"]
    inline = _moestream(*base, "--prompt", "def main():", "--prompt", "import os")
    files = _moestream(*base, "--prompt-file", str(tmp_path / "p.txt"), "--prompt-file", "-", input="import os\n")
    assert inline.returncode == 0 and files.returncode == 0, files.stderr
    assert json.loads(files.stdout)["tokens"] == json.loads(inline.stdout)["tokens"]
    assert "dense weights" not in files.stderr  # no progress bar when stderr is not a terminal


def test_slots_are_capped_at_the_expert_count_and_below_top_k_warned(tiny_model, start_daemon):
    d = start_daemon(tiny_model)  # 2 layers x 8 experts, top-2
    base = ["generate", "--model", str(tiny_model), "--iod", d.endpoint, "--slot-format", "raw", "-n", "2",
            "--prompt", "hi"]
    big = _moestream(*base, "--slots", "1000")
    assert big.returncode == 0, big.stderr
    assert "--slots 1000 is more than the model's 16 experts; using 16" in big.stderr
    small = _moestream(*base, "--slots", "1")
    assert small.returncode == 0, small.stderr
    assert "--slots 1 is below the model's top-k (2 experts" in small.stderr


def test_threads_change_the_speed_not_the_tokens(tiny_model):
    base = ["generate", "--model", str(tiny_model), "--resident", "--prompt", "import os", "-n", "6", "--json"]
    default, one = _moestream(*base), _moestream(*base, "--threads", "1")
    assert default.returncode == 0 and one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["tokens"] == json.loads(default.stdout)["tokens"]
    many = _moestream(*base, "--threads", "4096")
    assert many.returncode == 1 and "--threads 4096: at most" in many.stderr
