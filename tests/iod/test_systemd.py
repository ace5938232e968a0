"""The systemd unit verifies, and the example config loads into the daemon's config dataclass."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moestream.common.client import IodClient
from moestream.tools.spawn import spawn_daemon
from moestream.tools.status import get_status
from moestream.iod.config import IodConfig, load_config

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD / "moestream-iod.service"
ANALYZE = shutil.which("systemd-analyze")


def _entry_point() -> str:
    """The installed `moestream-iod` (verify insists ExecStart's binary exists)."""
    found = shutil.which("moestream-iod") or str(Path(sys.executable).with_name("moestream-iod"))
    if not Path(found).is_file():
        pytest.skip("moestream-iod is not installed (pip install -e .)")
    return found


def _verify(unit_text: str, tmp_path: Path) -> str:
    """systemd-analyze verify's diagnostics for this unit text ('' when clean)."""
    path = tmp_path / UNIT.name
    path.write_text(unit_text)
    res = subprocess.run([ANALYZE, "verify", str(path)], capture_output=True, text=True, timeout=60)
    out = (res.stdout + res.stderr).strip()
    # verify also checks units it pulls in (e.g. multi-user.target); only our unit's lines count.
    ours = "\n".join(line for line in out.splitlines() if UNIT.name in line)
    return ours or ("" if res.returncode == 0 else out)


def _with_exec(text: str) -> str:
    return text.replace("/usr/local/bin/moestream-iod", _entry_point())


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed (apt-get install systemd)")
def test_unit_verifies(tmp_path: Path) -> None:
    text = UNIT.read_text()
    assert _verify(_with_exec(text), tmp_path) == ""
    # The check can fail: a misspelt value and an unknown key are reported.
    broken = _with_exec(text).replace("Type=notify", "Type=notifyy").replace("[Install]", "[Install]\nBogus=1")
    diag = _verify(broken, tmp_path)
    assert "notifyy" in diag and "Bogus" in diag


def test_unit_essentials() -> None:
    keys: dict[str, str] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            keys[k.strip()] = v.strip()
    assert keys["Type"] == "notify"
    assert keys["ExecStart"] == "/usr/local/bin/moestream-iod --config /etc/moestream/iod.toml"
    assert keys["Restart"] == "on-failure"
    assert keys["RestartPreventExitStatus"] == "2"  # a configuration error is not retried in a loop
    assert int(keys["StartLimitBurst"]) <= 5 and int(keys["StartLimitIntervalSec"]) >= 30  # nor a crash loop
    assert keys["User"] == keys["Group"] == "moestream"
    assert keys["RuntimeDirectory"] == "moestream"
    assert keys["ProtectSystem"] == "strict" and keys["ProtectHome"] == "read-only"
    assert keys["NoNewPrivileges"] == "yes"
    # The arena lives in /dev/shm: nothing may hide it or make it read-only.
    assert not any("/dev/shm" in keys.get(k, "") for k in ("InaccessiblePaths", "ReadOnlyPaths", "TemporaryFileSystem"))
    assert keys.get("PrivateIPC", "no") == "no"
    assert "AF_UNIX" in keys["RestrictAddressFamilies"]  # ipc sockets
    assert keys["LimitMEMLOCK"] == "infinity"  # the arena registered with the ring (READ_FIXED)


def test_example_config_loads_and_covers_every_key(tmp_path: Path) -> None:
    example = SYSTEMD / "iod.toml"
    text = example.read_text()
    assert re.search(r'^model = "/', text, flags=re.M)
    copy = tmp_path / "iod.toml"  # same file with a model that exists, in case the loader checks
    copy.write_text(re.sub(r'^model = ".*"$', f'model = "{__file__}"', text, flags=re.M))
    cfg = load_config(["--config", str(copy)])  # the daemon's own loader and validation
    assert isinstance(cfg, IodConfig)
    assert cfg.endpoint == "ipc:///run/moestream/iod.sock" and cfg.socket_mode == 0o660
    documented = set(re.findall(r"^#?\s*([a-z_]+)\s*=", text, flags=re.M))
    missing = {f.name for f in dataclasses.fields(IodConfig)} - documented
    assert not missing, f"iod.toml does not show these config keys: {sorted(missing)}"
    # The endpoints must sit in the unit's RuntimeDirectory.
    assert all(ep.startswith("ipc:///run/moestream/") for ep in (cfg.endpoint, cfg.status_endpoint))


def test_shipped_example_config_starts_the_daemon(tiny_model, tmp_path: Path) -> None:
    """systemd/iod.toml as shipped, only `model` pointed at a test model, through the daemon's own
    loader and into a running daemon that serves an expert. The sockets go to tmp_path (options on
    the command line win over the file): the file's /run/moestream is the unit's RuntimeDirectory."""
    copy = tmp_path / "iod.toml"
    copy.write_text(re.sub(r'^model = ".*"$', f'model = "{tiny_model}"', (SYSTEMD / "iod.toml").read_text(), flags=re.M))
    cfg = load_config(["--config", str(copy)])
    assert cfg.model == tiny_model
    history = ["--history-file", str(tmp_path / "hotness.json")]  # the file's is the unit's StateDirectory
    with spawn_daemon(tiny_model, run_dir=tmp_path / "run", extra_args=["--config", str(copy), *history]) as d:
        with IodClient(d.endpoint, name="example") as c:
            c.release(c.fetch([(0, 0)])[0].result(10))
        s = get_status(d.status_endpoint)
        assert s["memory"]["budget"] == cfg.memory and s["fairness"]["client_lease_share"] == cfg.client_lease_share
    assert d.proc.returncode == 0, d.log_text()


def _iod_logged(tmp_path: Path, args: list[str], journal: str) -> tuple[subprocess.Popen, Path]:
    """The daemon with stderr in a file; JOURNAL_STREAM names that file ("same"), another file
    ("other": as a child of a journal-logged process whose stderr was redirected), or is unset."""
    log = tmp_path / f"{journal}.log"
    other = tmp_path / "elsewhere.log"
    other.touch()
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    with open(log, "wb") as f:
        if journal != "unset":
            st = os.fstat(f.fileno()) if journal == "same" else os.stat(other)
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        proc = subprocess.Popen([sys.executable, "-m", "moestream.iod.main", *args], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=f, env=env)
    return proc, log


def _wait_for(log: Path, text: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while text not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert text in log.read_text(), log.read_text()


@pytest.mark.parametrize("journal", ["same", "other", "unset"])
def test_log_lines_carry_journal_priorities_only_when_stderr_is_the_journal(tiny_model, tmp_path, journal):
    run = tmp_path / "run"
    args = ["--model", str(tiny_model), "--arena-slots", "2", "--endpoint", f"ipc://{run}/iod.sock",
            "--status-endpoint", f"ipc://{run}/status.sock"]
    proc, log = _iod_logged(tmp_path, args, journal)
    try:
        _wait_for(log, "serving", proc)
        get_status(f"ipc://{run}/status.sock")  # answered once the loop (and its SIGHUP handler) runs
        os.kill(proc.pid, signal.SIGHUP)
        _wait_for(log, "SIGHUP ignored", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    (tmp_path / "bad").mkdir()
    bad, bad_log = _iod_logged(tmp_path / "bad", [*args, "--queue-depth", "0"], journal)  # a configuration error
    assert bad.wait(30) == 2
    lines = log.read_text().splitlines() + bad_log.read_text().splitlines()
    want = {"serving": "<6>moestream-iod: INFO serving", "SIGHUP": "<4>moestream-iod: WARNING SIGHUP ignored",
            "stopped": "<6>moestream-iod: INFO stopped", "queue_depth": "<3>moestream-iod: error: queue_depth"}
    for word, line in want.items():
        (got,) = [x for x in lines if word in x]
        expected = line if journal == "same" else line[3:]
        assert got.startswith(expected), (got, expected)
    assert all(x.startswith("<") == (journal == "same") for x in lines), lines
