"""Counters the kernel keeps per process, read from /proc (no torch; used by both processes'
benchmarks and the daemon's status)."""

from __future__ import annotations

import os


def proc_read_bytes(pid: int | str = "self") -> int:
    """Bytes a process caused to be fetched from storage (`/proc/PID/io` read_bytes, mmap faults
    included), -1 if unknown (no such process, or no permission)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def proc_cpu_s(pid: int | str = "self") -> float | None:
    """CPU seconds a process has used, all its threads, user and system (`/proc/PID/stat` utime +
    stime); None if unknown (no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def clear_referenced(pid: int | str = "self") -> bool:
    """Clear the kernel's referenced bits of a process's pages (`/proc/PID/clear_refs`), so that
    `referenced_file_bytes` counts the pages it touches from now on; False if not allowed or gone."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("1")
        return True
    except OSError:
        return False


_SHARED_MEMORY = ("/dev/shm/", "/SYSV", "/memfd:")  # not the process's own: an arena is counted apart


def referenced_file_bytes(pid: int | str = "self") -> int | None:
    """Bytes of file-backed pages (libraries, mapped files; shared memory left out) the process
    touched since `clear_referenced`: its working set of them. Clean file pages it did not touch
    are what a memory cgroup reclaims first, so they are not memory it needs. Per mapping,
    Referenced less Anonymous (a mapping's private copies count as touched: an overestimate of at
    most those). None if unknown (gone, no permission)."""
    total, path, ref, anon = 0, None, 0, 0
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    total += _file_ref(path, ref, anon)
                    fields = line.split()
                    path, ref, anon = (fields[5] if len(fields) > 5 else None), 0, 0
                elif line.startswith("Referenced:"):
                    ref = int(line.split()[1])
                elif line.startswith("Anonymous:"):
                    anon = int(line.split()[1])
    except OSError:
        return None
    return (total + _file_ref(path, ref, anon)) << 10


def _file_ref(path: str | None, ref_kb: int, anon_kb: int) -> int:
    if path is None or path.startswith("[") or path.startswith(_SHARED_MEMORY):
        return 0
    return max(0, ref_kb - anon_kb)


def available_cpus(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """CPUs this process may keep busy: its CPU affinity, capped by its cgroup's CPU quota
    (rounded up). A container given 2 CPUs on a 64-core host still sees 64 in its affinity, and
    64 compute threads on a 2-CPU quota spend most of their time throttled."""
    import math
    import os

    n = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota(root, proc_cgroup)
    return max(1, min(n, math.ceil(quota))) if quota is not None else n


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The tightest CPU quota (in CPUs) on this process's cgroup and its ancestors: cgroup v2
    `cpu.max`, or v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`; None where there is none."""
    from pathlib import Path

    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: "0::/path"
            base, read = Path(root), _v2_quota
        elif "cpu" in controllers.split(","):  # v1: "N:cpu,cpuacct:/path"
            base, read = Path(root) / controllers, _v1_quota
        else:
            continue
        here = base / path.lstrip("/")
        for d in (here, *here.parents):
            if not d.is_relative_to(base):
                break
            q = read(d)
            if q is not None:
                quotas.append(q)
    return min(quotas) if quotas else None


def _v2_quota(d) -> float | None:
    try:
        quota, period = (d / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(d) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
