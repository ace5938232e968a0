"""The systemd unit verifies, and the example config loads into the daemon's config dataclass."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    assert keys["User"] == keys["Group"] == "moestream"
    assert keys["RuntimeDirectory"] == "moestream"
    assert keys["ProtectSystem"] == "strict" and keys["ProtectHome"] == "read-only"
    assert keys["NoNewPrivileges"] == "yes"
    # The arena lives in /dev/shm: nothing may hide it or make it read-only.
    assert not any("/dev/shm" in keys.get(k, "") for k in ("InaccessiblePaths", "ReadOnlyPaths", "TemporaryFileSystem"))
    assert keys.get("PrivateIPC", "no") == "no"
    assert "AF_UNIX" in keys["RestrictAddressFamilies"]  # ipc sockets


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
