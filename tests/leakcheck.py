"""Leak detection for the test session: shared-memory segments and child processes left behind.

A plain module (not conftest) so tests can import it by name without picking up another
directory's conftest.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "moestream"
# Helper processes Python itself keeps for the interpreter's lifetime: not leaks.
_BENIGN_CHILDREN = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def shm_entries() -> set[str]:
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIX)}


def _proc_stat(pid: str) -> list[str]:
    return (Path("/proc") / pid / "stat").read_text().rsplit(")", 1)[1].split()  # state ppid ...


def _our_tree() -> set[str]:
    """This process and its descendants, as /proc pid strings."""
    parent: dict[str, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[entry.name] = _proc_stat(entry.name)[1]
            except OSError:
                continue
    tree, grew = {str(os.getpid())}, True
    while grew:
        new = {pid for pid, pp in parent.items() if pp in tree and pid not in tree}
        tree |= new
        grew = bool(new)
    return tree


def _mapped_elsewhere(names: set[str]) -> set[str]:
    """Segments some process outside our tree maps: another test session's, not our leak."""
    ours, found = _our_tree(), set()
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


def child_processes() -> dict[int, str]:
    """Children of this process, zombies included (unwaited is leaked too): pid -> command line."""
    me, out = os.getpid(), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _proc_stat(entry.name)
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # exited while we looked
        if int(fields[1]) == me and not any(b in cmd for b in _BENIGN_CHILDREN):
            out[int(entry.name)] = f"{cmd or '?'} [{fields[0]}]"
    return out
