"""IodConfig: TOML + CLI overrides, sizes, validation; sd_notify; `moestream status`."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from moestream.tools import status as status_cli
from moestream.common.client import IodClient
from moestream.iod import notify
from moestream.iod.config import DEFAULT_ENDPOINT, ConfigError, load_config, parse_size, resolve_slots


@pytest.mark.parametrize("text,value", [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1000", 1000), ("1.5k", 1536),
                                        ("2 GB", 2 * 10**9), (123, 123)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_direct_reads_are_automatic_when_unset(tiny_model, tmp_path):
    import dataclasses
    import os

    from moestream.common.layout import ModelLayout
    from moestream.iod.limits import MemoryLimit
    from moestream.iod.startup import auto_direct, choose_direct

    gib = 1 << 30
    assert auto_direct(40 * gib, 24 * gib, 8 * gib, True)[0] is True  # 40 GiB of experts, 16 GiB of cache left
    assert auto_direct(12 * gib, 24 * gib, 8 * gib, True)[0] is False
    on, why = auto_direct(40 * gib, 24 * gib, 8 * gib, False)
    assert not on and "refuses" in why
    cfg = load_config(["--model", str(tiny_model), "--arena-slots", "4"])
    assert cfg.direct is None
    layout = ModelLayout(tiny_model)
    assert choose_direct(cfg, layout, MemoryLimit(1 << 40, "test"), 0)[0] is False  # fits many times over
    try:  # what the file system says, asked directly
        os.close(os.open(tiny_model, os.O_RDONLY | os.O_DIRECT))
        takes = True
    except OSError:
        takes = False
    small = MemoryLimit(layout.experts.total_bytes // 2, "test")  # the experts do not fit in it
    assert choose_direct(cfg, layout, small, 0)[0] is takes
    assert choose_direct(dataclasses.replace(cfg, direct=False), layout, small, 0) == (False, "--no-direct")


@pytest.mark.parametrize("text", ["lots", "4XB", "-1", ""])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match="bad size"):
        parse_size(text)


def test_toml_then_cli_overrides(tmp_path):
    toml = tmp_path / "iod.toml"
    toml.write_text('model = "/m.gguf"\narena-bytes = "2GiB"\nqueue_depth = 8\nlease_timeout = 3.5\nsocket_mode = "0640"\n')
    cfg = load_config(["--config", str(toml), "--queue-depth", "16", "--direct"])
    assert cfg.model == Path("/m.gguf") and cfg.arena_bytes == 2 << 30 and cfg.queue_depth == 16
    assert cfg.lease_timeout_s == 3.5 and cfg.socket_mode == 0o640 and cfg.direct is True
    assert cfg.endpoint == DEFAULT_ENDPOINT and cfg.backend == "auto"
    assert load_config(["--config", str(toml), "--no-direct"]).direct is False
    by_slots = load_config(["--config", str(toml), "--arena-slots", "64"])  # the CLI's sizing replaces the file's
    assert by_slots.arena_slots == 64 and by_slots.arena_bytes is None


@pytest.mark.parametrize("args,match", [
    ([], "no model"),
    (["--model", "m", "--endpoint", "http://x"], "endpoint"),
    (["--model", "m", "--socket-mode", "0666"], "others"),
    (["--model", "m", "--queue-depth", "0"], "positive"),
    (["--model", "m", "--queue-depth", "5000"], "above the maximum of 4096"),
    (["--model", "m", "--endpoint", "ipc:///a", "--status-endpoint", "ipc:///a"], "differ"),
    (["--model", "m", "--client-lease-share", "0"], r"client_lease_share must be a share in \(0, 1\]"),
    (["--model", "m", "--client-lease-share", "1.5"], "client_lease_share"),
    (["--model", "m", "--queue-deadline", "0"], "queue_deadline_s must be a positive number"),
])
def test_bad_configs(args, match):
    with pytest.raises(ConfigError, match=match):
        load_config(args)


@pytest.mark.parametrize("line,match", [('direct = "false"', "direct must be bool"),
                                        ('queue_depth = "8"', "queue_depth must be int"),
                                        ("backend = 1", "backend must be str"),
                                        ("queue_depth = true", "queue_depth must be int")])
def test_toml_values_are_type_checked(tmp_path, line, match):
    (tmp_path / "t.toml").write_text(f'model = "m"\n{line}\n')
    with pytest.raises(ConfigError, match=match):
        load_config(["--config", str(tmp_path / "t.toml")])


def test_bad_toml(tmp_path):
    (tmp_path / "a.toml").write_text("model = \n")
    with pytest.raises(ConfigError, match="a.toml"):
        load_config(["--config", str(tmp_path / "a.toml")])
    (tmp_path / "b.toml").write_text('model = "m"\nturbo = true\n')
    with pytest.raises(ConfigError, match="unknown config keys: turbo"):
        load_config(["--config", str(tmp_path / "b.toml")])


def test_resolve_slots():
    cfg = load_config(["--model", "m", "--arena-bytes", "1MiB"])
    assert resolve_slots(cfg, 64 << 10, 1000) == 16
    assert resolve_slots(cfg, 64 << 10, 10) == 10  # never more slots than experts
    with pytest.raises(ConfigError, match="cannot hold"):
        resolve_slots(cfg, 2 << 20, 10)


def test_notify(tmp_path, monkeypatch):
    path = tmp_path / "n.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert notify.notify("READY=1")
        assert s.recv(100) == b"READY=1"
        monkeypatch.delenv("NOTIFY_SOCKET")
        assert not notify.notify("READY=1")
    finally:
        s.close()


def test_status_cli(tiny_model, start_daemon, capsys):
    d = start_daemon(tiny_model, arena_slots=2)
    with IodClient(d.endpoint, name="cli-test") as c:
        c.release(c.fetch([(0, 1)])[0].result(10))
        assert status_cli.main(["--endpoint", d.status_endpoint, "--json"]) == 0
        s = json.loads(capsys.readouterr().out)
        assert s["requests"] == 1 and s["clients"][0]["name"] == "cli-test"
        assert status_cli.main(["--endpoint", d.status_endpoint]) == 0
        table = capsys.readouterr().out
        assert "hit rate" in table and "cli-test" in table and s["arena"]["name"] in table
    assert status_cli.main(["--endpoint", f"ipc://{d.run_dir}/none.sock", "--timeout", "0.2"]) == 1
    assert "no status" in capsys.readouterr().err


@pytest.mark.parametrize("ep,ok", [("tcp://127.0.0.1:5555", True), ("tcp://localhost:5555", True),
                                   ("tcp://[::1]:5555", True), ("tcp://0.0.0.0:5555", False),
                                   ("tcp://10.1.2.3:5555", False)])
def test_tcp_binds_to_loopback_unless_allowed(tmp_path, ep, ok):
    argv = ["--model", str(tmp_path / "m.gguf"), "--endpoint", ep]
    if ok:
        assert load_config(argv).endpoint == ep
    else:
        with pytest.raises(ConfigError, match="not a loopback address"):
            load_config(argv)
        assert load_config([*argv, "--allow-remote"]).allow_remote


@pytest.mark.parametrize("share,n_slots,top_k,quota", [(0.5, 8, 2, 4), (0.5, 3, 2, 2), (0.1, 100, 8, 10),
                                                     (0.01, 100, 8, 8), (0.5, 1, 2, 1), (1.0, 8, 2, None),
                                                     (0.5, 4, 4, 2), (0.9, 32, 4, 28), (0.5, 32, 4, 16)])
def test_lease_quota(share, n_slots, top_k, quota):
    """A share of the slots, never below a top-k, never the whole arena (4 slots, top-k 4: 2, not 4;
    another share's layer must fit beside it); a share of 1 is no quota."""
    cfg = load_config(["--model", "m", "--client-lease-share", str(share), "--queue-deadline", "2.5"])
    assert cfg.lease_quota(n_slots, top_k) == quota and cfg.queue_deadline_s == 2.5


def test_unknown_socket_group_is_a_configuration_error(tiny_model, tmp_path):
    """Exit 2 (the unit's RestartPreventExitStatus), one line, before anything is created."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "moestream.iod.main", "--model", str(tiny_model), "--arena-slots", "2",
                          "--endpoint", f"ipc://{tmp_path}/iod.sock", "--status-endpoint", f"ipc://{tmp_path}/st.sock",
                          "--socket-group", "no-such-group-moestream"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "socket_group 'no-such-group-moestream' does not exist" in line
    assert not (tmp_path / "iod.sock").exists()
