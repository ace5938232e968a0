"""Reader backends: exact bytes into an mmap'd stand-in for the arena, coalescing, errors, cleanup."""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from moestream.common.layout import PAGE, ModelLayout
from moestream.iod import reader_uring, readers
from moestream.iod.readers import (
    PendingQueue,
    ReadError,
    ReadOp,
    open_reader,
    plan_reads,
)


def _uring_ok() -> str:
    try:
        with reader_uring.UringReader(__file__, depth=2):
            return ""
    except reader_uring.UringUnavailable as e:
        return str(e)


URING_WHY = _uring_ok()


def _loop_uring_ok() -> str:
    try:
        reader_uring.LoopUringReader(__file__, depth=2).close()
        return ""
    except reader_uring.UringUnavailable as e:
        return str(e)


LOOP_URING_WHY = URING_WHY or _loop_uring_ok()
BACKENDS = [
    "threads",
    pytest.param("uring", marks=pytest.mark.skipif(bool(URING_WHY), reason=f"io_uring unavailable: {URING_WHY}")),
]


@pytest.fixture(scope="module")
def model(make_tiny_model) -> Path:
    return make_tiny_model(layers=2, experts=8, quant="Q8_0")


class Waiter:
    """Collects on_done calls; `wait()` returns the errors once `n` batches finished."""

    def __init__(self, n: int):
        self.n, self.errors, self.calls = n, [], 0
        self.cond = threading.Condition()

    def __call__(self, err: BaseException | None) -> None:
        with self.cond:
            self.calls += 1
            if err is not None:
                self.errors.append(err)
            self.cond.notify_all()

    def wait(self, timeout: float = 10.0) -> list[BaseException]:
        with self.cond:
            assert self.cond.wait_for(lambda: self.calls >= self.n, timeout), f"only {self.calls}/{self.n} batches finished"
        return self.errors


def _submit_each(r, ex, keys, view: memoryview, slot_bytes: int, direct: bool, on_done) -> list[dict]:
    """One submit per expert into its own slot of `view`, all pending at once, as the daemon issues
    them; where each expert's parts land."""
    placed = []
    for i, key in enumerate(keys):
        ops, where = plan_reads(ex.parts(*key), view[i * slot_bytes : (i + 1) * slot_bytes], direct=direct)
        placed.append(where)
        r.submit(ops, on_done)
    return placed


def _assert_slots_hold(model: Path, ex, keys, view: memoryview, slot_bytes: int, placed: list[dict]) -> None:
    """Every expert's parts in its slot are the file's bytes (a plain read of the file: the
    independent reference)."""
    file_bytes = model.read_bytes()
    for i, key in enumerate(keys):
        for part in ex.parts(*key):
            off, n = placed[i][part.name]
            assert view[i * slot_bytes + off : i * slot_bytes + off + n] == file_bytes[part.offset : part.offset + n], \
                f"expert {key} part {part.name} differs"


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_reads_every_expert_exactly(model: Path, backend: str, direct: bool) -> None:
    layout = ModelLayout(model)
    ex = layout.experts
    keys = [(lay, e) for lay in range(ex.n_layer) for e in range(ex.n_expert)]
    slot_bytes = ex.slot_bytes(direct)
    arena = mmap.mmap(-1, slot_bytes * len(keys))  # page-aligned, like the shared-memory arena
    view = memoryview(arena)
    done = Waiter(len(keys))
    with open_reader(model, backend=backend, depth=4, direct=direct) as r:
        assert r.name == backend and r.note == ""
        placed = _submit_each(r, ex, keys, view, slot_bytes, direct, done)
        assert done.wait() == []
        stats = r.stats()
    _assert_slots_hold(model, ex, keys, view, slot_bytes, placed)
    assert stats["errors"] == 0 and stats["ops"] == sum(len(ex.parts(*k)) for k in keys)
    view.release()
    arena.close()


URING_ONLY = pytest.mark.skipif(bool(URING_WHY), reason=f"io_uring unavailable: {URING_WHY}")


@URING_ONLY
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_registered_buffers_read_fixed(model: Path, direct: bool) -> None:
    """Reads into registered memory go as READ_FIXED, one per chunk, across the pieces' edges;
    a read into other memory still goes as READV; the bytes are the file's either way."""
    ex = ModelLayout(model).experts
    keys = [(lay, e) for lay in range(ex.n_layer) for e in range(ex.n_expert)]
    slot_bytes = ex.slot_bytes(direct)
    arena, other = mmap.mmap(-1, slot_bytes * len(keys)), mmap.mmap(-1, slot_bytes)
    view = memoryview(arena)
    pieces = [view[i : i + 3 * slot_bytes] for i in range(0, len(view), 3 * slot_bytes)]  # the last one shorter
    done = Waiter(len(keys) + 1)
    with open_reader(model, backend="uring", depth=4, direct=direct) as r:
        assert r.register(pieces) == ""
        placed = _submit_each(r, ex, keys, view, slot_bytes, direct, done)
        outside, where_out = plan_reads(ex.parts(0, 0), memoryview(other), direct=direct)
        r.submit(outside, done)
        assert done.wait() == []
        stats = r.stats()
    _assert_slots_hold(model, ex, keys, view, slot_bytes, placed)
    _assert_slots_hold(model, ex, [(0, 0)], memoryview(other), slot_bytes, [where_out])
    n_ops = sum(len(ex.parts(*k)) for k in keys)
    assert stats["errors"] == 0 and stats["ops"] == n_ops + len(outside)
    assert stats["fixed_reads"] == n_ops and stats["preadv_calls"] == n_ops + len(outside)  # no coalescing
    del outside, pieces
    view.release()
    arena.close()
    other.close()


@URING_ONLY
def test_registered_read_past_eof_and_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An aligned READ_FIXED past the end of the file delivers what the file has; registering
    twice, after a read, or a piece over 1 GiB is refused; a kernel refusal leaves READV reads."""
    path = tmp_path / "f.bin"
    data = os.urandom(2 * PAGE + 100)
    path.write_bytes(data)
    buf = mmap.mmap(-1, 3 * PAGE)
    with open_reader(path, backend="uring", direct=True) as r:
        assert r.register([memoryview(buf)]) == ""
        with pytest.raises(RuntimeError, match="once"):
            r.register([memoryview(buf)])
        done = Waiter(1)
        r.submit([ReadOp(0, 3 * PAGE, memoryview(buf), required=2 * PAGE + 100)], done)  # the file ends 100 bytes in
        assert done.wait() == [] and r.stats()["fixed_reads"] >= 1
    assert bytes(buf[: 2 * PAGE + 100]) == data
    buf[:] = bytes(3 * PAGE)
    with open_reader(path, backend="uring", direct=True) as r:  # two pieces; a read across their edge is a READV
        assert r.register([memoryview(buf)[:PAGE], memoryview(buf)[PAGE:]]) == ""
        done = Waiter(1)
        r.submit([ReadOp(0, 2 * PAGE, memoryview(buf)[: 2 * PAGE])], done)
        assert done.wait() == [] and r.stats()["fixed_reads"] == 0
    assert bytes(buf[: 2 * PAGE]) == data[: 2 * PAGE]
    big = mmap.mmap(-1, (1 << 30) + PAGE)  # never touched: no memory used
    with open_reader(path, backend="uring") as r:
        assert "over 1 GiB" in r.register([memoryview(big)])
        done = Waiter(1)
        r.submit([ReadOp(0, PAGE, memoryview(buf)[:PAGE])], done)
        assert done.wait() == []
        with pytest.raises(RuntimeError, match="before the first read"):
            r.register([memoryview(buf)])
    big.close()

    def refuse(ring, regions):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(reader_uring, "register_buffers", refuse)
    buf[:] = bytes(3 * PAGE)
    with open_reader(path, backend="uring") as r:
        assert "LimitMEMLOCK" in r.register([memoryview(buf)])
        done = Waiter(1)
        r.submit([ReadOp(0, PAGE, memoryview(buf)[:PAGE]), ReadOp(PAGE, PAGE, memoryview(buf)[PAGE : 2 * PAGE])], done)
        assert done.wait() == []
        st = r.stats()
    assert st["fixed_reads"] == 0 and st["preadv_calls"] == 1  # READV, coalesced as before
    assert bytes(buf[: 2 * PAGE]) == data[: 2 * PAGE]
    buf.close()


def test_threads_reader_registers_nothing(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * PAGE)
    with open_reader(path, backend="threads") as r:
        assert "threads" in r.register([memoryview(bytearray(PAGE))])


@pytest.mark.parametrize("backend", BACKENDS)
def test_submits_racing_the_reader_all_finish(model: Path, backend: str) -> None:
    """Four threads submitting one-read batches as fast as they can while the reader works: every
    batch finishes (the uring reader writes its wake-up only when none is pending, so a submit
    that skips it must still be taken), and each read lands its bytes."""
    ex = ModelLayout(model).experts
    part = ex.parts(0, 0)[0]
    n_threads, per = 4, 150
    arena = mmap.mmap(-1, PAGE * 2 * n_threads * per)
    view = memoryview(arena)
    done = Waiter(n_threads * per)
    with open_reader(model, backend=backend, depth=2, direct=False) as r:
        def submit(t: int) -> None:
            for i in range(per):
                at = (t * per + i) * 2 * PAGE
                r.submit([ReadOp(part.offset, part.nbytes, view[at:at + part.nbytes])], done)

        threads = [threading.Thread(target=submit, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert done.wait(30) == []
    want = model.read_bytes()[part.offset:part.offset + part.nbytes]
    assert all(view[i * 2 * PAGE:i * 2 * PAGE + part.nbytes] == want for i in range(n_threads * per))
    view.release()
    arena.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_adjacent_experts_coalesce(model: Path, backend: str) -> None:
    layout = ModelLayout(model)
    ex = layout.experts
    slot = ex.slot_bytes(False)
    arena = mmap.mmap(-1, slot * ex.n_expert)
    ops = []
    for e in range(ex.n_expert):  # expert e and e+1 of one tensor are neighbours in the file
        ops += plan_reads(ex.parts(0, e), memoryview(arena)[e * slot : (e + 1) * slot], direct=False)[0]
    done = Waiter(1)
    with open_reader(model, backend=backend, depth=2) as r:
        r.submit(ops, done)
        assert done.wait() == []
        st = r.stats()
    assert st["ops"] == len(ops)
    assert st["preadv_calls"] <= len(ex.parts(0, 0)) < len(ops), st  # one vectored read per expert tensor
    del ops
    arena.close()


def test_queue_merges_neighbours_from_separate_submits() -> None:
    q, buf = PendingQueue(), bytearray(4 * PAGE)
    batches = [readers.Batch(1, lambda e: None) for _ in range(4)]
    order = [2, 0, 3, 1]  # submitted out of order, one op per submit
    for i in order:
        q.put([readers.Chunk(ReadOp(i * PAGE, PAGE, memoryview(buf)[i * PAGE : (i + 1) * PAGE]), batches[i])])
    q.put([readers.Chunk(ReadOp(10 * PAGE, PAGE, memoryview(bytearray(PAGE))), batches[0])])
    run = q.take(block=False)
    assert [c.offset for c in run] == [0, PAGE, 2 * PAGE, 3 * PAGE]  # oldest first, grown both ways
    assert [c.offset for c in q.take(block=False)] == [10 * PAGE]
    assert q.take(block=False) is None


def test_plan_reads_layout(model: Path) -> None:
    ex = ModelLayout(model).experts
    for direct in (False, True):
        slot = memoryview(bytearray(ex.slot_bytes(direct)))
        for key in [(0, 0), (ex.n_layer - 1, ex.n_expert - 1)]:
            parts = ex.parts(*key)
            ops, where = plan_reads(parts, slot, direct=direct)
            assert list(where) == [p.name for p in parts]
            for op, p in zip(ops, parts):
                op_start = where[p.name][0] - (p.offset - op.offset)  # slot position of the read
                assert op_start % PAGE == 0  # every read lands on a page boundary of the slot
                assert op.offset <= p.offset and p.offset + p.nbytes <= op.offset + op.length
                if direct:
                    assert op.offset % PAGE == 0 and op.length % PAGE == 0
                else:
                    assert (op.offset, op.length) == (p.offset, p.nbytes)
    with pytest.raises(ValueError, match="slot"):
        plan_reads(ex.parts(0, 0), memoryview(bytearray(PAGE)), direct=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_reach_on_done(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 * PAGE + 100))
    buf = mmap.mmap(-1, 4 * PAGE)
    with open_reader(path, backend=backend, depth=2) as r:
        done = Waiter(1)
        r.submit([ReadOp(0, PAGE, memoryview(buf)[:PAGE]), ReadOp(3 * PAGE, PAGE, memoryview(buf)[PAGE : 2 * PAGE])], done)
        (err,) = done.wait()
        assert isinstance(err, ReadError) and "short read" in str(err)
        good_fd, r.fds[0] = r.fds[0], 1 << 20  # a descriptor that is not open
        done = Waiter(1)
        r.submit([ReadOp(0, PAGE, memoryview(buf)[:PAGE])], done)
        (err,) = done.wait()
        r.fds[0] = good_fd
        assert isinstance(err, OSError) and err.errno == 9  # EBADF
        # A callback that raises does not kill the reader; the next batch still works.
        r.submit([ReadOp(0, PAGE, memoryview(buf)[:PAGE])], lambda e: 1 / 0)
        done = Waiter(1)
        r.submit([ReadOp(PAGE, PAGE, memoryview(buf)[PAGE : 2 * PAGE])], done)
        assert done.wait() == []
        assert r.stats()["errors"] == 2
    assert bytes(buf[PAGE : 2 * PAGE]) == path.read_bytes()[PAGE : 2 * PAGE]
    buf.close()


def test_direct_tolerates_aligned_read_past_eof(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    data = os.urandom(2 * PAGE + 100)
    path.write_bytes(data)
    buf = mmap.mmap(-1, PAGE)
    with open_reader(path, backend="threads", direct=True) as r:
        done = Waiter(1)
        r.submit([ReadOp(2 * PAGE, PAGE, memoryview(buf), required=100)], done)  # the file ends 100 bytes in
        assert done.wait() == []
    assert bytes(buf[:100]) == data[2 * PAGE :]
    buf.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_close_joins_threads_and_fails_unstarted(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(64 * PAGE))
    before = {t.ident for t in threading.enumerate()}
    r = open_reader(path, backend=backend, depth=1)
    bufs = [bytearray(PAGE) for _ in range(200)]
    done = Waiter(200)
    for i in range(200):  # separate non-adjacent batches, most still queued when close() comes
        r.submit([ReadOp((i * 7 % 64) * PAGE, PAGE, memoryview(bufs[i]))], done)
    r.close()
    errors = done.wait(timeout=5)  # every batch got its callback: read, or failed as "closed"
    assert all(isinstance(e, ReadError) for e in errors)
    assert {t.ident for t in threading.enumerate()} <= before, "reader threads left running"
    with pytest.raises(RuntimeError, match="closed"):
        r.submit([ReadOp(0, PAGE, memoryview(bufs[0]))], done)


def test_auto_falls_back_with_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * PAGE)

    def refuse(entries: int) -> None:
        raise reader_uring.RingUnavailable("io_uring_setup failed: Operation not permitted")

    monkeypatch.setattr(reader_uring, "Ring", refuse)
    with open_reader(path, backend="auto") as r:
        assert r.name == "threads" and "io_uring unavailable: io_uring_setup failed" in r.note
    with pytest.raises(reader_uring.UringUnavailable, match="Operation not permitted"):
        open_reader(path, backend="uring")
    with pytest.raises(ValueError, match="unknown reader backend"):
        open_reader(path, backend="aio")


@pytest.mark.skipif(bool(URING_WHY), reason=f"io_uring unavailable: {URING_WHY}")
def test_a_ring_the_loop_cannot_watch_gets_a_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * PAGE)

    def refuse(ring, efd: int) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(reader_uring, "register_eventfd", refuse)
    with open_reader(path, backend="uring", on_loop=True) as r:
        assert type(r) is reader_uring.UringReader
        assert "io_uring on the event loop unavailable: io_uring completion eventfd: Invalid argument" in r.note
        done = Waiter(1)
        buf = bytearray(PAGE)
        r.submit([ReadOp(0, PAGE, memoryview(buf))], done)
        assert done.wait() == [] and bytes(buf) == b"x" * PAGE


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_readahead_inflation(tmp_path: Path, backend: str) -> None:
    """Cold scattered 4 KiB reads fetch about 4 KiB each from disk, not a readahead window."""
    path = tmp_path / "big.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8).tobytes())
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # evict: the reads below go to the device
    os.close(fd)
    if readers.proc_read_bytes() < 0:
        pytest.skip("/proc/self/io not readable")
    buf = bytearray(PAGE)
    with open_reader(path, backend=backend, depth=4) as r:
        for i in range(32):  # 4 short sequential runs, one page at a time: what readahead feeds on
            done = Waiter(1)
            r.submit([ReadOp((i // 8 * 512 + i % 8) * PAGE, PAGE, memoryview(buf))], done)
            assert done.wait() == []
        disk = r.stats()["disk_read_bytes"]
    if disk == 0:
        pytest.skip("the file stayed in the page cache (fadvise DONTNEED had no effect here)")
    assert disk <= 2 * 32 * PAGE, f"read {disk} bytes from disk for 32 pages"


# -- the loop-driven ring (the daemon's) --------------------------------------------------------------
def _on_loop(body) -> object:
    """Run `body(loop)` as a coroutine on a fresh asyncio loop; its result."""
    import asyncio

    async def main():
        return await body(asyncio.get_running_loop())

    return asyncio.run(main())


@pytest.mark.skipif(bool(LOOP_URING_WHY), reason=f"io_uring on a loop unavailable: {LOOP_URING_WHY}")
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_loop_reader_reads_every_expert_on_its_loop(model: Path, direct: bool) -> None:
    """The daemon's reader: reads issued from the loop land exactly, and every on_done runs on the
    loop's own thread, no thread of the reader's in between."""
    import asyncio

    layout = ModelLayout(model)
    ex = layout.experts
    keys = [(lay, e) for lay in range(ex.n_layer) for e in range(ex.n_expert)]
    slot_bytes = ex.slot_bytes(direct)
    arena = mmap.mmap(-1, slot_bytes * len(keys))
    view = memoryview(arena)
    threads_before = {t.ident for t in threading.enumerate()}

    async def body(loop):
        r = open_reader(model, backend="uring", depth=4, direct=direct, on_loop=True)
        assert isinstance(r, reader_uring.LoopUringReader) and {t.ident for t in threading.enumerate()} == threads_before
        r.start(loop)
        called, all_done = [], loop.create_future()

        def on_done(err):
            called.append((threading.get_ident(), err))
            if len(called) == len(keys):
                all_done.set_result(None)

        placed = _submit_each(r, ex, keys, view, slot_bytes, direct, on_done)
        await asyncio.wait_for(all_done, 10)
        stats = r.stats()
        r.close()
        return placed, called, stats

    placed, called, stats = _on_loop(body)
    assert {who for who, _ in called} == {threading.get_ident()} and [e for _, e in called] == [None] * len(keys)
    _assert_slots_hold(model, ex, keys, view, slot_bytes, placed)
    assert stats["errors"] == 0 and stats["ops"] == sum(len(ex.parts(*k)) for k in keys)
    view.release()
    arena.close()


@pytest.mark.skipif(bool(LOOP_URING_WHY), reason=f"io_uring on a loop unavailable: {LOOP_URING_WHY}")
def test_loop_reader_errors_and_close_with_reads_in_flight(tmp_path: Path) -> None:
    """A short read reaches on_done as an error; `close` before the loop reaped waits for the reads
    in the kernel's hands (their bytes land) and fails those never started."""
    import asyncio

    path = tmp_path / "f.bin"
    data = os.urandom(64 * PAGE + 100)
    path.write_bytes(data)
    bufs, tail = [bytearray(PAGE) for _ in range(200)], bytearray(PAGE)

    async def body(loop):
        r = open_reader(path, backend="uring", depth=2, on_loop=True)
        r.start(loop)
        got = loop.create_future()
        r.submit([ReadOp(64 * PAGE, PAGE, memoryview(tail))], got.set_result)  # only 100 bytes there
        err = await asyncio.wait_for(got, 10)
        errors = []
        for i in range(200):  # two in the kernel's hands at once, the rest queued
            r.submit([ReadOp((i * 7 % 64) * PAGE, PAGE, memoryview(bufs[i]))], errors.append)
        r.close()  # no await since: the loop never reaped them
        return err, errors

    err, errors = _on_loop(body)
    assert isinstance(err, ReadError) and "short read" in str(err)
    assert len(errors) == 200
    read = [e for e in errors if e is None]
    assert 1 <= len(read) < 200 and all(isinstance(e, ReadError) and "closed" in str(e) for e in errors if e is not None)
    started = [i for i in range(200) if bytes(bufs[i]) != bytes(PAGE)]  # (random pages: never all zero)
    assert len(started) == len(read)
    for i in started:
        assert bytes(bufs[i]) == data[(i * 7 % 64) * PAGE : (i * 7 % 64 + 1) * PAGE]
