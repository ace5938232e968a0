"""`threads` reader: `depth` worker threads, each doing one coalesced `os.preadv` at a time.

`os.preadv` releases the GIL, so `depth` workers keep `depth` reads in flight at the device.
"""

from __future__ import annotations

import os
import threading

from .readers import Batch, Chunk, OnDone, PendingQueue, ReadError, ReaderCounters, ReadOp, open_fd, run_shortfall


class ThreadsReader(ReaderCounters):
    name = "threads"

    def __init__(self, path: str, *, depth: int = 32, direct: bool = False):
        self.note = ""
        self.path, self.depth, self.direct = path, depth, direct
        self.fd = open_fd(path, direct)
        self.size = os.fstat(self.fd).st_size
        self.queue = PendingQueue()
        super().__init__()
        self._threads = [threading.Thread(target=self._worker, name=f"iod-read-{i}", daemon=True) for i in range(depth)]
        for t in self._threads:
            t.start()

    def submit(self, ops: list[ReadOp], on_done: OnDone) -> None:
        """Queue `ops`; `on_done(None | exception)` runs once, from a reader thread, after the last one."""
        if not ops:
            raise ValueError("submit: no ops")
        batch = Batch(len(ops), on_done)
        self.queue.put([Chunk(op, batch) for op in ops])

    def _worker(self) -> None:
        while True:
            run = self.queue.take()
            if run is None:
                return
            self._serve(run)
            del run  # hold no slot memory while waiting: the arena must be closable

    def _serve(self, run: list[Chunk]) -> None:
        live = [c for c in run if c.batch.error is None]  # a failed batch's other reads are skipped
        error = self._read(live) if live else None
        with self._lock:
            self._stats["ops"] += len(live)
            self._stats["bytes"] += sum(c.length for c in live) if error is None else 0
            self._stats["preadv_calls"] += 1 if live else 0
            self._stats["errors"] += error is not None
        ids = {id(c) for c in live}
        for c in run:
            c.dest = None
            c.batch.finish(1, error if id(c) in ids else None)

    def _read(self, run: list[Chunk]) -> BaseException | None:
        """One vectored read of adjacent chunks (retrying short reads); the error, if any."""
        bufs = [c.dest for c in run]
        base, total, got = run[0].offset, sum(c.length for c in run), 0
        try:
            while got < total and base + got < self.size:
                n = os.preadv(self.fd, _skip(bufs, got), base + got)
                if n == 0:
                    break
                got += n
        except OSError as e:
            return ReadError(e.errno, f"reading bytes [{base}, {base + total}) of {self.path}: {e.strerror}")
        return run_shortfall(run, got)

    def close(self) -> None:
        """Stop the workers (after their current read), fail whatever never started, close the file."""
        left = self.queue.close()
        for t in self._threads:
            t.join()
        closed = ReadError(125, "reader closed before this read started")
        for c in left:
            c.dest = None
            c.batch.finish(1, closed)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ThreadsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _skip(bufs: list[memoryview], n: int) -> list[memoryview]:
    """The buffers still to fill after the first `n` bytes arrived."""
    if n == 0:
        return bufs
    out = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:] if n else b)
        n = 0
    return out
