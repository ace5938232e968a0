"""Issue 22, item 5: every configuration error exits 2 (systemd's RestartPreventExitStatus=2 then
stops the unit instead of restarting it every 2 s) with one line naming the problem, and leaves
no arena and no socket behind."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moestream.common.client import IodClient

IOD = [sys.executable, "-m", "moestream.iod.main"]
SHIPPED = Path(__file__).parents[2] / "systemd" / "iod.toml"


def _iod(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*IOD, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def _arenas_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"moestream-{pid}-")]


def _one_line(out: subprocess.CompletedProcess, *needles: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _eps(tmp_path: Path) -> list[str]:
    return ["--endpoint", f"ipc://{tmp_path}/a.sock", "--status-endpoint", f"ipc://{tmp_path}/s.sock"]


@pytest.mark.parametrize("kind", ["missing", "directory", "dev_zero", "head_100", "not_gguf"])
def test_bad_model_files_exit_2_naming_the_file(kind, tiny_model, tmp_path):
    path = {"missing": tmp_path / "nope.gguf", "directory": tmp_path, "dev_zero": Path("/dev/zero"),
            "head_100": tmp_path / "head.gguf", "not_gguf": tmp_path / "text.gguf"}.get(kind)
    if kind == "head_100":
        path.write_bytes(tiny_model.read_bytes()[:100])  # `head -c 100 model.gguf`
    if kind == "not_gguf":
        path.write_text("hello\n" * 10)
    out = _iod("--model", str(path), "--arena-slots", "2", *_eps(tmp_path / "run"))
    want = {"missing": "no such file", "directory": "is a directory", "dev_zero": "is a character device",
            "head_100": "truncated or corrupt", "not_gguf": "not a GGUF file"}[kind]
    _one_line(out, str(path.name) if kind != "directory" else str(path), want)
    assert not any(w in out.stderr for w in ("numpy", "mmap", "dtype", "Errno"))


def test_unreadable_model_exits_2(tiny_model, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    copy = tmp_path / "m.gguf"
    shutil.copy(tiny_model, copy)
    copy.chmod(0)
    _one_line(_iod("--model", str(copy), "--arena-slots", "2", *_eps(tmp_path)), "Permission denied")


def test_the_shipped_config_exits_2_naming_its_model(tmp_path):
    """As shipped, iod.toml names a model this machine does not have: a config error, not a crash loop."""
    text = SHIPPED.read_text().replace("/var/lib/moestream/", f"{tmp_path}/")
    cfg = tmp_path / "iod.toml"
    cfg.write_text(text)
    out = _iod("--config", str(cfg), *_eps(tmp_path))
    _one_line(out, "/srv/models/Qwen3-30B-A3B-Q4_K_M.gguf", "no such file")


def test_uncreatable_socket_directory_exits_2(tiny_model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a regular file where the socket directory would go
    out = _iod("--model", str(tiny_model), "--arena-slots", "2", "--endpoint", f"ipc://{blocker}/sub/a.sock",
               "--status-endpoint", f"ipc://{tmp_path}/s.sock")
    _one_line(out, "cannot create the socket directory", str(blocker / "sub"))
    assert not (tmp_path / "s.sock").exists()


def test_second_daemon_and_a_used_tcp_port_exit_2(tiny_model, start_daemon, tmp_path):
    d = start_daemon(tiny_model, arena_slots=2)
    p = subprocess.run([*IOD, "--model", str(tiny_model), "--arena-slots", "2", "--endpoint", d.endpoint,
                        "--status-endpoint", f"ipc://{tmp_path}/other.sock"], capture_output=True, text=True, timeout=60)
    _one_line(p, "another daemon is listening")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _iod("--model", str(tiny_model), "--arena-slots", "2", "--endpoint", f"tcp://127.0.0.1:{port}",
                   "--status-endpoint", f"ipc://{tmp_path}/s2.sock")
    _one_line(out, f"tcp://127.0.0.1:{port}", "Address already in use")
    assert not (tmp_path / "s2.sock").exists()
    with IodClient(d.endpoint) as c:  # the first one is untouched
        c.ping()


def test_ipv6_loopback_endpoint_serves(tiny_model, start_daemon):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    with socket.socket(socket.AF_INET6) as s:
        try:
            s.bind(("::1", 0))
        except OSError:
            pytest.skip("no ::1 on this host")
        port = s.getsockname()[1]
    d = start_daemon(tiny_model, arena_slots=2, extra_args=["--endpoint", f"tcp://[::1]:{port}"])
    with IodClient(f"tcp://[::1]:{port}") as c:
        c.release(c.fetch([(0, 1)])[0].result(10))
    assert d.alive()


def test_status_of_a_killed_daemon_names_its_leftover_arena(tiny_model, start_daemon):
    from moestream.tools.status import get_status

    d = start_daemon(tiny_model, arena_slots=2)
    (arena,) = _arenas_of(d.pid)
    d.proc.kill()
    d.proc.wait()
    with pytest.raises(Exception) as e:
        get_status(d.status_endpoint, timeout_s=1)
    still = Path("/dev/shm", arena).exists()  # (another daemon starting on this host removes it)
    Path("/dev/shm", arena).unlink(missing_ok=True)
    if still:
        assert f"daemon pid {d.pid} died without cleaning up" in str(e.value) and arena in str(e.value), e.value
