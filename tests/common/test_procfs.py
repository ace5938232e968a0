"""CPU quota discovery from cgroup files (v2 and v1), on a tree written here the way the kernel lays it
out; a process's CPU time from /proc."""

from __future__ import annotations

import os
from pathlib import Path

from moestream.common.procfs import (available_cpus, cgroup_cpu_quota, clear_referenced, proc_cpu_s,
                                     referenced_file_bytes)


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_quota_is_the_tightest_on_the_path(tmp_path):
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    _write(proc, "0::/system.slice/box.scope\n")
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "system.slice" / "cpu.max", "300000 100000\n")  # 3 CPUs on the parent
    _write(root / "system.slice" / "box.scope" / "cpu.max", "150000 100000\n")  # 1.5 on the container
    assert cgroup_cpu_quota(str(root), str(proc)) == 1.5
    assert available_cpus(str(root), str(proc)) == min(2, len(os.sched_getaffinity(0)))  # 1.5 rounds up


def test_v1_quota_and_no_quota(tmp_path):
    root, proc = tmp_path / "cg", tmp_path / "cgroup"
    _write(proc, "4:memory:/x\n2:cpu,cpuacct:/docker/abc\n")
    _write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "100000\n")
    _write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(str(root), str(proc)) == 1.0 and available_cpus(str(root), str(proc)) == 1
    _write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "-1\n")  # unlimited
    assert cgroup_cpu_quota(str(root), str(proc)) is None
    assert available_cpus(str(root), str(proc)) == len(os.sched_getaffinity(0))
    assert cgroup_cpu_quota(str(root), str(tmp_path / "absent")) is None


def test_cpu_seconds_grow_with_work_and_a_gone_process_has_none():
    before = proc_cpu_s()
    t0 = os.times()
    while os.times().user + os.times().system - t0.user - t0.system < 0.2:  # burn 0.2 s of CPU
        sum(range(10_000))
    after = proc_cpu_s(os.getpid())
    assert before is not None and after - before >= 0.15  # (clock ticks of 10 ms)
    assert proc_cpu_s(2 ** 22 + 12345) is None  # above any pid_max


_REFERENCED = """
import mmap, sys
from moestream.common.procfs import clear_referenced, referenced_file_bytes
size, maps = 16 << 20, []
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
assert clear_referenced()
before = referenced_file_bytes()
for m in maps:
    sum(m[i] for i in range(0, size, 4096))
print(referenced_file_bytes() - before)
"""


def test_file_pages_referenced_since_a_clear_and_shared_memory_left_out(tmp_path):
    """A process's file pages touched after clear_refs: a mapped file read after the clear counts,
    the same bytes in shared memory (/dev/shm) do not; a gone process has no figure. (In a process
    of its own: in pytest's, another test's leftover thread could touch library pages meanwhile.)"""
    import subprocess
    import sys

    size = 16 << 20
    paths = [tmp_path / "f.bin", Path("/dev/shm") / f"moestream-test-{os.getpid()}"]
    try:
        for path in paths:
            path.write_bytes(b"\1" * size)
        out = subprocess.run([sys.executable, "-c", _REFERENCED, *map(str, paths)], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        grew = int(out.stdout)
        assert size <= grew < 2 * size, grew  # the file's 16 MiB, not the shared memory's too
    finally:
        paths[1].unlink(missing_ok=True)
    assert referenced_file_bytes(2 ** 22 + 12345) is None and clear_referenced(2 ** 22 + 12345) is False
