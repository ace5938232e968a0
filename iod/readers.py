"""Reader backends: batched reads of exact file ranges straight into arena slots.

Two backends behind one small interface (`Reader`): `threads` (a pool of `os.preadv` workers)
and `uring` (io_uring through raw syscalls, see `reader_uring.py`). Both read through their
own file descriptor, never the model's mmap, opened with `POSIX_FADV_RANDOM` (or `O_DIRECT`)
so kernel readahead does not inflate what the disk reads.

A model split in parts (`NAME-0000k-of-0000n.gguf`) is read through one descriptor per part:
every op names its `file` (an index into the reader's paths), so one blob's ranges may come
from several files in one submit.

Ops submitted together, or pending at the same time, whose ranges in one file touch are coalesced
into one vectored read (one iovec per op), so a layer's worth of adjacent experts costs a
few large reads instead of many small ones. A ring reading into registered buffers (the
daemon's arena, `register`) reads each op on its own instead: a READ_FIXED names one buffer,
and the kernel's block layer can still merge neighbours handed over in one submit.

Each submit is demand (default) or `ahead` (a prefetch). Pending demand chunks are always
taken before prefetch chunks, and prefetch reads may hold at most `ahead_depth` of the
`depth` places in flight, so a demand read never queues behind prefetches: the other places
are left to demand. `promote` turns a submitted prefetch into demand (a `now` request joined it).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from moestream.common.layout import PAGE, ExpertPart, round_up, slot_offsets
from moestream.common.procfs import proc_read_bytes

from .depth_gauge import DepthGauge
from .uring_ring import MAX_FIXED_BYTES

OnDone = Callable[[BaseException | None], None]
BACKENDS = ("auto", "uring", "threads")
MAX_DEPTH = 4096  # reads in flight; far beyond what any device queue uses
MAX_RUN_BYTES = 8 << 20  # a coalesced read stops growing here, so depth still spreads the work
MAX_RUN_IOVECS = 64  # well under IOV_MAX (1024)


class ReadError(OSError):
    """A read could not deliver the bytes asked for (past end of file, I/O error, ...)."""


@dataclass
class ReadOp:
    """Read `length` bytes at file `offset` into `dest` (writable, `len(dest) == length`).

    With O_DIRECT the offset, length and the address of `dest` are 4096-aligned. `required`
    (default: `length`) is how many leading bytes must arrive: an aligned read may run past
    the end of the file, which is fine as long as the bytes wanted are inside it.
    """

    offset: int
    length: int
    dest: memoryview
    required: int | None = None
    file: int = 0  # which of the reader's paths (the part of a split model)

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise ValueError(f"ReadOp: bad range offset={self.offset} length={self.length}")
        if self.file < 0:
            raise ValueError(f"ReadOp: bad file index {self.file}")
        if len(self.dest) != self.length:
            raise ValueError(f"ReadOp: dest has {len(self.dest)} bytes but length={self.length}")
        if self.required is None:
            self.required = self.length
        elif not 0 < self.required <= self.length:
            raise ValueError(f"ReadOp: required={self.required} not in (0, {self.length}]")


class Reader(Protocol):
    name: str  # "uring" | "threads"
    note: str  # why `auto` fell back, "" if it did not
    registered: bool  # destination memory pinned once (`register`)

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...
    def register(self, pieces: Sequence[memoryview]) -> str: ...
    def submit(self, ops: list[ReadOp], on_done: OnDone, *, ahead: bool = False) -> Batch: ...
    def promote(self, batch: Batch) -> None: ...
    def stats(self) -> dict: ...
    def close(self) -> None: ...


# -- planning -------------------------------------------------------------------------------
def plan_reads(parts: Sequence[ExpertPart], slot: memoryview, *, direct: bool) -> tuple[list[ReadOp], dict[str, tuple[int, int]]]:
    """The reads that put an expert's parts where `layout.slot_offsets` says they sit in `slot`.

    With `direct`, each read covers the enclosing 4096-aligned file range. Returns
    (ops, {part name: (offset of its first byte inside the slot, nbytes)}).
    """
    first, need = slot_offsets(parts, direct)
    if need > len(slot):
        raise ValueError(f"plan_reads: parts need {need} bytes, more than the slot's {len(slot)}")
    ops = []
    for p in parts:
        lead = p.offset % PAGE if direct else 0
        length = round_up(lead + p.nbytes, PAGE) if direct else p.nbytes
        at = first[p.name] - lead
        ops.append(ReadOp(p.offset - lead, length, slot[at : at + length], required=lead + p.nbytes, file=p.file))
    return ops, {p.name: (first[p.name], p.nbytes) for p in parts}


def slot_pieces(view: memoryview, slot_bytes: int) -> list[memoryview]:
    """`view` (slots of `slot_bytes`) cut into pieces of whole slots, each at most the 1 GiB one
    registered buffer may be (`Reader.register`): no slot's read crosses two of them."""
    step = max(1, MAX_FIXED_BYTES // slot_bytes) * slot_bytes
    return [view[i : i + step] for i in range(0, len(view), step)]


# -- shared machinery -----------------------------------------------------------------------
class ReaderBase:
    """What both backends share: the files, the pending queue, `submit`, counters, closing."""

    name = "?"

    def __init__(self, paths: str | Sequence[str], depth: int, direct: bool, ahead_depth: int | None = None):
        self.note = ""
        one = isinstance(paths, (str, os.PathLike))
        self.paths, self.depth, self.direct = [os.fspath(paths)] if one else [os.fspath(p) for p in paths], depth, direct
        self.fds: list[int] = []
        try:
            for p in self.paths:
                self.fds.append(open_fd(p, direct))
        except BaseException:
            self._close_files()
            raise
        self.sizes = [os.fstat(fd).st_size for fd in self.fds]
        self.queue = PendingQueue(depth, ahead_depth)
        self._lock = threading.Lock()
        # preadv_calls: reads issued (READV, preadv or READ_FIXED), fixed_reads of them READ_FIXED
        self._stats = {"ops": 0, "bytes": 0, "preadv_calls": 0, "fixed_reads": 0, "errors": 0}
        self._io0 = proc_read_bytes()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The owner's event loop runs now (a loop-driven backend reaps on it; threads need nothing)."""

    registered = False  # reads into `register`ed memory go as READ_FIXED

    def register(self, pieces: Sequence[memoryview]) -> str:
        """Destination memory to pin once for all reads (io_uring's registered buffers); "" if
        done, else why not. Reads into other memory work either way."""
        return f"no registered buffers with the {self.name} reader"

    def submit(self, ops: list[ReadOp], on_done: OnDone, *, ahead: bool = False) -> Batch:
        """Queue `ops` (a prefetch if `ahead`); `on_done(None | exception)` runs once, after the
        last one: from a reader thread, or on the loop of a loop-driven reader. Returns the batch,
        the handle `promote` takes."""
        if not ops:
            raise ValueError("submit: no ops")
        bad = next((op.file for op in ops if op.file >= len(self.paths)), None)
        if bad is not None:
            raise ValueError(f"submit: file index {bad} but the reader has {len(self.paths)} file(s)")
        batch = Batch(len(ops), on_done, ahead)
        self.queue.put([Chunk(op, batch) for op in ops])
        self._wake()
        return batch

    def promote(self, batch: Batch) -> None:
        """A demand request now waits on `batch`: its chunks not yet started go before prefetches."""
        if self.queue.promote(batch):
            self._wake()

    def _wake(self) -> None:
        """Tell the backend's thread(s) work is queued (the queue's condition already does for threads)."""

    def _count(self, run: list[Chunk], errors: list[BaseException | None]) -> None:
        with self._lock:
            self._stats["ops"] += len(run)
            self._stats["bytes"] += sum(c.length for c, e in zip(run, errors) if e is None)
            self._stats["errors"] += any(e is not None for e in errors)

    def _finish_run(self, run: Run, errors: list[BaseException | None]) -> None:
        """A run taken from the queue is over: count it, free its place in flight, complete its chunks."""
        self._count(run, errors)
        self.queue.done(run)
        self._finish_chunks(run, errors)

    @staticmethod
    def _finish_chunks(run: list[Chunk], errors: list[BaseException | None]) -> None:
        for c, e in zip(run, errors):
            c.dest = None  # hold no slot memory once done: the arena must be closable
            c.batch.finish(1, e)

    def _fail_unstarted(self, left: list[Chunk]) -> None:
        self._finish_chunks(left, [ReadError(125, "reader closed before this read started")] * len(left))

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._stats)
        io = proc_read_bytes()
        out["disk_read_bytes"] = io - self._io0 if io >= 0 and self._io0 >= 0 else None
        out.update(backend=self.name, depth=self.depth, ahead_depth=self.queue.ahead_depth, direct=self.direct,
                   in_flight=self.queue.flight_stats())
        return out

    def close(self) -> None:
        raise NotImplementedError

    def _close_files(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> ReaderBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Batch:
    """One `submit` call: calls `on_done` once, after its last chunk finished or was skipped."""

    __slots__ = ("on_done", "remaining", "error", "lock", "ahead")

    def __init__(self, n: int, on_done: OnDone, ahead: bool = False):
        self.on_done, self.remaining, self.error = on_done, n, None
        self.ahead = ahead  # a prefetch; the queue's lock guards changes (`promote`)
        self.lock = threading.Lock()

    def finish(self, n: int, error: BaseException | None) -> None:
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
            self.remaining -= n
            last = self.remaining == 0
        if last:
            try:
                self.on_done(self.error)
            except Exception:  # a broken callback must not kill a reader thread
                import logging

                logging.getLogger("moestream.iod").exception("reader on_done callback failed")


class Chunk:
    __slots__ = ("offset", "length", "dest", "required", "file", "batch", "taken")

    def __init__(self, op: ReadOp, batch: Batch):
        self.offset, self.length, self.dest, self.required = op.offset, op.length, op.dest, op.required
        self.file, self.batch, self.taken = op.file, batch, False

    @property
    def start_key(self) -> tuple[int, int]:
        return self.file, self.offset

    @property
    def end_key(self) -> tuple[int, int]:
        """Where the chunk ends, in its file: a neighbour's `start_key` if they touch."""
        return self.file, self.offset + self.length


class Run(list):
    """Adjacent chunks of one file read as one vectored read; `ahead` if it holds one of the prefetch places."""

    ahead = False


class PendingQueue:
    """Chunks waiting to be read, indexed by start and end so a taker can merge neighbours.

    Two FIFOs: demand chunks are taken before prefetch (`ahead`) chunks. It also bounds what is
    in flight: at most `depth` runs, at most `ahead_depth` of them started from a prefetch, so
    `depth - ahead_depth` places are always left for demand reads. Every run `take` returns
    must be given back with `done`.
    """

    def __init__(self, depth: int = MAX_DEPTH, ahead_depth: int | None = None) -> None:
        self.depth = depth
        self.ahead_depth = depth if ahead_depth is None else max(1, min(ahead_depth, depth))
        self.cond = threading.Condition()
        self.max_iovecs = MAX_RUN_IOVECS  # chunks a run may merge (1: none)
        self.fifos: dict[bool, deque[Chunk]] = {False: deque(), True: deque()}  # by `ahead`
        self.by_start: dict[tuple[int, int], Chunk] = {}  # (file, offset)
        self.by_end: dict[tuple[int, int], Chunk] = {}
        self.flying = {False: 0, True: 0}  # runs in flight, by `ahead`
        self.gauge = DepthGauge()
        self.closed = False

    def put(self, chunks: list[Chunk]) -> None:
        with self.cond:
            if self.closed:
                raise RuntimeError("reader is closed")
            for c in chunks:
                self.fifos[c.batch.ahead].append(c)
                self.by_start.setdefault(c.start_key, c)
                self.by_end.setdefault(c.end_key, c)
            self.cond.notify(len(chunks))

    def take(self, block: bool = True) -> Run | None:
        """The oldest startable chunk grown with adjacent pending ones, counted in flight; None when
        closed (or nothing may start now and not blocking)."""
        with self.cond:
            while True:
                fifo = self._startable()
                if fifo is not None:
                    return self._start(fifo is self.fifos[True], self._grow(fifo.popleft()))
                if self.closed or not block:
                    return None
                self.cond.wait()

    def _startable(self) -> deque[Chunk] | None:
        """The FIFO the next run starts from: demand first; None if depth (or the prefetch share) is used up."""
        if self.flying[False] + self.flying[True] >= self.depth:
            return None
        for ahead in (False, True):
            fifo = self.fifos[ahead]
            while fifo and fifo[0].taken:
                fifo.popleft()
            if fifo and (not ahead or self.flying[True] < self.ahead_depth):
                return fifo
        return None

    def _start(self, ahead: bool, chunks: list[Chunk]) -> Run:
        run = Run(chunks)
        run.ahead = ahead
        self.flying[ahead] += 1
        self.gauge.add()
        return run

    def done(self, run: Run) -> None:
        """`run` finished (or failed): its place in flight is free again."""
        with self.cond:
            self.flying[run.ahead] -= 1
            self.gauge.remove()
            self.cond.notify()  # a taker held back by depth or the prefetch share may go on

    def promote(self, batch: Batch) -> bool:
        """Move `batch`'s chunks not yet taken to the demand FIFO; True if any moved."""
        with self.cond:
            if not batch.ahead:
                return False
            batch.ahead = False
            old = self.fifos[True]
            moved = [c for c in old if c.batch is batch and not c.taken]
            self.fifos[True] = deque(c for c in old if c.batch is not batch)
            self.fifos[False].extend(moved)
            self.cond.notify(len(moved))
            return bool(moved)

    def _grow(self, first: Chunk) -> list[Chunk]:
        self._unindex(first)
        run, size = deque([first]), first.length
        for forward in (True, False):
            while len(run) < self.max_iovecs:
                nxt = self.by_start.get(run[-1].end_key) if forward else self.by_end.get(run[0].start_key)
                if nxt is None or size + nxt.length > MAX_RUN_BYTES:
                    break
                self._unindex(nxt)
                run.append(nxt) if forward else run.appendleft(nxt)
                size += nxt.length
        return list(run)

    def _unindex(self, c: Chunk) -> None:
        c.taken = True
        if self.by_start.get(c.start_key) is c:
            del self.by_start[c.start_key]
        if self.by_end.get(c.end_key) is c:
            del self.by_end[c.end_key]

    def flight_stats(self) -> dict:
        with self.cond:
            return {**self.gauge.stats(), "ahead": self.flying[True]}

    def close(self) -> list[Chunk]:
        """Stop accepting work; returns the chunks never taken (their batches must be failed)."""
        with self.cond:
            self.closed = True
            left = [c for fifo in self.fifos.values() for c in fifo if not c.taken]
            for c in left:
                self._unindex(c)
            for fifo in self.fifos.values():
                fifo.clear()
            self.cond.notify_all()
            return left




def open_fd(path: str, direct: bool) -> int:
    """A read-only descriptor for exact-range reads: O_DIRECT, or buffered with readahead off."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise ReadError(e.errno, f"cannot open {path} for reading{' with O_DIRECT' if direct else ''}: {e.strerror}") from None
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: read what was asked, nothing more
    return fd


def chunk_errors(run: list[Chunk], got: int, path: str = "the file") -> list[ReadError | None]:
    """Per chunk of a run whose vectored read stopped after `got` bytes: None if it has what it needs."""
    base = run[0].offset
    return [None if got >= c.offset - base + c.required else
            ReadError(5, f"short read: wanted bytes [{c.offset}, {c.offset + c.required}) of {path} "
                         f"but the read stopped at byte {base + got} (end of file?)")
            for c in run]


# -- factory --------------------------------------------------------------------------------
def open_reader(path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *, backend: str = "auto",
                depth: int = 32, direct: bool = False, ahead_depth: int | None = None,
                on_loop: bool = False) -> Reader:
    """A reader over `path` (or a list of paths, the parts of a split model: `ReadOp.file` indexes
    it): `uring`, `threads`, or `auto` (uring if it works here, else threads with a note).
    Prefetch reads hold at most `ahead_depth` (default: all) of the `depth` places in flight.
    `on_loop`: the caller runs an asyncio loop and calls `start(loop)`, and the ring is driven
    there (`reader_uring.LoopUringReader`) instead of by a thread of its own."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown reader backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"reader depth must be in [1, {MAX_DEPTH}], got {depth}")
    path = [os.fspath(p) for p in path] if isinstance(path, (list, tuple)) else [os.fspath(path)]
    if not path:
        raise ValueError("open_reader: no files")
    from .reader_threads import ThreadsReader

    if backend == "threads":
        return ThreadsReader(path, depth=depth, direct=direct, ahead_depth=ahead_depth)
    from .reader_uring import LoopUringReader, UringReader, UringUnavailable

    if on_loop:
        try:
            return LoopUringReader(path, depth=depth, direct=direct, ahead_depth=ahead_depth)
        except UringUnavailable as e:  # (a ring its loop cannot watch may still work from a thread)
            loop_note = f"io_uring on the event loop unavailable: {e}; using a ring thread"
    try:
        reader = UringReader(path, depth=depth, direct=direct, ahead_depth=ahead_depth)
        if on_loop:
            reader.note = loop_note
        return reader
    except UringUnavailable as e:
        if backend == "uring":
            raise
        reader = ThreadsReader(path, depth=depth, direct=direct, ahead_depth=ahead_depth)
        reader.note = f"io_uring unavailable: {e}; using threads"
        return reader
