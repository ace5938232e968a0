"""Leak detection for the test session: shared-memory segments and processes left behind.

Every process this session starts inherits `SESSION_VAR` in its environment, so a daemon
orphaned by a dead grandchild is still recognised as ours (and another session's is not).
A plain module (not conftest) so tests can import it by name.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "moestream"
SESSION_VAR = "MOESTREAM_TEST_SESSION"
os.environ.setdefault(SESSION_VAR, uuid.uuid4().hex)
_MARK = f"{SESSION_VAR}={os.environ[SESSION_VAR]}".encode()
# Helper processes Python itself keeps for the interpreter's lifetime: not leaks.
_BENIGN = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def shm_entries() -> set[str]:
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIX)}


def _proc_stat(pid: str) -> list[str]:
    return (Path("/proc") / pid / "stat").read_text().rsplit(")", 1)[1].split()  # state ppid ...


def _session_pids() -> set[str]:
    """Processes started by this session (they carry its mark), this one included."""
    out = {str(os.getpid())}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if _MARK in (entry / "environ").read_bytes().split(b"\0"):
                    out.add(entry.name)
            except OSError:
                continue
    return out


def _mapped_elsewhere(names: set[str]) -> set[str]:
    """Segments some process outside this session maps: another session's, not our leak."""
    ours, found = _session_pids(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or entry.name in ours:
            continue
        try:
            maps = (entry / "maps").read_text()
        except OSError:
            continue
        found |= {n for n in names if f"/dev/shm/{n}" in maps}
    return found


def leaked_shm(before: set[str]) -> list[str]:
    """Segments created since `before` that outlive a short grace and no other session maps."""
    new = shm_entries() - before
    if new:
        time.sleep(0.5)  # a concurrent session's transient segment is usually gone by now
        new &= shm_entries()
        new -= _mapped_elsewhere(new)
    return sorted(new)


def session_processes() -> dict[int, str]:
    """Processes of this session other than this one (children, and orphans of dead children),
    zombies included (unwaited is leaked too): pid -> command line."""
    out = {}
    for pid in _session_pids() - {str(os.getpid())}:
        try:
            state = _proc_stat(pid)[0]
            cmd = (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # exited while we looked
        if not any(b in cmd for b in _BENIGN):
            out[int(pid)] = f"{cmd or '?'} [{state}]"
    return out
