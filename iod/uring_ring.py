"""A minimal io_uring ring over the raw syscalls (ctypes, no compile step, no dependency).

Only what the reader needs: set up a ring, register buffers, queue READV and READ_FIXED entries,
submit and wait, reap completions. One thread owns a ring. The kernel's structures
(linux/io_uring.h):

    SQ ring mmap (IORING_OFF_SQ_RING): head, tail, ring_mask, ..., array[u32 index into SQEs]
    CQ ring mmap (IORING_OFF_CQ_RING, or the SQ mmap with IORING_FEAT_SINGLE_MMAP): head, tail, ..., cqes[]
    SQE mmap (IORING_OFF_SQES): 64-byte entries
        opcode u8 | flags u8 | ioprio u16 | fd s32 | off u64 | addr u64 | len u32 | rw_flags u32 | user_data u64
        | buf_index u16 | pad[22]
    CQE: user_data u64 | res s32 | flags u32

Ordering: x86-64 keeps stores in order and loads in order, so plain stores of the SQE, then the
array entry, then the tail are seen by the kernel in that order (and likewise for the CQ tail
then the CQEs). Other architectures would need explicit barriers, so they are refused.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct

SYS_IO_URING_SETUP, SYS_IO_URING_ENTER, SYS_IO_URING_REGISTER = 425, 426, 427  # every architecture since 5.1
REGISTER_BUFFERS, REGISTER_EVENTFD = 0, 4
OFF_SQ_RING, OFF_CQ_RING, OFF_SQES = 0, 0x8000000, 0x10000000
FEAT_SINGLE_MMAP = 1 << 0
ENTER_GETEVENTS = 1 << 0
OP_READV, OP_READ_FIXED = 1, 4
MAX_FIXED_BYTES = 1 << 30  # the kernel's limit on one registered buffer
_SQE = struct.Struct("<BBHiQQIIQH22x")  # 64 bytes
_CQE = struct.Struct("<QiI")  # 16 bytes


class RingUnavailable(RuntimeError):
    """io_uring cannot be set up here; the message says why."""


class _Params(ctypes.Structure):
    _fields_ = [
        ("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32), ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
        ("sq_off", ctypes.c_uint32 * 10),  # head tail ring_mask ring_entries flags dropped array resv1 user_addr(u64)
        ("cq_off", ctypes.c_uint32 * 10),  # head tail ring_mask ring_entries overflow cqes flags resv1 user_addr(u64)
    ]


assert ctypes.sizeof(_Params) == 120

_libc = ctypes.CDLL(None, use_errno=True)  # ctypes drops the GIL for the call, so waiting blocks no one
_libc.syscall.restype = ctypes.c_long


def _syscall(*args: int | ctypes.c_void_p) -> int:
    res = _libc.syscall(*[a if isinstance(a, ctypes.c_void_p) else ctypes.c_long(a) for a in args])
    if res < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return res


def register_eventfd(ring: Ring, efd: int) -> None:
    """Have the kernel signal `efd` (an eventfd) for every completion `ring` posts."""
    fd = ctypes.c_int32(efd)
    _syscall(SYS_IO_URING_REGISTER, ring.fd, REGISTER_EVENTFD, ctypes.c_void_p(ctypes.addressof(fd)), 1)


def register_buffers(ring: Ring, regions: list[tuple[int, int]]) -> None:
    """Pin the memory regions (address, length) for READ_FIXED: buffer index i is regions[i].
    The kernel pins them once here instead of on every read (OSError: e.g. ENOMEM past the
    locked-memory limit)."""
    iovs = (Iovec * len(regions))(*regions)
    _syscall(SYS_IO_URING_REGISTER, ring.fd, REGISTER_BUFFERS, ctypes.c_void_p(ctypes.addressof(iovs)), len(regions))


class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _u32(base: int, off: int) -> ctypes.c_uint32:
    return ctypes.c_uint32.from_address(base + off)


def _map(fd: int, size: int, offset: int) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)
    anchor = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(anchor)
    del anchor  # keep the address, not a buffer export (which would stop m.close())
    return m, addr


class Ring:
    """One io_uring instance: `prep_readv` entries, `submit_and_wait`, then `reap` completions."""

    def __init__(self, entries: int):
        if platform.machine() not in ("x86_64", "AMD64"):
            raise RingUnavailable(f"the ctypes io_uring binding is only ordered correctly on x86-64, not {platform.machine()}")
        p = _Params()
        try:
            self.fd = _syscall(SYS_IO_URING_SETUP, entries, ctypes.c_void_p(ctypes.addressof(p)))
        except OSError as e:
            hint = " (kernel.io_uring_disabled or a seccomp filter?)" if e.errno in (1, 38) else ""
            raise RingUnavailable(f"io_uring_setup failed: {e.strerror}{hint}") from None
        try:
            self._map_rings(p)
        except OSError as e:
            os.close(self.fd)
            raise RingUnavailable(f"mapping the io_uring rings failed: {e}") from None

    def _map_rings(self, p: _Params) -> None:
        sq, cq = p.sq_off, p.cq_off
        sq_size = sq[6] + p.sq_entries * 4
        cq_size = cq[5] + p.cq_entries * _CQE.size
        if p.features & FEAT_SINGLE_MMAP:
            sq_size = cq_size = max(sq_size, cq_size)
        self._sq_map, sq_base = _map(self.fd, sq_size, OFF_SQ_RING)
        self._cq_map, cq_base = (self._sq_map, sq_base) if p.features & FEAT_SINGLE_MMAP else _map(self.fd, cq_size, OFF_CQ_RING)
        self._sqe_map, _ = _map(self.fd, p.sq_entries * _SQE.size, OFF_SQES)
        self.sq_entries, self.cq_entries = p.sq_entries, p.cq_entries
        self._sq_tail, self._sq_head, self._sq_mask = _u32(sq_base, sq[1]), _u32(sq_base, sq[0]), _u32(sq_base, sq[2]).value
        self._sq_array = (ctypes.c_uint32 * p.sq_entries).from_address(sq_base + sq[6])
        self._cq_head, self._cq_tail, self._cq_mask = _u32(cq_base, cq[0]), _u32(cq_base, cq[1]), _u32(cq_base, cq[2]).value
        self._cqes = memoryview(self._cq_map)[cq[5] : cq[5] + p.cq_entries * _CQE.size]
        self._to_submit = 0

    def free_sqes(self) -> int:
        return self.sq_entries - (self._sq_tail.value - self._sq_head.value) % (1 << 32)

    def prep(self, opcode: int, fd: int, addr: int, length: int, offset: int, user_data: int,
             buf_index: int = 0) -> None:
        """Queue one entry (not yet submitted). The caller checks `free_sqes()` first."""
        tail = self._sq_tail.value
        idx = tail & self._sq_mask
        _SQE.pack_into(self._sqe_map, idx * _SQE.size, opcode, 0, 0, fd, offset, addr, length, 0, user_data, buf_index)
        self._sq_array[idx] = idx
        self._sq_tail.value = (tail + 1) & 0xFFFFFFFF  # published last: the kernel reads the entry after this
        self._to_submit += 1

    def pending(self) -> int:
        """Entries queued and not yet handed to the kernel."""
        return self._to_submit

    def submit_and_wait(self, wait_nr: int) -> None:
        """Hand queued entries to the kernel; block until `wait_nr` completions are ready."""
        flags = ENTER_GETEVENTS if wait_nr else 0
        while True:
            try:
                n = _syscall(SYS_IO_URING_ENTER, self.fd, self._to_submit, wait_nr, flags, ctypes.c_void_p(None), 0)
            except OSError as e:
                if e.errno == 4:  # EINTR: a signal landed on this thread; just wait again
                    continue
                raise
            self._to_submit -= min(n, self._to_submit)
            return

    def reap(self) -> list[tuple[int, int]]:
        """All completions ready now, as (user_data, res), and mark them seen."""
        head, tail = self._cq_head.value, self._cq_tail.value
        out = []
        while head != tail:
            i = (head & self._cq_mask) * _CQE.size
            user_data, res, _flags = _CQE.unpack_from(self._cqes, i)
            out.append((user_data, res))
            head = (head + 1) & 0xFFFFFFFF
        self._cq_head.value = head
        return out

    def close(self) -> None:
        """Unmap and close; in-flight requests are cancelled by the kernel."""
        self._cqes.release()
        for m in {id(m): m for m in (self._sq_map, self._cq_map, self._sqe_map)}.values():
            m.close()
        os.close(self.fd)
