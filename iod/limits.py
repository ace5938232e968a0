"""What memory the daemon may really use, and giving freed heap back to the system.

A memory cgroup (a systemd unit's `MemoryMax=`, a container's limit) caps the daemon below the
host's RAM, and the arena's pages (shared memory the daemon touches) are charged to it: an
arena that does not fit gets the daemon OOM-killed at start, with nothing on stderr. So the
limit is read before the arena exists, from the files the kernel keeps for this process:

| hierarchy | where this process sits (/proc/self/cgroup) | the limit file          | "no limit"            |
|-----------|---------------------------------------------|-------------------------|-----------------------|
| v2        | `0::/PATH`                                  | `PATH/memory.max`       | `max`                 |
| v1        | `N:...memory...:/PATH`                      | `PATH/memory.limit_in_bytes` | >= 2**62 (page-rounded LONG_MAX) |

each under the hierarchy's mount point (/proc/self/mountinfo); every ancestor's limit applies
too, so the smallest one on the way to the root counts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from pathlib import Path

from moestream.common.units import physical_memory

_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int  # what this process may use: the smallest cgroup limit, or physical memory
    source: str  # "physical memory" or the limit file that set it

    @property
    def from_cgroup(self) -> bool:
        return self.source != "physical memory"


def memory_limit(proc: Path = Path("/proc/self")) -> MemoryLimit:
    """The effective memory limit of this process (never more than physical memory)."""
    best = MemoryLimit(physical_memory(), "physical memory")
    for path in _limit_files(proc):
        value = _read_limit(path)
        if value is not None and value < best.bytes:
            best = MemoryLimit(value, str(path))
    return best


def _limit_files(proc: Path) -> list[Path]:
    """Every memory limit file on the way from this process's cgroups to their roots."""
    try:
        groups = (proc / "cgroup").read_text().splitlines()
        mounts = _cgroup_mounts((proc / "mountinfo").read_text())
    except OSError:
        return []
    out = []
    for line in groups:
        hid, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hid == "0" and controllers == "":
            mount, name = mounts.get("cgroup2"), "memory.max"
        elif "memory" in controllers.split(","):
            mount, name = mounts.get("memory"), "memory.limit_in_bytes"
        else:
            continue
        if mount is None:
            continue
        for root, rel in mount:  # a bind-mounted sub-tree: strip the part above its root
            if path == root or path.startswith(root.rstrip("/") + "/") or root == "/":
                out += _ancestors(Path(rel), path[len(root.rstrip("/")):], name)
                break
    return out


def _ancestors(mount: Path, path: str, name: str) -> list[Path]:
    parts = [p for p in path.split("/") if p]
    return [mount.joinpath(*parts[:i], name) for i in range(len(parts), -1, -1)]


def _cgroup_mounts(mountinfo: str) -> dict[str, list[tuple[str, str]]]:
    """{"cgroup2": [(root, mount point)], "memory": [...]} from /proc/self/mountinfo."""
    out: dict[str, list[tuple[str, str]]] = {}
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, point = _unescape(fields[3]), _unescape(fields[4])
        if tail[0] == "cgroup2":
            out.setdefault("cgroup2", []).append((root, point))
        elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
            out.setdefault("memory", []).append((root, point))
    return out


def _unescape(text: str) -> str:
    return text.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _V1_UNLIMITED else value


# -- giving memory back ----------------------------------------------------------------------
_libc = None


def trim_heap() -> bool:
    """Return the heap's free pages to the system (glibc keeps what a burst of big messages left
    behind, in every thread's arena, libzmq's I/O thread's too); False where there is no glibc."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is None:
        return False
    trim(0)
    return True


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process in bytes (0 if unknown)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def rss_anon() -> int:
    """This process's anonymous resident memory in bytes (the heap; not the arena's shared pages)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 0
