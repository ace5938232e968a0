"""The command-line defects a new user met (issue 23), each run the way the user ran it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import moestream

MODEL = Path(moestream.__file__).parent / "data" / "tiny-qwen3moe-q8_0.gguf"


def moestream_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moestream", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def one_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln]
    assert "Traceback" not in text, text
    return lines[-1]


@pytest.mark.parametrize("value", ["-1", "0", "nan", "soon"])
def test_status_watch_needs_a_positive_interval(value):
    r = moestream_cli("status", "--watch", value)
    assert r.returncode == 2 and "--watch" in one_line(r.stderr)


def test_warm_top_asks_the_status_socket_beside_its_daemon(start_daemon):
    """`warm --iod X --top N` used to ask /run/moestream/status.sock instead of X's daemon."""
    d = start_daemon(MODEL)
    r = moestream_cli("warm", "--iod", d.endpoint, "--top", "5", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "warmed" in r.stdout or "nothing to warm" in r.stderr


def test_warm_top_over_tcp_asks_for_the_status_endpoint():
    from moestream.tools.warm import WarmConfig

    with pytest.raises(ValueError, match="--status"):
        WarmConfig(endpoint="tcp://127.0.0.1:5555", top=5)


def test_status_counts_not_cached_answers_apart_from_errors(start_daemon, wait_status):
    """A `cached` prefetch of an expert the arena lacks is answered not_cached: routine, no error."""
    from moestream.common.client import IodClient
    from moestream.tools.status import format_status, get_status

    d = start_daemon(MODEL)
    with IodClient(d.endpoint, name="papercut") as c:
        for f in c.fetch([(0, 1), (1, 2)], priority="cached"):
            assert f.exception(30) is not None  # nothing is cached yet
    s = wait_status(d.status_endpoint, lambda s: s["errors_by_code"].get("not_cached", 0) >= 2)
    text = format_status(get_status(d.status_endpoint))
    row = next(ln for ln in text.splitlines() if ln.startswith("errors"))
    assert "evicts as LFU" in next(ln for ln in text.splitlines() if ln.startswith("arena"))  # no access has hit yet
    assert row.split()[1] == str(s["errors"] - s["errors_by_code"]["not_cached"])
    assert "not_cached" in row.split(";", 1)[1]


def test_simulate_speaks_as_moestream_simulate():
    r = moestream_cli("simulate", "--no-such-option")
    assert r.returncode == 2 and r.stderr.startswith("usage: moestream simulate")


def test_serve_port_over_65535_names_the_option(capsys):
    from moestream.decoder.serve.main import main

    assert main(["--model", str(MODEL), "--resident", "--port", "70000"]) == 1
    err = one_line(capsys.readouterr().err)
    assert "--port must be <= 65535, got 70000" in err and "None" not in err


def test_help_lists_every_bench_and_demo_says_it_uses_the_shipped_model(capsys):
    from moestream.bench import BENCHES
    from moestream.cli import main
    from moestream.decoder.demo import build_parser

    main(["--help"])
    bench_line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("bench"))
    assert all(name in bench_line for name in BENCHES), bench_line
    text = build_parser().format_help()
    assert "shipped" in text and not text.split("\n\n")[1].startswith("Make")


def test_serve_help_example_sends_no_model_it_does_not_serve():
    from moestream.decoder.serve.config import DESCRIPTION

    assert '"model": "model"' not in DESCRIPTION


def test_generate_refuses_a_prompt_and_length_over_the_context():
    ids = ",".join(["5"] * 200)
    r = moestream_cli("generate", "--model", str(MODEL), "--resident", "--prompt-ids", ids, "-n", "100")
    assert r.returncode == 1
    err = one_line(r.stderr)
    assert "300" in err and "256" in err and "context" in err


def test_tests_keep_their_files_out_of_the_home_cache():
    from moestream.authoring.tokenizer_data import cache_dir
    from moestream.decoder.demo import cache_dir as demo_cache

    home = Path.home() / ".cache" / "moestream"
    assert cache_dir() != home and demo_cache() != home
    assert ".pytest_cache" in str(cache_dir()) or "moestream-tests-" in str(cache_dir())
