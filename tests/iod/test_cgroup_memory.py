"""Issue 22, item 4: a daemon in a memory cgroup smaller than the arena it is asked for refuses in
one line with exit code 2 before the arena exists (instead of being OOM-killed while filling it,
silently, and restarted by systemd every 2 s); sized by default, it fits itself to the limit.

The daemon runs in a real child memory cgroup (v2 `memory.max` or v1 `memory.limit_in_bytes`)
made for the test; skipped where this process may not make one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from moestream.iod.limits import _cgroup_mounts
from moestream.tools.status import get_status

LIMIT = 128 << 20


def _own_memory_cgroup() -> tuple[Path, str] | None:
    """(directory of this process's memory cgroup, limit file name), or None."""
    mounts = _cgroup_mounts(Path("/proc/self/mountinfo").read_text())
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and "cgroup2" in mounts:
            root, point = mounts["cgroup2"][0]
            d = Path(point) / path.lstrip("/")
            if "memory" in (d / "cgroup.controllers").read_text().split() if (d / "cgroup.controllers").exists() else "":
                return d, "memory.max"
        elif "memory" in controllers.split(",") and "memory" in mounts:
            root, point = mounts["memory"][0]
            return Path(point) / path[len(root.rstrip("/")):].lstrip("/"), "memory.limit_in_bytes"
    return None


@pytest.fixture
def cgroup():
    """A child memory cgroup limited to 128 MiB: (its cgroup.procs, its limit file)."""
    found = _own_memory_cgroup()
    if found is None:
        pytest.skip("no memory cgroup controller here")
    parent, limit_name = found
    child = parent / f"moestream-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
        (child / limit_name).write_text(str(LIMIT))
    except OSError as e:
        if child.exists():
            child.rmdir()
        pytest.skip(f"cannot make a memory cgroup under {parent}: {e.strerror}")
    yield child
    for _ in range(100):  # the kernel lets it go once its last process is reaped
        try:
            child.rmdir()
            break
        except OSError:
            time.sleep(0.05)


def _in_cgroup(cg: Path, args: list[str], **kw) -> subprocess.Popen:
    wrapper = ["sh", "-c", f'echo $$ > "{cg}/cgroup.procs" && exec "$@"', "sh", sys.executable, "-m",
               "moestream.iod.main", *args]
    return subprocess.Popen(wrapper, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _shm_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"moestream-{pid}-")]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """2 layers x 80 experts of ~0.8 MiB: 128 MiB of experts, more than the cgroup leaves for an arena."""
    from moestream.authoring.make_model import make_model

    return make_model(tmp_path_factory.mktemp("wide") / "wide.gguf", layers=2, experts=80, hidden=256, expert_ff=1024)


def _eps(tmp_path: Path) -> list[str]:
    return ["--endpoint", f"ipc://{tmp_path}/a.sock", "--status-endpoint", f"ipc://{tmp_path}/s.sock"]


@pytest.mark.parametrize("sizing", [["--arena-bytes", "256MiB"], ["--memory", "25%"], ["--memory", "1GiB"]])
def test_an_arena_bigger_than_the_cgroup_is_refused_in_one_line(cgroup, wide_model, tmp_path, sizing):
    p = _in_cgroup(cgroup, ["--model", str(wide_model), *sizing, *_eps(tmp_path)])
    try:
        out, err = p.communicate(timeout=60)
    finally:  # a daemon that started instead of refusing must not outlive the test
        if p.poll() is None:
            p.terminate()
            p.communicate(timeout=30)
    lines = err.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, err
    if sizing[1] == "25%":  # a quarter of the cgroup's 128 MiB, not of the host's RAM
        assert "memory 32MiB is too small" in lines[0], lines
    else:
        assert "does not fit in the memory limit 128MiB" in lines[0] and "memory.limit" in lines[0] or \
            "memory.max" in lines[0], lines
    assert not _shm_of(p.pid) and not (tmp_path / "a.sock").exists()


def test_default_sizing_fits_itself_to_the_cgroup(cgroup, wide_model, tmp_path):
    p = _in_cgroup(cgroup, ["--model", str(wide_model), *_eps(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "s.sock").exists():
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "daemon never came up"
            time.sleep(0.05)
        s = get_status(f"ipc://{tmp_path}/s.sock")
        assert 0 < s["arena"]["n_slots"] < 160 and s["arena"]["arena_bytes"] < LIMIT
        os.kill(p.pid, signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err
    assert "arena sized to fit the memory limit 128MiB" in err, err
    assert not _shm_of(p.pid)
