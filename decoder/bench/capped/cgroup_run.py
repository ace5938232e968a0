"""Running `moestream bench capped`'s processes under a hard memory cap: a fresh memory cgroup
per run (v2 `memory.max` or v1 `memory.limit_in_bytes`, swap off) under this process's own cgroup
or a given one, processes that join it before they exec, and its removal afterwards.

Also the run of one child in such a cgroup: watched by a `Sampler`, its last JSON line parsed,
and a failure told in one line (OOM kills named).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .host_counters import Sampler, last_line, read_or_empty

REMOVE_TIMEOUT_S = 10.0


class CgroupError(Exception):
    """No memory cgroup can be made here (the bench's exit code 2): one clear line."""


@dataclass(frozen=True)
class CgroupParent:
    path: Path
    version: int  # 1 or 2


# -- where the runs' cgroups go --------------------------------------------------------------
def _mounts() -> list[tuple[str, str, str]]:
    lines = read_or_empty("/proc/self/mounts").splitlines()
    return [(f[1], f[2], f[3]) for f in (ln.split() for ln in lines) if len(f) >= 4]


def _own_cgroup(version: int) -> str:
    """This process's cgroup path in the v2 hierarchy or in v1's memory hierarchy."""
    for line in read_or_empty("/proc/self/cgroup").splitlines():
        _, ctrls, path = line.split(":", 2)
        if (version == 2 and ctrls == "") or (version == 1 and "memory" in ctrls.split(",")):
            return path.lstrip("/")
    return ""


def find_cgroup_parent(parent: str | Path | None = None) -> CgroupParent:
    """Where to create the runs' cgroups: `parent` if given (its files tell the version), else
    this process's own cgroup in the v2 hierarchy if it has the memory controller, else in v1's
    memory hierarchy. CgroupError with one clear line otherwise."""
    if parent is not None:
        return _check_parent(Path(parent))
    mounts = _mounts()
    for mnt, fstype, _ in mounts:
        if fstype == "cgroup2" and "memory" in read_or_empty(Path(mnt) / "cgroup.controllers").split():
            return _check_parent(Path(mnt) / _own_cgroup(2))
    for mnt, fstype, opts in mounts:
        if fstype == "cgroup" and "memory" in opts.split(","):
            return _check_parent(Path(mnt) / _own_cgroup(1))
    raise CgroupError("no memory cgroup controller here (neither cgroup v2 with memory nor a v1 memory "
                      "hierarchy is mounted); this bench needs one to cap memory")


def _check_parent(path: Path) -> CgroupParent:
    if (path / "cgroup.controllers").exists():
        if "memory" not in read_or_empty(path / "cgroup.controllers").split():
            raise CgroupError(f"{path}: the memory controller is not available in this cgroup (v2); "
                              "run where it is delegated, or give --cgroup-parent")
        return CgroupParent(path, 2)
    if (path / "memory.limit_in_bytes").exists():
        return CgroupParent(path, 1)
    raise CgroupError(f"{path} is not a memory cgroup (no cgroup.controllers listing memory, no "
                      "memory.limit_in_bytes); give --cgroup-parent a directory of a mounted memory cgroup")


# -- one run's cgroup ------------------------------------------------------------------------
class MemoryCgroup:
    """One child cgroup with a hard memory limit (swap off), for one run; `remove()` kills what is
    left in it and deletes it. Processes join through `wrap(cmd)`: a shell that writes its own pid
    into cgroup.procs and then execs the command, so nothing runs outside the cap."""

    _count = 0

    def __init__(self, parent: CgroupParent, limit: int | None, tag: str):
        MemoryCgroup._count += 1
        self.v = parent.version
        self.path = parent.path / f"moestream-bench-{os.getpid()}-{MemoryCgroup._count}-{tag}"
        if self.v == 2:
            self._enable_memory(parent.path)
        try:
            self.path.mkdir()
        except OSError as e:
            raise CgroupError(f"cannot create a memory cgroup under {parent.path}: {e.strerror} (run as root or in "
                              "a cgroup delegated to you; --cgroup-parent chooses where)") from None
        try:
            self._limit(limit)
        except OSError as e:
            self.remove()
            raise CgroupError(f"cannot set a memory limit on {self.path}: {e.strerror}") from None

    @staticmethod
    def _enable_memory(parent: Path) -> None:
        ctl = parent / "cgroup.subtree_control"
        if "memory" in read_or_empty(ctl).split():
            return
        try:
            ctl.write_text("+memory")
        except OSError as e:
            raise CgroupError(f"cannot enable the memory controller for children of {parent}: {e.strerror} (cgroup "
                              "v2 refuses it in a cgroup that holds processes; give --cgroup-parent an empty, "
                              "delegated cgroup)") from None

    def _limit(self, limit: int | None) -> None:
        if limit is None:
            return
        if self.v == 2:
            (self.path / "memory.max").write_text(str(limit))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
            return
        (self.path / "memory.limit_in_bytes").write_text(str(limit))
        if (self.path / "memory.memsw.limit_in_bytes").exists():  # memory + swap: no swap beyond the cap
            (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit))

    def wrap(self, cmd: Sequence[str]) -> list[str]:
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *cmd]

    def peak(self) -> int | None:
        text = read_or_empty(self.path / ("memory.peak" if self.v == 2 else "memory.max_usage_in_bytes")).strip()
        return int(text) if text.isdigit() else None

    def oom_kills(self) -> int:
        text = read_or_empty(self.path / ("memory.events" if self.v == 2 else "memory.oom_control"))
        m = re.search(r"^oom_kill (\d+)", text, re.MULTILINE)
        return int(m.group(1)) if m else 0

    def pids(self) -> list[int]:
        return [int(p) for p in read_or_empty(self.path / "cgroup.procs").split()]

    def remove(self) -> None:
        deadline = time.monotonic() + REMOVE_TIMEOUT_S
        while self.path.exists():
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    print(f"moestream bench capped: could not remove cgroup {self.path}: {e.strerror}",
                          file=sys.stderr)
                    return
                time.sleep(0.05)


@contextlib.contextmanager
def cgroup(parent: CgroupParent | None, limit: int | None, tag: str) -> Iterator[MemoryCgroup | None]:
    """A fresh cgroup for one run, removed after it; None without a parent (an uncapped run)."""
    if parent is None:
        yield None
        return
    group = MemoryCgroup(parent, limit, tag)
    try:
        yield group
    finally:
        group.remove()


def wrapped(group: MemoryCgroup | None, cmd: Sequence[str]) -> list[str]:
    """`cmd`, joining `group` first where there is one."""
    return group.wrap(cmd) if group is not None else list(cmd)


def usage(group: MemoryCgroup | None) -> dict[str, Any]:
    """The run's peak memory and OOM kills, as its cgroup counted them."""
    return {"peak_memory": group.peak() if group else None, "oom_kills": group.oom_kills() if group else 0}


# -- one child, watched ----------------------------------------------------------------------
def run_watched(cmd: list[str], env: dict[str, str], timeout_s: float, log: Path, sampler: Sampler,
                name: str) -> tuple[int, str]:
    """Run `cmd` to its end while `sampler` watches it as `name`: (exit code, stdout). stderr
    goes to `log`; the sampler takes its last sample when the child is done."""
    try:
        with open(log, "wb") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=env)
            sampler.watch(name, proc.pid)
            try:
                out, _ = proc.communicate(timeout=timeout_s)
            except BaseException:
                proc.kill()
                proc.wait()
                raise
    finally:
        sampler.stop()
    return proc.returncode, out.decode(errors="replace")


def failure(what: str, code: int, log: Path, group: MemoryCgroup | None) -> str:
    """One line on why a child failed: OOM kills in its cgroup, else its log's last line."""
    ooms = group.oom_kills() if group is not None else 0
    why = f"OOM-killed under the cap ({ooms} OOM kill(s) in its cgroup)" if ooms else last_line(log)
    return f"{what} exited with code {code}: {why}"


def last_json(text: str) -> dict:
    """The last line of a child's stdout that is a JSON object (its result)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON object in the output: {text[-200:]!r}")
