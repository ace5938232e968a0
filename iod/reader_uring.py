"""`uring` readers: an io_uring ring keeps up to `depth` reads in flight.

Two drivers of the same ring work (`UringBase`):
- `UringReader`: a thread owns the ring. New work wakes it through an eventfd whose read is
  itself an io_uring request, so the thread only ever blocks in `io_uring_enter` and a fresh
  `submit` never waits behind a slow read. For callers without an event loop (`bench io`,
  `plan --probe`).
- `LoopUringReader`: the daemon's event loop owns it. `submit` hands the reads to the kernel at
  once, from the caller's thread, and the ring signals completions on an eventfd the loop
  watches (`start`), so `on_done` runs on the loop's thread: per expert read no ring thread is
  woken and no callback crosses back to the loop. On a 2-vCPU VM the daemon's CPU an expert read
  fell from 0.46-0.48 to 0.40-0.42 ms, and tok/s rose 2-5 % in capped runs (docs/BENCHMARKS.md).

Registered buffers (`register`): the daemon pins its arena with the ring once, and a read into
it is a READ_FIXED of one chunk (no coalescing then: each read names one buffer), so the kernel
does not pin the destination's pages again on every read. With O_DIRECT that pinning was most
of the kernel's CPU a read: 0.054-0.082 ms of system time a 3.4 MB read against 0.009-0.018
with READ_FIXED (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import bisect
import ctypes
import errno
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from .readers import ReadError, ReaderBase, Run, chunk_errors
from .uring_ring import (MAX_FIXED_BYTES, OP_READ_FIXED, OP_READV, Iovec, Ring, RingUnavailable, register_buffers,
                         register_eventfd)

WAKE = 0  # user_data of the eventfd read


class UringUnavailable(RuntimeError):
    """io_uring cannot be used here; the message says why."""


@dataclass
class _Flight:
    """A coalesced run in the kernel's hands: its buffers stay referenced until it completes."""

    run: Run
    addrs: list[int]
    anchors: list[ctypes.c_char]
    got: int = 0
    iov: ctypes.Array = field(default=None)  # type: ignore[assignment]

    @property
    def total(self) -> int:
        return sum(c.length for c in self.run)


class UringBase(ReaderBase):
    """The ring and the reads in its hands: taking runs from the queue, one READV each (again for
    what a short read left), completing their chunks. A driver (below) decides which thread does it."""

    name = "uring"

    def __init__(self, paths: str | Sequence[str], depth: int, direct: bool, ahead_depth: int | None):
        super().__init__(paths, depth, direct, ahead_depth)
        try:
            self.ring = Ring(_pow2(depth + 1))  # +1: the threaded driver's wake-up read
        except RingUnavailable as e:
            self._close_files()
            raise UringUnavailable(str(e)) from None
        self.efd = os.eventfd(0, os.EFD_CLOEXEC)
        self._flights: dict[int, _Flight] = {}
        self._next_id = WAKE + 1
        self._fixed_starts: list[int] = []  # registered buffer i: [starts[i], ends[i]), by address
        self._fixed_ends: list[int] = []
        self._fixed_anchors: list[ctypes.c_char] = []

    @property
    def registered(self) -> bool:
        return bool(self._fixed_starts)

    def register(self, pieces: Sequence[memoryview]) -> str:
        """Pin `pieces` (writable, each at most 1 GiB, before any read) as the ring's registered
        buffers: reads into them go as READ_FIXED from now on. Returns "" or why not (reads then
        go on as READVs)."""
        if self.registered or self._flights or self._stats["ops"]:
            raise RuntimeError("register: buffers are registered once, before the first read")
        big = [len(b) for b in pieces if len(b) > MAX_FIXED_BYTES]
        if big:
            return f"no registered buffers: a piece of {big[0]} bytes is over 1 GiB"
        if not pieces:
            return "no registered buffers: none given"
        anchors = [ctypes.c_char.from_buffer(b) for b in pieces]
        regions = sorted((ctypes.addressof(a), len(b)) for a, b in zip(anchors, pieces))
        try:
            register_buffers(self.ring, regions)
        except OSError as e:
            hint = ""
            if e.errno == errno.ENOMEM:
                hint = " (raise the locked-memory limit: LimitMEMLOCK= in the unit, ulimit -l)"
            return f"registered buffers unavailable: {e.strerror}{hint}; reading with READV"
        self._fixed_anchors = anchors
        self._fixed_starts, self._fixed_ends = [a for a, _ in regions], [a + n for a, n in regions]
        self.queue.max_iovecs = 1  # a READ_FIXED names one buffer
        return ""

    def _fixed_index(self, addr: int, length: int) -> int:
        """The registered buffer holding [addr, addr + length), or -1."""
        i = bisect.bisect_right(self._fixed_starts, addr) - 1
        return i if i >= 0 and addr + length <= self._fixed_ends[i] else -1

    def _probe_read(self, fd: int) -> None:
        """One 8-byte READV of the eventfd `fd` (holding a count), waited for: proves READV
        completes here before anything relies on it."""
        buf = ctypes.create_string_buffer(8)
        iov = Iovec(ctypes.addressof(buf), 8)
        self.ring.prep(OP_READV, fd, ctypes.addressof(iov), 1, 0, WAKE)
        self.ring.submit_and_wait(1)
        done = self.ring.reap()
        if done != [(WAKE, 8)]:
            raise OSError(5, f"io_uring probe read returned {done!r}, expected [(0, 8)]")

    def _fill(self) -> None:
        while len(self._flights) < self.depth and self.ring.free_sqes() > 0:
            run = self.queue.take(block=False)
            if run is None:
                return
            # Every chunk of a merged run is read, even one whose batch already failed elsewhere:
            # dropping it would leave a gap in the vectored read.
            try:
                anchors = [ctypes.c_char.from_buffer(c.dest) for c in run]
            except (TypeError, ValueError) as e:  # read-only or odd buffer: this run fails, the ring goes on
                self._finish(_Flight(run, [], []), ReadError(22, f"destination buffer not writable: {e}"))
                continue
            self._issue(_Flight(run, [ctypes.addressof(a) for a in anchors], anchors))

    def _issue(self, f: _Flight) -> None:
        """Queue the READV for whatever part of the run is still missing."""
        iovs, skip = [], f.got
        for c, addr in zip(f.run, f.addrs):
            if skip >= c.length:
                skip -= c.length
                continue
            iovs.append((addr + skip, c.length - skip))
            skip = 0
        uid, self._next_id = self._next_id, self._next_id + 1
        self._flights[uid] = f
        fd, at = self.fds[f.run[0].file], f.run[0].offset + f.got
        buf = self._fixed_index(*iovs[0]) if len(iovs) == 1 and self.registered else -1
        if buf >= 0:
            self.ring.prep(OP_READ_FIXED, fd, iovs[0][0], iovs[0][1], at, uid, buf)
        else:
            f.iov = (Iovec * len(iovs))(*iovs)
            self.ring.prep(OP_READV, fd, ctypes.addressof(f.iov), len(iovs), at, uid)
        with self._lock:
            self._stats["preadv_calls"] += 1
            self._stats["fixed_reads"] += buf >= 0

    def _complete(self, uid: int, res: int) -> None:
        f = self._flights.pop(uid)
        base, file = f.run[0].offset, f.run[0].file
        if res < 0:
            err = ReadError(-res, f"reading bytes [{base}, {base + f.total}) of {self.paths[file]}: {os.strerror(-res)}")
            return self._finish(f, err)
        f.got += res
        if res > 0 and f.got < f.total and base + f.got < self.sizes[file]:
            return self._issue(f)  # short read inside the file: read the rest
        self._finish(f, chunk_errors(f.run, f.got, self.paths[file]))

    def _finish(self, f: _Flight, error: BaseException | None | list) -> None:
        """Complete the run's chunks with one error for all, or one per chunk (a list)."""
        errors = error if isinstance(error, list) else [error] * len(f.run)
        f.anchors.clear()
        self._finish_run(f.run, errors)

    def _fail_flights(self, e: BaseException) -> None:
        """The ring broke: fail everything rather than hang the callers."""
        import logging

        logging.getLogger("moestream.iod").exception("io_uring reader failed")
        err = ReadError(5, f"io_uring reader failed: {e}")
        for f in list(self._flights.values()):
            self._finish(f, err)  # buffers may still be written by the kernel until teardown
        self._flights.clear()
        for c in self.queue.close():
            c.batch.finish(1, err)

    def _teardown(self) -> None:
        self.ring.close()  # (unpins the registered buffers)
        self._fixed_anchors, self._fixed_starts, self._fixed_ends = [], [], []
        self._close_files()
        if self.efd >= 0:
            os.close(self.efd)
        self.efd = -1


class UringReader(UringBase):
    """The ring driven by a thread of its own (module docstring)."""

    def __init__(self, paths: str | Sequence[str], *, depth: int = 32, direct: bool = False, ahead_depth: int | None = None):
        super().__init__(paths, depth, direct, ahead_depth)
        self._wake_buf = ctypes.create_string_buffer(8)
        self._wake_iov = Iovec(ctypes.addressof(self._wake_buf), 8)
        self._wake_armed = False
        self._wake_pending = False  # a wake written and not yet reaped (`_wake`)
        self._probe()
        self._thread = threading.Thread(target=self._loop, name="iod-uring", daemon=True)
        self._thread.start()

    def _probe(self) -> None:
        """The wake read, fired once."""
        try:
            os.eventfd_write(self.efd, 1)
            self._probe_read(self.efd)
        except OSError as e:
            self._teardown()
            raise UringUnavailable(f"io_uring read failed: {e.strerror}") from None

    def _wake(self) -> None:
        """The ring thread sleeps in io_uring_enter on the wake read. One wake in flight is enough:
        the thread takes everything queued once it reaps it, so submits meanwhile skip the write
        (a syscall, ~30 us here, and a wake-up of the ring thread per expert otherwise)."""
        if self._wake_pending:
            return
        self._wake_pending = True
        os.eventfd_write(self.efd, 1)

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001
            self._fail_flights(e)

    def _run(self) -> None:
        self._arm_wake()
        while True:
            self._fill()
            if self.queue.closed and not self._flights and not self._wake_armed:
                return
            self.ring.submit_and_wait(1)
            for user_data, res in self.ring.reap():
                if user_data == WAKE:
                    self._wake_armed = self._wake_pending = False  # (before the next _fill takes the queue)
                    if not self.queue.closed:
                        self._arm_wake()
                else:
                    self._complete(user_data, res)

    def _arm_wake(self) -> None:
        self.ring.prep(OP_READV, self.efd, ctypes.addressof(self._wake_iov), 1, 0, WAKE)
        self._wake_armed = True

    def close(self) -> None:
        """Let in-flight reads finish, fail what never started, release the ring and files."""
        if self.efd < 0:
            return
        left = self.queue.close()
        os.eventfd_write(self.efd, 1)
        self._thread.join()
        self._fail_unstarted(left)
        self._teardown()


class LoopUringReader(UringBase):
    """The ring driven by an asyncio loop (module docstring): `submit` and `promote` issue reads
    at once from the caller's thread, which must be the loop's once `start` ran; completions are
    reaped on the loop, which calls `on_done` there. Before `start` nothing is reaped."""

    def __init__(self, paths: str | Sequence[str], *, depth: int = 32, direct: bool = False, ahead_depth: int | None = None):
        super().__init__(paths, depth, direct, ahead_depth)
        self._event_loop: asyncio.AbstractEventLoop | None = None
        try:
            os.set_blocking(self.efd, False)
            register_eventfd(self.ring, self.efd)  # the kernel counts every completion on efd
            self._probe()
        except OSError as e:
            self._teardown()
            raise UringUnavailable(f"io_uring completion eventfd: {e.strerror}") from None

    def _probe(self) -> None:
        """A read of another eventfd: READV completes here, and its completion signals efd."""
        fd = os.eventfd(1, os.EFD_CLOEXEC)
        try:
            self._probe_read(fd)
        finally:
            os.close(fd)
        os.eventfd_read(self.efd)  # (the probe's signal; BlockingIOError if none came)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Reap completions on `loop` from now on."""
        self._event_loop = loop
        loop.add_reader(self.efd, self.poll)

    def _wake(self) -> None:
        """New work: hand what may start to the kernel now."""
        self._pump()

    def _pump(self) -> None:
        try:
            self._fill()
            if self.ring.pending():
                self.ring.submit_and_wait(0)
        except OSError as e:
            self._fail_flights(e)

    def poll(self) -> None:
        """The loop's callback: the ring signalled completions. Reap them (their `on_done`s run
        here), then start what their places in flight let start."""
        try:
            os.eventfd_read(self.efd)
        except BlockingIOError:  # (another poll reaped them already)
            pass
        for user_data, res in self.ring.reap():
            self._complete(user_data, res)
        self._pump()

    def close(self) -> None:
        """Let in-flight reads finish (waiting here: the kernel writes into their buffers until
        then), fail what never started, release the ring and files."""
        if self.efd < 0:
            return
        left = self.queue.close()
        if self._event_loop is not None and not self._event_loop.is_closed():
            self._event_loop.remove_reader(self.efd)
        try:
            while self._flights:
                self.ring.submit_and_wait(1)  # (a short read's rest goes in with the wait)
                for user_data, res in self.ring.reap():
                    self._complete(user_data, res)
        except OSError as e:
            self._fail_flights(e)
        self._fail_unstarted(left)
        self._teardown()


def _pow2(n: int) -> int:
    return 1 << (max(n, 2) - 1).bit_length()
