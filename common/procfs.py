"""Counters the kernel keeps per process, read from /proc (no torch; used by both processes'
benchmarks and the daemon's status)."""

from __future__ import annotations


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
