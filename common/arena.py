"""The shared-memory arena: one POSIX shm segment the daemon writes and decoders read.

The daemon creates it (`Arena.create`); a decoder attaches read-only (`ArenaView.attach`) with
its name and geometry from the `welcome` message. Neither side uses
`multiprocessing.shared_memory`: on Python 3.11 it registers every segment with the resource
tracker, which would unlink the daemon's arena when a client exits.
"""

from __future__ import annotations

import fcntl
import grp
import mmap
import os
import re
import uuid
from collections.abc import Sequence

import numpy as np

SHM_DIR = "/dev/shm"
NAME_PREFIX = "moestream-"
_NAME_RE = re.compile(r"^moestream-[0-9]+-[0-9a-f]{32}$")  # the only names a client will open


class ArenaError(RuntimeError):
    pass


def dead_arenas() -> list[tuple[str, int, int]]:
    """(name, pid, bytes) of arenas in /dev/shm whose daemon process is gone (killed, OOM): what
    `moestream status` mentions when no daemon answers. Read-only: it takes no lock (that would race
    a daemon creating its arena); the next daemon start removes them (`Arena.remove_stale`)."""
    out = []
    for name in sorted(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else []:
        if not _NAME_RE.match(name):
            continue
        pid = int(name.split("-")[1])
        if os.path.exists(f"/proc/{pid}"):
            continue
        try:
            out.append((name, pid, os.stat(os.path.join(SHM_DIR, name)).st_size))
        except OSError:
            continue
    return out


def _size(n_slots: int, slot_bytes: int, n_keys: int) -> int:
    """The segment's bytes: the slots, then the directory (when it has one)."""
    return n_slots * slot_bytes + (Directory.nbytes(n_keys, n_slots) if n_keys else 0)


def _check_geometry(n_slots: int, slot_bytes: int) -> None:
    if n_slots < 1 or slot_bytes < 1 or slot_bytes % mmap.PAGESIZE:
        raise ArenaError(f"bad arena geometry: {n_slots} slots of {slot_bytes} bytes "
                         f"(need >= 1 slot, slot size a multiple of {mmap.PAGESIZE})")


class _Slots:
    """`n_slots` fixed-size slots over one memory map: what the daemon's and a client's side share."""

    def __init__(self, name: str, mm: mmap.mmap, n_slots: int, slot_bytes: int, n_keys: int = 0):
        self.name, self.n_slots, self.slot_bytes = name, n_slots, slot_bytes
        self._mm: mmap.mmap | None = mm
        self._view = memoryview(mm)
        at = n_slots * slot_bytes
        self.directory = Directory(self._view[at:], n_keys, n_slots) if n_keys else None

    @property
    def directory_geometry(self) -> dict | None:
        """Where the directory lies, for the `welcome` (None: this arena has none)."""
        d = self.directory
        return None if d is None else {"offset": self.n_slots * self.slot_bytes, "n_keys": d.n_keys,
                                       "max_parts": MAX_PARTS}

    def slot(self, i: int) -> memoryview:
        """View of slot i (writable for the daemon's Arena, read-only for an ArenaView)."""
        if not 0 <= i < self.n_slots:
            raise IndexError(f"slot {i} out of range [0, {self.n_slots})")
        return self._view[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    def whole(self) -> memoryview:
        """View of every slot at once (slot i's bytes at i * slot_bytes): lets a reader hand one
        buffer and offsets to a kernel that computes over several slots."""
        return self._view[: self.n_slots * self.slot_bytes]

    def _unmap(self) -> bool:
        """Drop the mapping; False when it was already gone."""
        if self._mm is None:
            return False
        self._view.release()
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a slot view; the mapping goes with the last one
            pass
        self._mm = None
        return True


class Arena(_Slots):
    """The daemon's writable arena: `n_slots` fixed-size slots in one shm segment.

    Layout of /dev/shm/moestream-<pid>-<uuid> (`size = n_slots * slot_bytes`, then the
    `Directory` when the daemon keeps one; no header: the geometry travels in the `welcome`)::

        offset 0            slot_bytes          2*slot_bytes              (n-1)*slot_bytes
        +-------------------+-------------------+-----------+---------------------------+
        | slot 0            | slot 1            |    ...    | slot n-1                  |
        +-------------------+-------------------+-----------+---------------------------+

        one slot (a blob: an expert's parts; offsets come from `plan_reads` and `ready`):
        +----------------+---pad to 4096---+----------------+---pad---+--------------+----+
        | gate part      |                 | up part        |         | down part    |pad |
        +----------------+-----------------+----------------+---------+--------------+----+
        with O_DIRECT each part is the enclosing 4096-aligned file range, and the part
        starts `offset % 4096` bytes into it.

    A slot's bytes change only while it is not leased to anyone (the host tier guarantees
    that); the generation number in `ready` tells clients which contents they hold.
    """

    def __init__(self, name: str, fd: int, mm: mmap.mmap, n_slots: int, slot_bytes: int, n_keys: int = 0):
        super().__init__(name, mm, n_slots, slot_bytes, n_keys)
        self._fd = fd

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(cls, n_slots: int, slot_bytes: int, *, mode: int = 0o660, group: str | None = None,
               prefault: bool = True, n_keys: int = 0) -> Arena:
        """A new segment with a unique name, every page touched once. Its mode is `mode` less any
        write bit but the owner's (0660 -> 0640): the group (decoders) may read the experts and
        never change what the others are served; nobody else may open it. `n_keys` > 0 adds a
        `Directory` of that many (layer, expert) keys after the slots."""
        _check_geometry(n_slots, slot_bytes)
        size = _size(n_slots, slot_bytes, n_keys)
        name = f"{NAME_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"  # the pid says whose it is
        path = os.path.join(SHM_DIR, name)
        mode = arena_mode(mode)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            # Held for the daemon's life: a segment nobody holds locked is a crashed daemon's.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                raise ArenaError(f"{path} was removed while being created")
            os.fchmod(fd, mode)  # umask must not decide who can read the experts
            if group is not None:
                os.fchown(fd, -1, _gid(group))
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        arena = cls(name, fd, mm, n_slots, slot_bytes, n_keys)
        if prefault:
            arena._prefault()
        if arena.directory is not None:
            arena.directory.init()
        return arena

    @staticmethod
    def remove_stale() -> list[str]:
        """Unlink arenas left by daemons that died without cleaning up (SIGKILL, OOM); returns their names.

        Only this user's segments, and only those no live daemon holds locked."""
        removed = []
        for name in sorted(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else []:
            path = os.path.join(SHM_DIR, name)
            if not _NAME_RE.match(name):
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                if os.fstat(fd).st_uid != os.geteuid():
                    continue
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live daemon holds it
            else:
                os.unlink(path)
                removed.append(name)
            finally:
                os.close(fd)
        return removed

    def _prefault(self) -> None:
        # Reserve and touch every page now: the first read into a slot never waits on page
        # faults, and a too-small /dev/shm fails here with a clear error, not SIGBUS later.
        size = len(self._mm)
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as e:
            self.close(unlink=True)
            raise ArenaError(f"cannot allocate {size} bytes in {SHM_DIR}: {e.strerror}") from None
        populate = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14
        try:
            self._mm.madvise(populate)
        except OSError:
            step = mmap.PAGESIZE
            for off in range(0, len(self._mm), step):
                self._mm[off] = 0

    def close(self, unlink: bool = True) -> None:
        if not self._unmap():
            return
        os.close(self._fd)
        if unlink:  # even with a view still exported: the name goes, the memory with the last view
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class ArenaView(_Slots):
    """A client's read-only attachment (no resource tracker: O_RDONLY + PROT_READ mmap)."""

    @classmethod
    def attach(cls, name: str, n_slots: int, slot_bytes: int, directory: dict | None = None) -> ArenaView:
        """Map the arena read-only; `directory` is the welcome's geometry of its `Directory` (None: none)."""
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ArenaError(f"refusing to attach {name!r}: not a moestream arena name")
        _check_geometry(n_slots, slot_bytes)
        n_keys = _directory_keys(directory, n_slots, slot_bytes)
        need = _size(n_slots, slot_bytes, n_keys)
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise ArenaError(f"cannot open arena {path}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < need:
                raise ArenaError(f"arena {path} has {size} bytes, expected {need}")
            mm = mmap.mmap(fd, need, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)  # the mapping keeps the segment alive
        view = cls(name, mm, n_slots, slot_bytes, n_keys)
        if view.directory is not None and not view.directory.valid():
            view.close()
            raise ArenaError(f"arena {path}: its directory's header does not match the welcome's geometry")
        return view

    def close(self) -> None:
        self._unmap()


def _directory_keys(geometry: dict | None, n_slots: int, slot_bytes: int) -> int:
    if geometry is None:
        return 0
    try:
        offset, n_keys, max_parts = int(geometry["offset"]), int(geometry["n_keys"]), int(geometry["max_parts"])
    except (KeyError, TypeError, ValueError):
        raise ArenaError(f"bad arena directory geometry {geometry!r:.80}") from None
    if offset != n_slots * slot_bytes or not 0 < n_keys <= 1 << 31 or max_parts != MAX_PARTS:
        raise ArenaError(f"arena directory geometry {geometry!r:.80} is not this version's (offset "
                         f"{n_slots * slot_bytes}, {MAX_PARTS} parts)")
    return n_keys


class Directory:
    """Which expert each arena slot holds, published by the daemon for lease-free reads.

    The daemon is the only writer (its event loop); decoders read it to compute an expert that
    is already in the arena without a round trip. Seqlock-style, per slot::

        header     u64[4]            magic, n_keys, n_slots, max_parts
        key_slot   i32[n_keys]       key (layer * n_expert + expert) -> its slot, -1 when not ready
        slot_seq   u64[n_slots]      2 * generation while the slot's bytes are stable, odd while written
        slot_key   i64[n_slots]      the key whose bytes the slot holds, -1 none
        slot_offs  u32[n_slots, 8]   each part's offset inside the slot, in the layout's part order

    A reader looks up `key_slot`, reads `slot_seq` (even) and `slot_key` (the key), computes from
    the slot, then reads `slot_seq` again: unchanged means the bytes it read were that expert's
    all along (a slot is marked odd before the daemon overwrites it, and each load bumps its
    generation, so no change can go unseen); changed means recompute from a lease. The kernel
    call between the two reads joins its threads, which orders their loads before the second
    read (on weakly ordered CPUs as well as on x86).
    """

    MAGIC = 0x31305249_44534D  # "MSDIR01"

    def __init__(self, buf: memoryview, n_keys: int, n_slots: int):
        self.n_keys, self.n_slots = n_keys, n_slots
        a = np.frombuffer(buf, dtype=np.uint8, count=Directory.nbytes(n_keys, n_slots))
        at = 32
        self.header = a[:at].view(np.uint64)  # [4]
        self.key_slot = a[at:at + 4 * n_keys].view(np.int32)  # [n_keys]
        at = _round8(at + 4 * n_keys)
        self.slot_seq = a[at:at + 8 * n_slots].view(np.uint64)  # [n_slots]
        at += 8 * n_slots
        self.slot_key = a[at:at + 8 * n_slots].view(np.int64)  # [n_slots]
        at += 8 * n_slots
        self.slot_offs = a[at:at + 4 * MAX_PARTS * n_slots].view(np.uint32).reshape(n_slots, MAX_PARTS)
        # the same words as memoryviews, for the reader's scalar lookups
        self._key_slot = memoryview(self.key_slot).cast("B").cast("i")
        self._seq = memoryview(self.slot_seq).cast("B").cast("Q")
        self._slot_key = memoryview(self.slot_key).cast("B").cast("q")

    @staticmethod
    def nbytes(n_keys: int, n_slots: int) -> int:
        raw = _round8(32 + 4 * n_keys) + 16 * n_slots + 4 * MAX_PARTS * n_slots
        return -(-raw // mmap.PAGESIZE) * mmap.PAGESIZE

    # -- the daemon's side ----------------------------------------------------------------------
    def init(self) -> None:
        self.key_slot[:] = -1
        self.slot_key[:] = -1
        self.slot_seq[:] = 1  # no generation published yet
        self.header[:] = (self.MAGIC, self.n_keys, self.n_slots, MAX_PARTS)

    def loading(self, slot: int, generation: int, evicted: int | None) -> None:
        """`slot` is about to be overwritten (its new load is `generation`); `evicted` was its key."""
        self.slot_seq[slot] = 2 * generation + 1  # first: a reader of the old bytes sees the change
        if evicted is not None and self.key_slot[evicted] == slot:
            self.key_slot[evicted] = -1
        self.slot_key[slot] = -1

    def ready(self, slot: int, generation: int, key: int, offsets: list[int]) -> None:
        """`slot` holds `key`'s bytes at `generation`, its parts at `offsets` (the layout's order)."""
        self.slot_offs[slot, :len(offsets)] = offsets
        self.slot_key[slot] = key
        self.slot_seq[slot] = 2 * generation  # last: stable from here on
        self.key_slot[key] = slot

    # -- a reader's side --------------------------------------------------------------------------
    def valid(self) -> bool:
        return tuple(int(v) for v in self.header) == (
            self.MAGIC, self.n_keys, self.n_slots, MAX_PARTS)

    def lookup(self, keys: Sequence[int], first: int = 0) -> dict[int, tuple[int, int]]:
        """{key: (slot, seq)} of the `keys` whose slot holds them complete now (check them with
        `moved` after reading the slots); the keys are `first + k` (a layer's experts: its first
        key and their numbers). Plain Python over memoryview casts: for a layer's few experts
        that is several times faster than numpy's small-array calls."""
        key_slot, seq, slot_key, n_slots = self._key_slot, self._seq, self._slot_key, self.n_slots
        found = {}
        for k in keys:
            s = key_slot[first + k]
            if 0 <= s < n_slots:
                q = seq[s]
                if not q & 1 and slot_key[s] == first + k:
                    found[k] = (s, q)
        return found

    def moved(self, found: dict[int, tuple[int, int]]) -> list[int]:
        """The keys of `found` (a `lookup`) whose slot no longer holds what it held then."""
        seq = self._seq
        return [k for k, (s, q) in found.items() if seq[s] != q]


MAX_PARTS = 8  # parts per expert a directory entry can place (gate, up, down and their biases)


def _round8(n: int) -> int:
    return (n + 7) & ~7


def arena_mode(socket_mode: int) -> int:
    """The arena file's mode for a daemon whose sockets get `socket_mode`: owner read-write, the
    group read-only at most, others nothing."""
    return socket_mode & 0o640


def _gid(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ArenaError(f"unknown group {group!r}") from None
