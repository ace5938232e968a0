"""What the host says about disk reads and memory, for `moestream bench capped`: the page cache
(drop it, evict one file), the block device's and each process's read counters, a process's own
memory, a sampler that watches them during a run.

Standard library only: the llama.cpp child process reads its counters with these too.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ....common.procfs import clear_referenced, proc_cpu_s, proc_read_bytes as read_bytes_of, referenced_file_bytes
from ...footprint import own_memory

SAMPLE_EVERY_S = 0.005
ASK_EVERY_S = 0.02
WORKING_SET_EVERY_S = 0.5  # a decoder's smaps (~1,000 mappings) takes ~10 ms to read


def read_or_empty(path: str | Path) -> str:
    """A small file's text, '' when it cannot be read (a process or cgroup that is gone)."""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def last_line(path: str | Path) -> str:
    """The last non-blank line of a log, for one-line error messages."""
    lines = [ln for ln in read_or_empty(path).splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


# -- the page cache --------------------------------------------------------------------------
def drop_caches() -> str | None:
    """Drop the page cache host-wide (root); None when done, else why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as e:
        return e.strerror or str(e)
    return None


def evict_file(path: str | Path) -> None:
    """Drop one file's clean pages (no root needed): the fallback when drop_caches is refused."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- a quiet machine -------------------------------------------------------------------------
def wait_quiet(max_load: float | None, timeout_s: float = 300.0, poll_s: float = 2.0) -> float:
    """Wait (at most `timeout_s`) for the 1-minute load average to fall below `max_load` (None:
    do not wait); returns the load at the start of the run, to record beside its figures."""
    deadline = time.monotonic() + timeout_s
    while max_load is not None and os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(poll_s)
    return os.getloadavg()[0]


# -- counters --------------------------------------------------------------------------------
def block_device(path: str | Path) -> tuple[str, Path] | None:
    """(name, stat file) of the block device (partition or disk) holding `path`, or None."""
    dev = os.stat(path).st_dev
    sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    stat = sys_dev / "stat"
    if not stat.exists():
        return None
    return sys_dev.resolve().name, stat


def read_ahead_file(stat: Path | None) -> Path | None:
    """The block device's `queue/read_ahead_kb` (a partition's is its disk's), from its stat file."""
    if stat is None:
        return None
    for queue in (stat.parent / "queue", stat.parent.resolve().parent / "queue"):
        if (queue / "read_ahead_kb").exists():
            return queue / "read_ahead_kb"
    return None


class ReadAhead:
    """Sets a block device's readahead for a peer's run and restores it after (`with`); a
    device (or a user) that refuses is said once in `why` and the run keeps the current one.

    llama.cpp's mmap page faults read what the readahead says: this VM's default of 8 MB made
    them read 12-16x the bytes needed, 128 KB ~1.2x an ideal LRU's misses."""

    def __init__(self, path: Path | None, kb: int | None):
        self.path, self.kb, self.why = path, kb, None
        self.old = int(read_or_empty(path).strip() or 0) if path else None

    def __enter__(self) -> "ReadAhead":
        if self.kb is not None and self.path is not None and self.kb != self.old:
            try:
                self.path.write_text(str(self.kb))
            except OSError as e:
                self.why = f"could not set {self.path} to {self.kb}: {e.strerror}"
        return self

    def current(self) -> int | None:
        return int(read_or_empty(self.path).strip() or 0) if self.path else None

    def __exit__(self, *exc: object) -> None:
        if self.path is not None and self.old is not None and self.current() != self.old:
            self.path.write_text(str(self.old))


def block_read_bytes(stat: Path | str | None) -> int | None:
    """Bytes read from a block device so far (its stat file's sectors read x 512)."""
    if stat is None:
        return None
    fields = read_or_empty(stat).split()
    return int(fields[2]) * 512 if len(fields) > 2 else None


def proc_read_bytes(pid: int | str) -> int | None:
    """`common.procfs.proc_read_bytes`, None when the process is gone."""
    n = read_bytes_of(pid)
    return None if n < 0 else n


def proc_mem_parts(pid: int) -> tuple[int, int]:
    """(RssAnon, RssFile) of a process in bytes (its shared memory, e.g. the arena, left out);
    (0, 0) once it is gone."""
    try:
        m = own_memory(pid)
    except OSError:
        return 0, 0
    return m.anon, m.file


def proc_mem(pid: int) -> int:
    """RssAnon + RssFile of a process (its shared memory, e.g. the arena, left out), bytes."""
    return sum(proc_mem_parts(pid))


class Sampler:
    """Every 5 ms: the block device's read bytes, each watched process's read_bytes, and each
    one's peak memory (`proc_mem`). A thread of its own; `stop()` takes a last sample.

    `started()`, if given, is asked every 20 ms until it first says True (the daemon has served
    a request): `start` is then the time of the last False answer, before any expert traffic.
    (The daemon's own /proc/PID/io cannot tell: io_uring reads from the page cache count in
    neither rchar nor read_bytes.)

    With `working_set`, the processes' referenced bits are cleared at that start and their file
    pages touched since are read every WORKING_SET_EVERY_S (`file_used`): what a cap must hold of
    their file-backed memory, where the last RssFile also counts library pages only the load
    touched (libtorch's, the tokenizer's, the GGUF reader's: ~70 of a decoder's ~76 MiB). It falls
    a little short: under the cap the decoder re-reads 0.2-0.4 MB a token of its file pages (a
    margin for them cost more arena slots than it saved: docs/BENCHMARKS.md, 2026-12-06 evening);
    `own reads in the decode` in the report shows them."""

    def __init__(self, block_stat: Path | None, pids: dict[str, int],
                 started: Callable[[], bool] | None = None, working_set: bool = False):
        self.block_stat, self.pids, self.started = block_stat, dict(pids), started
        # (time, block device bytes, {name: read_bytes}) per sample
        self.samples: list[tuple[float, int | None, dict[str, int | None]]] = []
        self.cpu: list[dict[str, float | None]] = []  # {name: CPU seconds used} per sample
        self.peak: dict[str, int] = dict.fromkeys(pids, 0)
        # what a cap must hold: peak RssAnon (not reclaimable without swap) + the file pages used
        # since the start (`working_set`), else the last RssFile seen (file pages still mapped at
        # the end; cold ones, e.g. a compiler's, are reclaimable)
        self.anon_peak: dict[str, int] = dict.fromkeys(pids, 0)
        self.file_last: dict[str, int] = dict.fromkeys(pids, 0)
        self.file_used: dict[str, int] = {}  # name -> file bytes touched since the start (working_set)
        self._working_set, self._cleared, self._ws_read = working_set, set(), 0.0
        self.start: float | None = None
        self._asked = time.monotonic()
        self._stop = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="bench-sampler", daemon=True)
        self._thread.start()

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid
        self.peak.setdefault(name, 0)
        self.anon_peak.setdefault(name, 0)
        self.file_last.setdefault(name, 0)

    def _sample(self) -> None:
        pids = list(self.pids.items())
        reads = {name: proc_read_bytes(pid) for name, pid in pids}
        self.samples.append((time.monotonic(), block_read_bytes(self.block_stat), reads))
        self.cpu.append({name: proc_cpu_s(pid) for name, pid in pids})
        for name, pid in pids:
            anon, file = proc_mem_parts(pid)
            self.peak[name] = max(self.peak[name], anon + file)
            if anon or file:  # (0, 0): the process is gone
                self.anon_peak[name] = max(self.anon_peak[name], anon)
                self.file_last[name] = file

    def need(self, name: str) -> int | None:
        """Peak RssAnon + the file pages used since the start (else the last RssFile) of process
        `name` (see above)."""
        if name not in self.anon_peak:
            return None
        return self.anon_peak[name] + self.file_used.get(name, self.file_last[name])

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            self._sample()
            if self.started is not None and self.start is None and time.monotonic() - self._asked >= ASK_EVERY_S:
                self._ask()
            if self._cleared and time.monotonic() - self._ws_read >= WORKING_SET_EVERY_S:
                self._read_working_set()

    def _ask(self) -> None:
        before = time.monotonic()
        if self.started():
            self.start = self._asked
            if self._working_set:
                self._cleared = {name for name, pid in list(self.pids.items()) if clear_referenced(pid)}
                self._ws_read = time.monotonic()
        self._asked = before

    def _read_working_set(self) -> None:
        """Each cleared process's file pages touched so far (the last read before it exits is kept)."""
        self._ws_read = time.monotonic()
        for name in self._cleared:
            used = referenced_file_bytes(self.pids[name])
            if used is not None:
                self.file_used[name] = used

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        if self._cleared:
            self._read_working_set()

    def at(self, t: float) -> int:
        """Index of the first sample at or after time `t` (the last one if none)."""
        for i, s in enumerate(self.samples):
            if s[0] >= t:
                return i
        return len(self.samples) - 1

    def delta(self, i: int, j: int, name: str | None = None) -> int | None:
        """Bytes read between samples i and j: the block device's, or process `name`'s read_bytes
        (its last value seen by then: it may have exited; 0 before it started)."""
        if name is None:
            a, b = self.samples[i][1], self.samples[j][1]
            return None if a is None or b is None else b - a
        rb = self._last(j, name)
        return None if rb is None else rb - (self._last(i, name) or 0)

    def cpu_delta(self, i: int, j: int, name: str) -> float | None:
        """CPU seconds process `name` used between samples i and j (None where either is unknown)."""
        a, b = self.cpu[i].get(name), self.cpu[j].get(name)
        return None if a is None or b is None else b - a

    def _last(self, i: int, name: str) -> int | None:
        for _, _, reads in reversed(self.samples[: i + 1]):
            if reads.get(name) is not None:
                return reads[name]
        return None


def disk_figures(block: dict[str, int | None], own: dict[str, int], decode_tokens: int, mode: str) -> dict[str, Any]:
    """Pick the counter and give bytes per decoded token. `block` and `own` are the bytes the
    block device and the side's own processes (/proc/PID/io read_bytes) read per phase (load,
    prefill, decode). `mode` auto: the block device, unless it read more than 10 % + 4 MiB
    beyond the processes' own bytes in the prefill and decode, i.e. other processes read from
    the same disk meanwhile; then the processes' own counters, and the surplus is reported."""
    seen = sum(block[p] or 0 for p in ("prefill", "decode"))
    mine = own["prefill"] + own["decode"]
    noisy = seen > mine * 1.1 + (4 << 20)
    use_block = block["decode"] is not None and (mode == "block" or (mode == "auto" and not noisy))
    chosen = block if use_block else own
    source = "block device" if use_block else "/proc/PID/io"
    if not use_block and block["decode"] is not None and noisy:
        source += " (the block device saw other processes' reads)"

    def per(n: int | None) -> float | None:
        return n / decode_tokens if n is not None and decode_tokens else None

    return {"disk_per_token": per(chosen["decode"]), "disk_source": source,
            "block_per_token": per(block["decode"]), "proc_disk_per_token": per(own["decode"]),
            "other_reads_bytes": seen - mine if block["decode"] is not None else None,
            "load_disk_bytes": chosen["load"], "prefill_disk_bytes": chosen["prefill"]}


# -- the disk's bandwidth --------------------------------------------------------------------
