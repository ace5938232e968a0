"""limits.memory_limit on the files the kernel writes, for both cgroup hierarchies (the real
daemon-in-a-cgroup test runs on whichever this host has: test_cgroup_memory.py)."""

from __future__ import annotations

from pathlib import Path

from moestream.common.units import physical_memory
from moestream.iod.limits import memory_limit

V2_MOUNTINFO = "30 23 0:26 / {mnt} rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTINFO = ("35 25 0:30 / {mnt} rw,nosuid,nodev,noexec,relatime shared:13 - cgroup cgroup rw,memory\n"
                "36 25 0:31 / {other} rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n")


def _proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return proc


def test_v2_takes_the_smallest_limit_on_the_way_up(tmp_path):
    mnt = tmp_path / "cg2"
    leaf = mnt / "system.slice" / "moestream-iod.service"
    leaf.mkdir(parents=True)
    (leaf / "memory.max").write_text("max\n")  # the unit itself: unlimited
    (mnt / "system.slice" / "memory.max").write_text(f"{256 << 20}\n")  # its slice: 256 MiB
    proc = _proc(tmp_path, "0::/system.slice/moestream-iod.service\n", V2_MOUNTINFO.format(mnt=mnt))
    got = memory_limit(proc)
    assert got.bytes == 256 << 20 and got.source == str(mnt / "system.slice" / "memory.max") and got.from_cgroup


def test_v1_memory_controller_and_unlimited_means_physical(tmp_path):
    mnt, other = tmp_path / "memory", tmp_path / "cpu"
    (mnt / "docker" / "abc").mkdir(parents=True)
    (mnt / "docker" / "abc" / "memory.limit_in_bytes").write_text(f"{128 << 20}\n")
    proc = _proc(tmp_path, "5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n",
                 V1_MOUNTINFO.format(mnt=mnt, other=other))
    assert memory_limit(proc).bytes == 128 << 20
    (mnt / "docker" / "abc" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    got = memory_limit(proc)
    assert got.bytes == physical_memory() and not got.from_cgroup


def test_no_cgroup_files_means_physical_memory(tmp_path):
    assert memory_limit(tmp_path / "nothing").bytes == physical_memory()
