"""`moestream demo` from a fresh machine: makes its model, runs a real daemon, cleans up."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from moestream.tools import spawn
from moestream.common.client import IodClient
from moestream.common.layout import ModelLayout
from moestream.decoder import demo


class Spawned:
    """Records what the demo started (the real spawn_daemon runs): pid, run dir, arena name."""

    def __init__(self):
        self.daemons, self.arenas = [], []

    def __call__(self, *args, **kwargs):
        d = spawn_daemon(*args, **kwargs)
        self.daemons.append(d)
        with IodClient(d.endpoint) as c:
            self.arenas.append(c.welcome["arena_name"])
        return d

    def assert_clean(self):
        assert len(self.daemons) == 1
        d = self.daemons[0]
        assert d.proc.poll() is not None, "the daemon is still running"
        assert not Path(d.run_dir).exists(), "the daemon's run dir (sockets) was left behind"
        assert not (Path("/dev/shm") / self.arenas[0]).exists(), "its shared memory was left behind"


spawn_daemon = spawn.spawn_daemon


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty model cache, and a record of the daemon the demo starts."""
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(run))
    monkeypatch.delenv("MOESTREAM_CACHE", raising=False)
    spawned = Spawned()
    monkeypatch.setattr(spawn, "spawn_daemon", spawned)
    return tmp_path / "cache", spawned


def test_demo_from_fresh_machine(fresh, capsys):
    cache, spawned = fresh
    assert demo.main(["--cache-dir", str(cache), "-n", "6"]) == 0
    cap = capsys.readouterr()
    assert demo.DEFAULT_PROMPT in cap.out and "(6 tokens, " in cap.err
    assert "the daemon's arena as the expert cache" in cap.out and "fetched now" in cap.err
    assert "stopped moestream-iod (exit code 0)" in cap.out
    spawned.assert_clean()


def test_without_a_shipped_model_the_demo_makes_one_once(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "shipped_model", lambda: None)
    made = demo.default_model(tmp_path)
    assert made == tmp_path / demo.DEMO_FILE and ModelLayout(made).hparams.arch == "qwen3moe"
    mtime = made.stat().st_mtime_ns
    assert demo.default_model(tmp_path) == made and made.stat().st_mtime_ns == mtime  # reused, not remade
    assert sorted(p.name for p in tmp_path.iterdir()) == [demo.DEMO_FILE]  # no half-written leftovers


def test_demo_stops_its_daemon_on_ctrl_c(fresh, capsys, monkeypatch):
    cache, spawned = fresh

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("moestream.decoder.generation.loop.generate", interrupted)
    assert demo.main(["--cache-dir", str(cache), "-n", "2"]) == 130
    captured = capsys.readouterr()
    assert "interrupted" in captured.err and "stopped moestream-iod" in captured.out
    spawned.assert_clean()


def test_demo_bad_model_is_one_clear_line(fresh, capsys, tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"nope" * 100)
    assert demo.main(["--model", str(bad)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "moestream" in err[0] and "not-a-model.gguf" in err[0]


def test_bench_decode_json(make_tiny_model, capsys):
    import json

    from moestream.decoder.bench import decode as bench

    model = make_tiny_model(quant="Q8_0", layers=2, experts=8, top_k=2)
    assert bench.main(["--model", str(model), "-n", "3", "--repeat", "1", "--prompt-tokens", "4", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["experts"] == 16 and r["working_set"]["slots"] == 16 and r["tight"]["slots"] == 4
    assert r["working_set"]["hit_rate"] == 1.0 and r["working_set"]["missed_bytes_per_token"] == 0
    assert r["tight"]["missed_bytes_per_token"] > 0 and r["bandwidth"]["bytes"] == r["delivery"]["bytes"] > 0
    for name in ("tight", "tight_no_prefetch"):
        t = r[name]
        assert t["bound_tok_s"] <= r["resident"]["tok_s"] and t["ratio_to_bound"] == t["tok_s"] / t["bound_tok_s"]
    assert bench.main(["--model", str(model), "--tight", "2"]) == 1
    assert "--tight must be in (0, 1]" in capsys.readouterr().err
