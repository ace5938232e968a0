"""`threads` reader: `depth` worker threads, each doing one coalesced `os.preadv` at a time.

`os.preadv` releases the GIL, so `depth` workers keep `depth` reads in flight at the device.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from .readers import Chunk, ReadError, ReaderBase, Run, chunk_errors


class ThreadsReader(ReaderBase):
    name = "threads"

    def __init__(self, paths: str | Sequence[str], *, depth: int = 32, direct: bool = False, ahead_depth: int | None = None):
        super().__init__(paths, depth, direct, ahead_depth)
        self._threads = [threading.Thread(target=self._worker, name=f"iod-read-{i}", daemon=True) for i in range(depth)]
        for t in self._threads:
            t.start()

    def _worker(self) -> None:
        while True:
            run = self.queue.take()
            if run is None:
                return
            self._serve(run)
            del run  # hold no slot memory while waiting: the arena must be closable

    def _serve(self, run: Run) -> None:
        # Every chunk of a merged run is read, even one whose batch already failed elsewhere:
        # dropping it would leave a gap in the vectored read.
        errors = self._read(run)
        with self._lock:
            self._stats["preadv_calls"] += 1
        self._finish_run(run, errors)

    def _read(self, run: list[Chunk]) -> list[ReadError | None]:
        """One vectored read of adjacent chunks of one file (retrying short reads); each chunk's error, if any."""
        bufs = [c.dest for c in run]
        file = run[0].file
        fd, size, path = self.fds[file], self.sizes[file], self.paths[file]
        base, total, got = run[0].offset, sum(c.length for c in run), 0
        try:
            while got < total and base + got < size:
                n = os.preadv(fd, _skip(bufs, got), base + got)
                if n == 0:
                    break
                got += n
        except OSError as e:
            return [ReadError(e.errno, f"reading bytes [{base}, {base + total}) of {path}: {e.strerror}")] * len(run)
        return chunk_errors(run, got, path)

    def close(self) -> None:
        """Stop the workers (after their current read), fail whatever never started, close the file."""
        left = self.queue.close()
        for t in self._threads:
            t.join()
        self._fail_unstarted(left)
        self._close_files()


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
